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
print("ready", flush=True)
time.sleep(0.2)
ignore_stop_signals()
sys.exit(130)
"""


def test_a_late_ctrl_c_does_not_turn_exit_130_into_death_by_signal():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"ready"
    time.sleep(0.9)  # the child is in its exit now, releasing SlowTeardown
    child.send_signal(signal.SIGINT)
    assert child.wait(30) == 130
