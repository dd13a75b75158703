"""Bad input to every CLI command that reads a run directory or a file: damaged files of a run
(status, orchestrator, summary, desired partitions: not UTF-8, not JSON, not an object), a
``--from-yaml`` that is not UTF-8, paths that do not exist. Each exits 2 with one message line
and no traceback; the metrics readers (``status --json --metrics``, ``plot``) skip damaged lines
of ``metrics.jsonl`` and still work. In process (`CliRunner`): the subprocess path of the same
CLI is covered by ``test_bad_input.py``."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from astraflow.cli import main
from storage.paths import RunPaths

GARBAGE = b"\xff\xfe{not json"
METRICS = (b'{"step": 1, "policy": "p", "reward_mean": 0.5, "time": 1.0}\n'
           b'{"step": 2, "policy": "p", "rew\n'          # a truncated line
           b"\xff\xfe garbage\n[1, 2]\n\"text\"\n"        # not UTF-8, not an object
           b'{"step": "x", "policy": "p"}\n'              # no integer step
           b'{"step": 3, "policy": "p", "reward_mean": NaN, "loss": "high", "time": 3.0}\n'
           b'{"step": 4, "policy": "p", "reward_mean": 0.7, "time": 4.0, "data_staleness_hist": {"0": 2, "x": 1}}\n')


def _run_dir(tmp_path: Path, **files: bytes | str) -> str:
    """A run directory whose orchestrator (this process) looks alive, with ``files`` written
    over its own (attribute names of `RunPaths`, or ``/relative/path``)."""
    p = RunPaths(tmp_path / "run").make()
    p.orchestrator_file.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                               "started": time.time(), "dashboard": None, "scheduler": None}))
    p.status_file.write_text(json.dumps({"written_at": time.time(), "run_dir": str(p.root), "partitions": {},
                                         "workers": {}, "data_layer": {}, "trainers": {}}))
    p.desired_partitions.write_text(json.dumps({"partitions": [{"name": "rollout"}], "removals": {}}))
    p.metrics.write_bytes(METRICS)
    for name, content in files.items():
        path = p.root / name[1:] if name.startswith("/") else getattr(p, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(p.root)


def _add(**files):
    return lambda t: ["partitions", "add", _run_dir(t, **files), "extra", "--nodes", "1", "--wait", "0"]


EXIT_2 = {
    "status: status.json not UTF-8": (lambda t: ["status", _run_dir(t, status_file=GARBAGE)], "status.json cannot be read"),
    "status: status.json a list": (lambda t: ["status", _run_dir(t, status_file="[1]")], "status.json holds a JSON list"),
    "status --json: status.json truncated": (lambda t: ["status", "--json", _run_dir(t, status_file='{"written_at": ')],
                                             "status.json cannot be read"),
    "status: orchestrator.json garbage": (lambda t: ["status", _run_dir(t, orchestrator_file=GARBAGE)],
                                          "orchestrator.json cannot be read"),
    "status: summary.json garbage": (lambda t: ["status", _run_dir(t, summary=GARBAGE)], "summary.json cannot be read"),
    "status --json: summary.json a number": (lambda t: ["status", "--json", _run_dir(t, summary="3")],
                                             "summary.json holds a JSON int"),
    "status: no run directory": (lambda t: ["status", str(t / "nope")], "is not a run directory"),
    "partitions list: status.json garbage": (lambda t: ["partitions", "list", _run_dir(t, status_file=GARBAGE)],
                                             "status.json cannot be read"),
    "partitions add: desired file garbage": (_add(desired_partitions=GARBAGE), "not a valid desired-partitions file"),
    "partitions add: desired file a list": (_add(desired_partitions="[1]"), "not a valid desired-partitions file"),
    "partitions add: desired entry invalid": (_add(desired_partitions='{"partitions": [{"nodes": -1}]}'),
                                              "not a valid desired-partitions file"),
    "partitions add: status.json garbage": (_add(status_file=GARBAGE), "status.json cannot be read"),
    "partitions remove: desired file garbage": (lambda t: ["partitions", "remove", _run_dir(t, desired_partitions=GARBAGE),
                                                           "rollout"], "not a valid desired-partitions file"),
    "partitions add --from-yaml not UTF-8": (lambda t: ["partitions", "add", _run_dir(t, **{"/p.yaml": b"name: x # caf\xe9\n"}),
                                                        "--from-yaml", str(t / "run" / "p.yaml")], "can't decode"),
    "partitions add --from-yaml missing": (lambda t: ["partitions", "add", _run_dir(t), "--from-yaml", str(t / "no.yaml")],
                                           "No such file"),
    "check: config missing": (lambda t: ["check", str(t / "no.yaml")], "not found"),
    "run: config missing": (lambda t: ["run", str(t / "no.yaml")], "not found"),
    "plot: no metrics line": (lambda t: ["plot", _run_dir(t, metrics=GARBAGE + b"\n")], "has no metrics yet"),
    "model init: directory not empty": (lambda t: ["model", "init", _run_dir(t)], "exists and is not empty"),
}


def _invoke(args):
    res = CliRunner().invoke(main, args)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exc_info
    assert "Traceback" not in res.output
    return res


@pytest.mark.parametrize("case", list(EXIT_2))
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    make, needle = EXIT_2[case]
    res = _invoke(make(tmp_path))
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], res.output


def test_status_metrics_skips_damaged_lines(tmp_path):
    res = _invoke(["status", "--json", "--metrics", _run_dir(tmp_path)])
    assert res.exit_code == 0, res.output
    view = json.loads(res.output[res.output.index("{"):])
    curves = view["policies"]["p"]
    assert curves["step"] == [1, 3, 4] and view["skipped"] == 5
    assert curves["reward_mean"] == [0.5, None, 0.7] and curves["loss"] == [None, None, None]
    assert curves["staleness_hist"] == {"0": 2}


def test_plot_skips_damaged_lines(tmp_path):
    res = _invoke(["plot", _run_dir(tmp_path), "--out", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "accuracy.png", "reward.png", "staleness.png", "throughput.png"]


def test_the_dashboard_status_reads_a_damaged_snapshot_as_an_error_message(tmp_path):
    from astraflow.runtime.monitoring import MetricsReader, build_status_view

    run = Path(_run_dir(tmp_path, status_file=GARBAGE))
    with pytest.raises(ValueError, match="status.json cannot be read"):  # the page shows it and retries
        build_status_view(run)
    reader = MetricsReader(run)
    assert reader.view().lines == 3
    with open(RunPaths(run).metrics, "ab") as fh:  # a damaged line appended later does not stop it
        fh.write(b'{"step": 5, "policy": "p"\n{"step": 6, "policy": "p", "reward_mean": 0.9}\n')
    view = reader.view()
    assert view.lines == 4 and view.skipped == 6 and view.policies["p"].step[-1] == 6


def test_resuming_on_a_damaged_manifest_exits_2_before_anything_starts(tmp_path):
    import torch

    from storage import paths as store_paths
    from storage.weights import WeightStore

    run = RunPaths(tmp_path / "run").make()
    WeightStore(run.weights).publish("solver", 3, {"w": torch.ones(2)})
    manifest = store_paths.manifest_file(run.weights, "solver", 3)
    manifest.write_bytes(GARBAGE)
    config = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"
    res = CliRunner().invoke(main, ["run", str(config), "--run-dir", str(run.root), "--quiet"])
    assert res.exit_code == 2, res.output
    assert f"{manifest} is damaged" in res.output and "out of the run directory" in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not run.scheduler_file.exists() and not run.summary.exists()  # nothing started


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_resuming_on_a_cut_short_weight_shard_exits_2_before_anything_starts(tmp_path, damage):
    """A shard of the newest version cut short (a copy of the run directory that stopped part way)
    would fail every RaaS node's and the trainer's start with DCP's read error: refused first."""
    import torch

    from storage import paths as store_paths
    from storage.weights import WeightStore

    run = RunPaths(tmp_path / "run").make()
    store = WeightStore(run.weights)
    store.publish("solver", 3, {"w": torch.ones(64)})
    vdir = store_paths.version_dir(run.weights, "solver", 3)
    [shard] = [f for f in vdir.iterdir() if f.suffix == ".distcp"]
    if damage == "truncated":
        os.truncate(shard, 100)
    else:
        shard.unlink()
    config = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"
    res = CliRunner().invoke(main, ["run", str(config), "--run-dir", str(run.root), "--quiet"])
    assert res.exit_code == 2, res.output
    assert f"{shard} is damaged" in res.output and f"move {vdir} out of the run directory" in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not run.scheduler_file.exists() and not run.summary.exists()  # nothing started


def test_resuming_on_a_damaged_dataflow_snapshot_exits_2_before_anything_starts(tmp_path):
    run = RunPaths(tmp_path / "run").make()
    run.dataflow_snapshot.write_bytes(GARBAGE)
    config = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"
    res = CliRunner().invoke(main, ["run", str(config), "--run-dir", str(run.root), "--quiet"])
    assert res.exit_code == 2, res.output
    assert f"{run.dataflow_snapshot} cannot be read" in res.output
    assert "and its control/dataflow.changes.* aside to resume from control/dataflow_state.json alone" in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not run.scheduler_file.exists() and not run.summary.exists()  # nothing started


def test_resuming_with_max_steps_below_the_committed_version_exits_2_before_anything_starts(tmp_path):
    import torch

    from storage.weights import WeightStore

    run = RunPaths(tmp_path / "run").make()
    WeightStore(run.weights).publish("solver", 7, {"w": torch.ones(2)})
    config = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"
    res = CliRunner().invoke(main, ["run", str(config), "--run-dir", str(run.root), "--quiet",
                                    "--set", "run.max_steps=5"])
    assert res.exit_code == 2, res.output
    assert "run.max_steps 5 is below v7" in res.output and "set run.max_steps to 7 or more" in res.output
    assert not run.scheduler_file.exists() and not run.summary.exists()  # nothing started


@pytest.mark.parametrize("content, needle", [
    (GARBAGE, "cannot be read as JSON"),
    (b'{"versions": {"solver": 2}}', "is damaged (it lacks group_seq"),
])
def test_resuming_on_a_damaged_dataflow_state_exits_2_before_anything_starts(tmp_path, content, needle):
    run = RunPaths(tmp_path / "run").make()
    run.dataflow_state.write_bytes(content)
    config = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"
    res = CliRunner().invoke(main, ["run", str(config), "--run-dir", str(run.root), "--quiet"])
    assert res.exit_code == 2, res.output
    assert str(run.dataflow_state) in res.output and needle in res.output and "move it aside" in res.output
    assert "Traceback" not in res.output and not run.scheduler_file.exists()  # nothing started


def test_resuming_with_a_renamed_policy_exits_2_naming_both(tmp_path):
    """A renamed policy would start afresh beside the old one's weights (its metrics mixed into
    the same log): the resume is refused before anything starts."""
    import torch

    from storage.weights import WeightStore

    run = RunPaths(tmp_path / "run").make()
    config = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"
    WeightStore(run.weights).publish("solver", 2, {"w": torch.ones(2)})
    res = CliRunner().invoke(main, ["run", str(config), "--run-dir", str(run.root), "--quiet",
                                    "--set", "policies.0.name=solver_v2"])
    assert res.exit_code == 2, res.output
    assert "trains the policies ['solver'], the config names ['solver_v2']" in res.output
    assert "start a new run directory" in res.output and "Traceback" not in res.output
    assert not run.scheduler_file.exists() and not run.summary.exists()  # nothing started
    same = CliRunner().invoke(main, ["check", str(config)])  # the config itself is fine
    assert same.exit_code == 0, same.output


def test_a_refused_resume_still_cancels_the_jobs_the_previous_incarnation_left(tmp_path):
    from astraflow.runtime.jobrecords import JobRecords
    from schedulers import LocalScheduler, Partition
    from schedulers.procs import process_identity

    run = RunPaths(tmp_path / "run").make()
    previous = LocalScheduler(run.jobs, death_timeout=120)  # a worker the last incarnation left running
    [worker] = previous.submit(Partition(name="pool", role="rollout"), "tcp://127.0.0.1:9", 1)
    pid = int(worker.job_id.removeprefix("local-"))
    try:
        JobRecords(run).add([worker])
        run.dataflow_snapshot.write_bytes(GARBAGE)
        config = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml"
        res = CliRunner().invoke(main, ["run", str(config), "--run-dir", str(run.root), "--quiet"])
        assert res.exit_code == 2, res.output
        deadline = time.time() + 10
        while process_identity(pid) == worker.identity and time.time() < deadline:
            time.sleep(0.1)
        assert process_identity(pid) != worker.identity, "the previous incarnation's worker still runs"
    finally:
        previous.close()


def test_resuming_with_the_policies_reordered_exits_2_naming_both_orders(tmp_path):
    """The workflow gives policies their roles in the order they are listed: a resume with the
    solver and the verifier swapped would have the trained verifier answer and the solver judge,
    under the old names and metrics. Refused before anything starts; the run's order resumes."""
    import torch
    import yaml

    from storage.weights import WeightStore

    run = RunPaths(tmp_path / "run").make()
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "tiny" / "config.yaml").read_text())
    data["workload"]["workflow"] = "solver_verifier"
    data["policies"] = [dict(data["policies"][0], name=name) for name in ("solver", "verifier")]
    run.config.write_text(yaml.safe_dump(data))  # what the run's first start saved
    for name in ("solver", "verifier"):
        WeightStore(run.weights).publish(name, 2, {"w": torch.ones(2)})
    swapped = tmp_path / "swapped.yaml"
    swapped.write_text(yaml.safe_dump(dict(data, policies=data["policies"][::-1])))
    res = CliRunner().invoke(main, ["run", str(swapped), "--run-dir", str(run.root), "--quiet"])
    assert res.exit_code == 2, res.output
    assert "trained them in the order ['solver', 'verifier']" in res.output, res.output
    assert "the config lists ['verifier', 'solver']" in res.output and "Traceback" not in res.output
    assert not run.scheduler_file.exists()  # nothing started

    from astraflow.config import load_config
    from astraflow.runtime.resume_checks import _check_same_policies

    same = tmp_path / "same.yaml"
    same.write_text(yaml.safe_dump(data))
    _check_same_policies(load_config(same), run)  # the run's own order resumes
