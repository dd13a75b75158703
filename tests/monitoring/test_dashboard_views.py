"""What the AstraFlow page and its endpoints say of a run as a researcher watches it: the
restarts of its components, a finished run's partitions, a token that is not the run's."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from tornado import web

from astraflow.cli import main
from astraflow.runtime import dashboard
from astraflow.runtime.monitoring import build_status_view
from storage.paths import RunPaths

from tests.monitoring.test_dashboard_fixes import get, guarded_app, serve


def write_status(run_dir: Path, **fields) -> RunPaths:
    """A run directory whose status file holds one policy at v3 and ``fields``."""
    paths = RunPaths(run_dir).make()
    paths.status_file.write_text(json.dumps({
        "written_at": time.time(), "data_layer": {"versions": {"solver": 3}}, "trainers": {"solver": {"version": 3}},
        "partitions": {}, "workers": {}, **fields}))
    return paths


@pytest.fixture
def driver(tmp_path):
    """Headless chromium (skips where it is missing), quit after the test."""
    from tests.monitoring.test_monitoring import _driver

    d = _driver(tmp_path)
    yield d
    d.quit()


def page_texts(driver, run_dir: Path, *ids: str) -> dict[str, str]:
    """The text of each element of ``ids`` on the page of ``run_dir`` once it rendered the run's
    status (empty for a hidden one)."""
    with serve(web.Application(dashboard.routes(run_dir))) as (port, _):
        driver.get(f"http://127.0.0.1:{port}/astraflow?refresh=300")
        deadline = time.time() + 30
        while driver.execute_script("return document.getElementById('run-dir').textContent;") != str(run_dir):
            assert time.time() < deadline, driver.find_element("tag name", "main").text
            time.sleep(0.1)
        return {i: driver.execute_script(f"const e = document.getElementById('{i}');"
                                         "return e.offsetParent === null ? '' : e.textContent;") for i in ids}


# ------------------------------------------------------------------ restarts


RESTARTS = {"trainer_restarts": {"solver": {"count": 1, "limit": 2, "restarts": []}},
            "data_layer_restarts": {"count": 2, "limit": 2, "restarts": []}}


def test_the_status_view_counts_the_data_layer_restarts(tmp_path):
    """`astraflow status` prints them; `status --json` and the page read the view."""
    paths = write_status(tmp_path / "run", **RESTARTS)
    view = build_status_view(paths.root)
    assert view.policies[0].restarts == 1 and view.data_layer_restarts == 2
    assert build_status_view(write_status(tmp_path / "calm").root).data_layer_restarts == 0


@pytest.mark.browser
@pytest.mark.timeout(120)
def test_the_page_shows_the_restarts_of_the_trainers_and_the_data_layer(tmp_path, driver):
    paths = write_status(tmp_path / "run", **RESTARTS)
    got = page_texts(driver, paths.root, "restarts-box")["restarts-box"]
    assert "trainer solver 1" in got and "data layer 2" in got, got
    calm = write_status(tmp_path / "calm")
    assert page_texts(driver, calm.root, "restarts-box") == {"restarts-box": ""}  # hidden: nothing restarted


# ------------------------------------------------------------------ a finished run


ROLLOUT = {"scheduler": "local", "role": "rollout", "hardware": "cpu", "region": "local", "nodes": 2, "live": 2,
           "serving": 2, "state": "active", "completed": 232, "episodes_per_s": 56.7, "tokens_per_s": 803.0}


def test_a_finished_run_has_no_partition_throughput_left_from_its_last_window(tmp_path):
    """A partition's rate is over the last ~10 s of the run: once it finished, nothing generates
    (as its live workers, 0), the run-wide figures say how fast it went."""
    paths = write_status(tmp_path / "run", partitions={"rollout": ROLLOUT})
    running = next(p for p in build_status_view(paths.root).partitions if p.name == "rollout")
    assert (running.live, running.trajectories_per_s, running.tokens_per_s) == (2, 56.7, 803.0)
    paths.summary.write_text(json.dumps({"status": "completed", "reason": None, "steps": {"solver": 3},
                                         "partitions": {"rollout": ROLLOUT}, "data_layer": {"elapsed_s": 19.0}}))
    view = build_status_view(paths.root)
    assert view.finished
    ended = next(p for p in view.partitions if p.name == "rollout")
    assert (ended.live, ended.trajectories_per_s, ended.tokens_per_s) == (0, 0.0, 0.0)
    assert ended.consumed == running.consumed and ended.desired == 2  # what it did is kept



def test_a_run_stopped_while_its_trainer_waited_is_not_waiting_once_finished(tmp_path):
    """Stopped because rollout starved the trainer: its final state keeps the wait's length, which
    the page showed as '(waiting 2m)' on a run that had ended."""
    waiting = {"version": 3, "wait_fraction": 0.9, "batch_wait_s": 120.0}
    paths = write_status(tmp_path / "run", trainers={"solver": waiting})
    assert build_status_view(paths.root).policies[0].batch_wait_s == 120.0  # while it runs: said
    paths.summary.write_text(json.dumps({"status": "interrupted", "reason": "stopped by SIGINT", "steps": {"solver": 3},
                                         "trainers": {"solver": {**waiting, "done": True}}, "data_layer": {}}))
    policy = build_status_view(paths.root).policies[0]
    assert policy.batch_wait_s == 0.0 and policy.wait_fraction == 0.9 and policy.step == 3

# ------------------------------------------------------------------ the token


@pytest.mark.parametrize("how", ["query", "header"])
def test_a_token_that_is_not_the_runs_is_told_apart_from_none(tmp_path, how):
    """An address kept from an earlier start of the run carries that start's token."""
    with serve(guarded_app(tmp_path, "token-of-this-start")) as (port, _):
        none = get(port, "/astraflow/api/status.json")
        wrong = (get(port, "/astraflow/api/status.json?token=token-of-the-last-start") if how == "query" else
                 get(port, "/astraflow/api/status.json", {"Authorization": "token token-of-the-last-start"}))
    assert none[0] == wrong[0] == 403
    assert "needs the run's token" in none[2] and "not this" not in none[2]
    assert "token given is not this AstraFlow dashboard's" in wrong[2] and "resume" in wrong[2], wrong[2]
    assert "dashboard.url" in wrong[2] and "token-of" not in wrong[2]


# ------------------------------------------------------------------ a run killed while it started


@pytest.mark.parametrize("files", ["lock", "lock+orchestrator"])
def test_a_run_killed_before_its_first_status_is_said_to_be_gone_not_never_started(tmp_path, files):
    """Killed while its scheduler started (only its lock names it) or while its workers joined
    (its orchestrator file too): not 'no run has started', which sends the user to another directory."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # its pid names no process now
    dead = {"pid": gone.pid, "host": socket.gethostname(), "started": time.time() - 5}
    paths = RunPaths(tmp_path / "run").make()
    paths.run_lock.write_text(json.dumps(dead))
    if files == "lock+orchestrator":
        paths.orchestrator_file.write_text(json.dumps(dead))
    with pytest.raises(ValueError, match=r"stopped before its first status: its `astraflow run` \(pid \d+ on"):
        build_status_view(paths.root)
    for flags in ([], ["--json"]):
        res = CliRunner().invoke(main, ["status", str(paths.root), *flags])
        assert res.exit_code == 2 and "is gone without a summary" in res.output, res.output
        assert "no run has started" not in res.output and "starts it again" in res.output
    paths.run_lock.write_text("")  # a run that let go of the directory: nothing is said of it
    paths.orchestrator_file.unlink(missing_ok=True)
    assert "no run has started" in CliRunner().invoke(main, ["status", str(paths.root)]).output


# ------------------------------------------------------------------ a run that writes no status


@pytest.mark.browser
@pytest.mark.timeout(120)
def test_a_page_served_while_the_run_writes_no_status_says_so_not_stopped(tmp_path, driver):
    """The page is served by the run's scheduler: a run neither running nor finished there has an
    `astraflow run` that is busy, hung or suspended (`astraflow status` says which), not one that stopped."""
    paths = write_status(tmp_path / "run")
    status = json.loads(paths.status_file.read_text())
    paths.status_file.write_text(json.dumps({**status, "written_at": time.time() - 100}))
    got = page_texts(driver, paths.root, "run-state")["run-state"]
    assert got.startswith("no status for 1m 4") and "stopped" not in got, got
    title = driver.execute_script("return document.getElementById('run-state').title;")
    assert f"astraflow status {paths.root}" in title and "hung" in title, title
