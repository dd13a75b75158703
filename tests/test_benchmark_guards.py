"""The benchmarks' guards, without running a benchmark: a run that stopped early is refused
(``benchmarks/run_checks.py``), a missing GPU is an argument error, argument errors exit 2 before
anything starts, the elastic benchmark leaves a local Slurm someone else uses running, and a
benchmark that stops (a failure, Ctrl-C) removes the temporary directories it made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.run_checks import above, at_least, counts, cuda_problem, require_completed, stopped_early

ROOT = Path(__file__).resolve().parents[1]


def _result(status: str = "completed", reason: str | None = None, steps: int = 5):
    """What ``launch`` returns, as far as the guard reads it."""
    return SimpleNamespace(interrupted=status == "interrupted", ending=SimpleNamespace(status=status, reason=reason),
                           steps={"solver": steps})


def test_a_completed_run_passes():
    assert stopped_early({"status": "completed", "steps": {"solver": 5}}, 5, _result()) is None
    # launch started nothing (the directory held a completed run): the summary decides
    assert stopped_early({"status": "completed", "steps": {"solver": 5}}, 5, None) is None


@pytest.mark.parametrize("summary, result, said", [
    ({"status": "interrupted", "reason": "stopped by SIGINT"}, _result("interrupted", "stopped by SIGINT", 3),
     "interrupted: stopped by SIGINT"),
    ({"status": "failed", "reason": "trainer lost"}, None, "'failed': trainer lost"),
    (None, None, "no summary.json"),
    ({"status": "completed", "steps": {"solver": 5, "verifier": 2}}, None, "2 of 5 trainer steps"),
    ({"status": "completed"}, _result(steps=4), "4 of 5 trainer steps"),
])
def test_a_run_cut_short_is_named_with_why(summary, result, said):
    assert said in stopped_early(summary, 5, result)


def test_require_completed_exits_with_one_line_and_no_result(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps({"status": "interrupted", "reason": "stopped by SIGINT"}))
    with pytest.raises(SystemExit) as exc:
        require_completed(_result("interrupted", "stopped by SIGINT", 2), tmp_path, 5, "fast version")
    message = str(exc.value.code)
    assert message.startswith("fast version stopped early (interrupted: stopped by SIGINT)")
    assert "\n" not in message and "RESULT {" not in capsys.readouterr().out
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "steps": {"solver": 5}}))
    assert require_completed(_result(), tmp_path, 5, "x")["status"] == "completed"


def test_a_cuda_device_without_a_gpu_is_an_argument_error(monkeypatch):
    import torch

    assert cuda_problem("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said = cuda_problem("cuda:0")
    assert "--device cuda:0" in said and "--device cpu" in said
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_problem("cuda:0") is None and "1 CUDA device" in cuda_problem("cuda:1")
    assert "not a device" in cuda_problem("gpu0")


def test_number_types_refuse_what_cannot_be_measured():
    import argparse

    assert at_least(1)("3") == 3 and above(0)("0.5") == 0.5 and counts()("12, 512") == [12, 512]
    for parse, text, said in ((at_least(1), "0", "must be at least 1"), (at_least(1), "1.5", "not an integer"),
                              (above(0), "0", "must be above 0"), (counts(), "1,0", "must be at least 1")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            parse(text)


@pytest.mark.parametrize("script, args, said", [
    ("data_algorithms.py", ["--only", "dynamic_sampl"], "invalid choice: 'dynamic_sampl'"),
    ("worker_startup.py", ["--rounds", "0"], "at least 1"),
    ("local_fork.py", ["--steps", "0"], "at least 1"),
    ("engine_start.py", ["--replicas", "0"], "at least 1"),
    ("trainer_optimizer.py", ["--steps", "0"], "at least 1"),
    # a count or duration of zero divided by zero after a run, or failed in a child with a traceback
    ("admission.py", ["--repeats", "0"], "argument --repeats: must be at least 1"),
    ("tls_cost.py", ["--steps", "1"], "argument --steps: must be at least 2"),
    ("batch_rows.py", ["--tokens", "12,abc"], "'abc' is not an integer"),
    ("dask_overhead.py", ["--seconds", "0"], "argument --seconds: must be above 0"),
    ("durable_scale.py", ["--outstanding", "abc"], "comma-separated integers"),
    ("export_memory.py", ["--hidden", "100"], "multiple of 128"),
    ("weight_store.py", ["--repeat", "0"], "argument --repeat: must be at least 1"),
    ("storage_throughput.py", ["--reps", "0"], "argument --reps: must be at least 1"),
    ("system_vs_reference.py", ["--pairs", "0"], "--pairs 0 needs at least one --system-run"),
])
def test_argument_errors_exit_2_before_anything_starts(script, args, said):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and said in res.stderr and "Traceback" not in res.stderr


def test_elastic_stops_its_local_slurm_only_when_no_one_else_uses_it(monkeypatch, capsys):
    from benchmarks import elastic

    stopped = []
    monkeypatch.setattr(elastic.subprocess, "run", lambda cmd, **kw: stopped.append(cmd))
    listing = {"jobs": [{"job_id": 7, "comment": "astraflow.run.1234abcd"}]}
    monkeypatch.setattr(elastic, "run_slurm", lambda cmd, timeout: json.dumps(listing))
    elastic.stop_local_slurm("astraflow.run.1234abcd")  # its own jobs only: stopped
    assert len(stopped) == 1 and stopped[0][-1] == "stop"
    listing["jobs"].append({"job_id": 8, "comment": "someone else"})
    elastic.stop_local_slurm("astraflow.run.1234abcd")
    assert len(stopped) == 1 and "left the local Slurm running" in capsys.readouterr().err

    def no_answer(cmd, timeout):
        raise elastic.SlurmCommandError(cmd, 1, "", "down")

    monkeypatch.setattr(elastic, "run_slurm", no_answer)
    elastic.stop_local_slurm("astraflow.run.1234abcd")
    assert len(stopped) == 1 and "did not answer" in capsys.readouterr().err


def test_a_temporary_work_directory_goes_and_a_given_one_stays(tmp_path, monkeypatch):
    from benchmarks.main_example_runs import work_directory

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(RuntimeError), work_directory(None, "bench-") as work:
        (work / "run").mkdir()
        raise RuntimeError("a run failed")
    assert list(tmp_path.iterdir()) == []
    with work_directory(tmp_path / "kept", "bench-") as work:
        (work / "run").mkdir()
    assert (tmp_path / "kept" / "run").is_dir()


@pytest.mark.parametrize("module, argv", [("admission", ["--steps", "2"]), ("tls_cost", ["--steps", "2"]),
                                          ("durable_cost", ["--steps", "2"])])
def test_a_main_example_comparison_that_fails_leaves_no_run_directories(module, argv, tmp_path, monkeypatch):
    import importlib

    bench = importlib.import_module(f"benchmarks.{module}")

    def fail(*args, **kwargs):
        raise RuntimeError("the run failed")

    for name in ("run_one", "run_main_example"):
        if hasattr(bench, name):
            monkeypatch.setattr(bench, name, fail)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [module, *argv])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="the run failed"):
        bench.main()
    assert list(tmp_path.iterdir()) == []


def test_the_reference_run_removes_the_models_it_built(tmp_path, monkeypatch):
    from benchmarks import grpo_reference

    def fail(args, tmp):
        (tmp / "warm").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo_reference, "run", fail)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        grpo_reference.main([])
    assert list(tmp_path.iterdir()) == []


def test_elastic_throughput_is_taken_between_status_snapshots(monkeypatch):
    from benchmarks import elastic

    def snap(at, done):
        return {"written_at": at, "data_layer": {"nodes": {"n0": {"completed": done}}}}

    # the status is rewritten once a tick: a short window first sees the same snapshot again
    snaps = iter([snap(100.0, 10), snap(100.0, 10), snap(100.0, 10), snap(104.0, 50)])
    monkeypatch.setattr(elastic, "status", lambda run_dir: next(snaps))
    monkeypatch.setattr(elastic.time, "sleep", lambda s: None)
    assert elastic.rate(Path("run"), 1.0) == 10.0
    assert elastic.ratio(5.0, 0.0) is None and elastic.ratio(5.0, 2.0) == 2.5
