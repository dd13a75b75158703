"""``astraflow plan`` through the real CLI, on what its simulated runs leave behind: a plan run
again on one ``--workdir`` simulates afresh (an earlier plan's run resumed would mix two runs'
steps into the numbers) and removes only its own directories there; Ctrl-C twice still stops
the simulated run completely and exits 130."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.plan.planner import SIM_MARKER

ROOT = Path(__file__).resolve().parents[2]
SIM = str(ROOT / "examples/sim/config.yaml")
#: a short plan: 8 steps of one engine, a real step of half a second
SHORT = ["--pool", "h100=1", "--gpus-per-node", "1", "--no-search", "--time-scale", "6"]


def _plan(workdir: Path, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "astraflow", "plan", SIM, *SHORT, *args, "--workdir", str(workdir)],
                            cwd=ROOT, **kwargs)


def _loss_steps(metrics: Path) -> list[int]:
    return [m["step"] for m in map(json.loads, metrics.read_text().splitlines()) if "loss" in m]


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_a_plan_run_again_on_its_workdir_simulates_afresh(tmp_path):
    """The second plan's run starts at step 0 with nothing of the first's in its directory, and
    what the user keeps beside the plan's runs in the work dir stays."""
    wd = tmp_path / "wd"
    (wd / "notes").mkdir(parents=True)
    (wd / "notes" / "mine.txt").write_text("the user's")
    (wd / "sim.yaml").write_text("the user's")
    outputs = []
    for _ in range(2):
        proc = _plan(wd, "--minutes", "0.4", "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=150)
        finally:  # a plan past its time is killed (its run and cluster die with it), not waited on forever
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        outputs.append((json.loads(out), err))
        if len(outputs) == 1:
            (wd / "sim0" / "run" / "left-by-the-first-plan").write_text("")
    (first, _), (second, err) = outputs
    steps = second["assumptions"]["steps"]
    progress = [line for line in err.splitlines() if line.startswith("plan: step ")]
    assert progress[0] == f"plan: step 0/{steps}", err[-3000:]  # not resumed where the first run ended
    assert _loss_steps(wd / "sim0" / "run" / "metrics.jsonl") == list(range(1, steps + 1))
    assert second["overall"]["steps"] == first["overall"]["steps"] == steps
    assert (wd / "sim0" / SIM_MARKER).is_file() and not (wd / "sim0" / "run" / "left-by-the-first-plan").exists()
    assert (wd / "notes" / "mine.txt").read_text() == (wd / "sim.yaml").read_text() == "the user's"


def test_a_workdir_whose_run_directory_the_plan_did_not_make_is_refused(tmp_path):
    """A ``sim0`` without the plan's marker (the user's, or an older plan's) is neither removed
    nor resumed: exit 2 naming the fix, before anything is simulated."""
    (tmp_path / "sim0").mkdir()
    (tmp_path / "sim0" / "mine.txt").write_text("the user's")
    res = CliRunner().invoke(main, ["plan", SIM, *SHORT, "--minutes", "0.4", "--workdir", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "was not made by astraflow plan" in res.output and "give another --workdir" in res.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["mine.txt", "sim0"]


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_ctrl_c_twice_stops_the_simulated_run_completely_and_exits_130(tmp_path):
    """The second SIGINT arrives while the plan stops its run: it is noted, not obeyed, so the plan
    exits only once the run and its cluster's processes are gone, with 130."""
    log = (tmp_path / "plan.err").open("w")
    plan = _plan(tmp_path, "--minutes", "30", stdout=subprocess.DEVNULL, stderr=log)
    family: list[psutil.Process] = []
    try:
        metrics = tmp_path / "sim0" / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.exists() and '"loss"' in metrics.read_text()):  # mid-simulation: steps are being taken
            assert plan.poll() is None and time.time() < deadline, "the simulated run did not start"
            time.sleep(0.5)
        family = psutil.Process(plan.pid).children(recursive=True)  # the run and its cluster's processes
        assert family
        plan.send_signal(signal.SIGINT)
        time.sleep(1.0)  # the run takes seconds to stop: the second lands while the plan waits for it
        plan.send_signal(signal.SIGINT)
        assert plan.wait(timeout=100) == 130
        _, alive = psutil.wait_procs(family, timeout=10)  # gone with the plan (their parent's death), not left running
        assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"
        err = (tmp_path / "plan.err").read_text()
        assert "already stopping the simulated run" in err and "Aborted!" not in err, err[-3000:]
    finally:
        if plan.poll() is None:
            plan.kill()
        plan.wait()
        for proc in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        log.close()
