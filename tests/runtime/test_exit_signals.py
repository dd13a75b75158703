"""A stopped run's exit code survives a Ctrl-C that arrives while the process exits."""

import signal
import subprocess
import sys
import time

CHILD = """
import signal, sys, time
from astraflow.runtime.launch import _signals_stop_cleanly
from astraflow.runtime.stopping import ignore_stop_signals

class SlowTeardown:  # a module global: released late in the interpreter's exit
    def __del__(self, sleep=time.sleep):  # the module's globals may be gone by then
        sleep(1.5)

keep = SlowTeardown()
_signals_stop_cleanly()  # the run's handlers, as `astraflow run` installs them
ignore_stop_signals()
print("exiting", flush=True)
sys.exit(130)
"""


def test_a_late_ctrl_c_does_not_turn_exit_130_into_death_by_signal():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"exiting"
    time.sleep(0.5)  # the child is in its exit now, releasing SlowTeardown
    child.send_signal(signal.SIGINT)
    assert child.wait(30) == 130


STOPPING_CHILD = """
import sys, time
from astraflow.runtime.launch import _signals_stop_cleanly
from astraflow.runtime.stopping import STOPPING

_signals_stop_cleanly()
STOPPING.set()  # what the orchestrator does once the run is on its way out, however it ended
print("stopping", flush=True)
t0 = time.time()
while time.time() - t0 < 1.5:  # the shutdown: summary, teardown
    time.sleep(0.05)
print("summary written", flush=True)
sys.exit(0)
"""


def test_a_stop_signal_during_a_finished_runs_shutdown_does_not_break_it():
    """A completed (or failed) run is writing its summary and cancelling its jobs when SIGTERM
    arrives: the shutdown goes on and the run's own exit code stands."""
    child = subprocess.Popen([sys.executable, "-c", STOPPING_CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"stopping"
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0 and b"summary written" in out and b"already stopping" in err
