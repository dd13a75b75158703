"""Long waits say what they wait for and for how long, also in a log (no terminal)."""

from __future__ import annotations

import io
import re
import time

import pytest
from rich.console import Console

from astraflow.runtime.monitoring.writer import Tick
from astraflow.runtime.progress import Progress, accuracy_changes


def _progress(heartbeat_s: float) -> tuple[Progress, io.StringIO]:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200, highlight=False)
    return Progress(console=console, heartbeat_s=heartbeat_s), buf


@pytest.mark.timeout(30)
def test_a_wait_in_a_log_names_what_it_waits_for_and_for_how_long():
    progress, buf = _progress(heartbeat_s=1.0)
    with progress.waiting("waiting for 2 workers to join"):
        progress.detail("1/2 joined; not yet rollout-x-1 (PENDING)")
        deadline = time.time() + 10
        while "still waiting" not in buf.getvalue():  # until the first heartbeat line
            assert time.time() < deadline, f"no heartbeat line within 10 s: {buf.getvalue()!r}"
            time.sleep(0.05)
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("waiting for 2 workers to join ...")
    still = [x for x in lines if "still waiting for 2 workers to join" in x]
    assert still and "(1/2 joined; not yet rollout-x-1 (PENDING))" in still[-1]
    assert re.search(r"\.\.\. [12]s", still[0]), still
    m = re.search(r"waiting for 2 workers to join: done in (\d+\.\d)s", lines[-1])
    assert m and 1.0 <= float(m.group(1)) < 10


def test_nested_waits_keep_their_own_detail_and_disabled_progress_is_silent():
    progress, buf = _progress(heartbeat_s=60)
    with progress.waiting("outer"):
        progress.detail("outer detail")
        with progress.waiting("inner"):
            progress.detail("inner detail")
            assert progress._waits == [["outer", "outer detail"], ["inner", "inner detail"]]
        assert progress._waits == [["outer", "outer detail"]]
    assert progress._waits == []
    assert [x.split(" ", 1)[1] for x in buf.getvalue().splitlines()][-1].startswith("outer: done in")
    quiet, qbuf = _progress(heartbeat_s=0.1)
    quiet.enabled = False
    with quiet.waiting("nothing to see"):
        quiet.detail("ignored")
        time.sleep(0.3)
    assert qbuf.getvalue() == ""


def _tick(evals: list[dict], hists: dict) -> Tick:
    state = {"eval": evals, "staleness_hist": hists, "nodes": {}, "episodes_per_s": 1.0,
             "generated_tokens_per_s": 10.0}
    trainers = {p: {"version": 3, "last_metrics": {}, "wait_fraction": 0.0} for p in hists}
    return Tick(data_layer=state, trainers=trainers)


def _eval(policy: str, step: int) -> dict:
    return {"policy": policy, "step": step, "eval_accuracy": 0.5, "eval_prompts": 4, "eval_seconds": 1.0}


def test_each_policys_evaluations_and_staleness_are_shown_and_a_resume_does_not_repeat_them():
    progress, buf = _progress(heartbeat_s=60)
    progress.interval_s = 0
    hists = {"solver": {"0": 5}, "verifier": {"1": 2}}
    # a resumed run: the last incarnation printed solver v4's evaluation
    progress.evals_shown([_eval("solver", 4)])
    progress.update(_tick([_eval("solver", 4), _eval("solver", 6), _eval("verifier", 2)], hists))
    out = buf.getvalue()
    assert "solver v4" not in out and "solver v6" in out
    assert "verifier v2" in out  # a policy whose versions trail the other's still has its evaluations shown
    assert "staleness solver {'0': 5} verifier {'1': 2}" in out


def test_an_evaluation_says_how_many_of_its_tasks_failed_and_were_left_out():
    progress, buf = _progress(heartbeat_s=60)
    progress.update(_tick([_eval("solver", 0), {**_eval("solver", 2), "eval_failed_tasks": 3}], {}))
    lines = buf.getvalue().splitlines()
    v0, v2 = (next(x for x in lines if f"solver v{v}:" in x) for v in (0, 2))
    assert "failed" not in v0 and "(4 prompts, 3 failed tasks left out, 1.0s)" in v2, lines


def test_a_trainer_without_a_step_yet_shows_no_nan_reward_or_loss():
    progress, buf = _progress(heartbeat_s=60)
    progress.interval_s = 0
    trainers = {"solver": {"version": 28, "last_metrics": {}}, "verifier": {"version": 3, "last_metrics":
                                                                            {"reward_mean": 0.5, "loss": 0.25}}}
    progress.update(Tick(data_layer={"nodes": {}, "episodes_per_s": 1.0, "generated_tokens_per_s": 9.0},
                         trainers=trainers))
    out = buf.getvalue()
    assert "solver step 28 (no new step yet) wait 0%" in out and "nan" not in out, out
    assert "verifier step 3 reward 0.500 loss 0.2500 wait 0%" in out, out


def test_the_progress_line_shows_each_nodes_version_of_every_policy():
    progress, buf = _progress(heartbeat_s=60.0)
    trainers = {p: {"version": v, "last_metrics": {}} for p, v in (("solver", 3), ("verifier", 1))}
    nodes = {"rollout-h100-0": {"versions": {"solver": 3, "verifier": 1}},
             "rollout-h100-1": {"versions": {"solver": 2}}}
    progress.update(Tick(data_layer={"nodes": nodes, "episodes_per_s": 1.0, "generated_tokens_per_s": 9.0},
                         trainers=trainers))
    out = buf.getvalue()
    # partition and index apart: ``h1001`` would read as a host, or as worker 01 of partition h10
    assert "h100-0:v3/1" in out and "h100-1:v2/?" in out, out


@pytest.mark.timeout(30)
def test_notes_and_waits_show_square_brackets_as_written():
    """An install hint (``.[vllm]``) or an error quoting a chat template (``[/INST]``) is text:
    rich would drop the first as a style tag and raise on the second's closing tag."""
    progress, buf = _progress(heartbeat_s=0.2)
    progress.note("install vLLM: pip install -e '.[vllm]'")
    progress.note("the reward failed on 'hello [/INST] world'")
    with progress.waiting("loading [bold] weights"):
        progress.detail("[/x] detail")
        deadline = time.time() + 10
        while "still loading" not in buf.getvalue():  # the first heartbeat line
            assert time.time() < deadline, buf.getvalue()
            time.sleep(0.05)
    out = buf.getvalue()
    assert "pip install -e '.[vllm]'" in out
    assert "'hello [/INST] world'" in out
    assert "still loading [bold] weights" in out and "([/x] detail)" in out
    assert "loading [bold] weights: done in" in out


def test_the_end_of_run_accuracy_line_is_per_policy_over_the_run_time_between_its_evaluations():
    # a resumed run: v0 evaluated 1 s into the first incarnation, v140 76 s into the run (the
    # incarnation that ended ran for a fraction of that); two policies are not compared with each other
    evals = [{**_eval("solver", 0), "eval_accuracy": 0.28, "time": 1.0},
             {**_eval("verifier", 0), "eval_accuracy": 0.10, "time": 1.5},
             {"policy": "solver", "step": 70, "eval_prompts": 0, "time": 40.0},  # no episode completed
             {**_eval("solver", 140), "eval_accuracy": 0.96, "time": 77.0},
             {**_eval("verifier", 100), "eval_accuracy": 0.30, "time": 60.0}]
    assert accuracy_changes(evals) == [
        "held-out accuracy (solver) 0.280 (v0) -> 0.960 (v140) in 76s",
        "held-out accuracy (verifier) 0.100 (v0) -> 0.300 (v100) in 58s"]
    assert accuracy_changes(evals[:1] + evals[3:4]) == ["held-out accuracy 0.280 (v0) -> 0.960 (v140) in 76s"]
    assert accuracy_changes([]) == []


def test_the_status_lines_throughput_is_over_the_interval_since_the_previous_line():
    """A run whose nodes stopped generating shows 0 ep/s at once, not the run's average decaying
    slowly; the first line (no interval yet) and a count that went back show the average."""
    progress, buf = _progress(heartbeat_s=60)
    progress.interval_s = 0
    t0 = time.time()

    def tick(read_at: float, episodes: int, tokens: int) -> Tick:
        t = _tick([], {"solver": {}})
        return Tick(data_layer={**t.data_layer, "episodes_per_s": 40.0, "generated_tokens_per_s": 4000.0,
                                "episodes_generated": episodes, "tokens_generated": tokens},
                    trainers=t.trainers, read_at=read_at)

    for read_at, episodes, tokens in ((t0, 400, 40000), (t0 + 5, 500, 50000), (t0 + 10, 500, 50000),
                                      (t0 + 15, 10, 100)):
        progress.update(tick(read_at, episodes, tokens))
    rates = re.findall(r"\| ([\d.]+) ep/s (\d+) tok/s", buf.getvalue())
    assert rates == [("40.0", "4000"), ("20.0", "2000"), ("0.0", "0"), ("40.0", "4000")], buf.getvalue()


def test_a_trainer_waiting_long_for_its_next_batch_is_said_to_wait_in_the_progress_line_and_status():
    from astraflow.runtime.monitoring import format_status

    progress, buf = _progress(heartbeat_s=60)
    progress.interval_s = 0
    t = _tick([], {"solver": {}})
    for waited in (3.0, 42.0):
        trainers = {"solver": {**t.trainers["solver"], "wait_fraction": 0.4, "batch_wait_s": waited}}
        progress.update(Tick(data_layer=t.data_layer, trainers=trainers))
        text = format_status({"data_layer": t.data_layer, "trainers": trainers})
        assert ("waiting for a batch for 42s" in text) == (waited == 42.0), text
    first, second = buf.getvalue().strip().splitlines()
    assert "waiting for a batch" not in first and "wait 40% waiting for a batch for 42s |" in second, second


def test_an_evaluation_run_on_newer_weights_than_its_version_says_which():
    """A round asked for at v4 may run on v6 (nodes never go back): its line names the weights."""
    progress, buf = _progress(heartbeat_s=60)
    progress.interval_s = 1e9
    evals = [{**_eval("solver", 2), "eval_version_min": 2, "eval_version_max": 2},
             {**_eval("solver", 4), "eval_version_min": 6, "eval_version_max": 6},
             {**_eval("solver", 6), "eval_version_min": 6, "eval_version_max": 7}]
    progress.update(_tick(evals, {"solver": {}}))
    out = buf.getvalue()
    assert "eval solver v2: held-out" in out, out
    assert "eval solver v4 (on v6 weights): held-out" in out and "eval solver v6 (on v6-v7 weights): held-out" in out


def test_a_second_evaluation_set_is_shown_on_its_evaluation_line_and_at_the_end_of_the_run():
    """HumanEval beside the code workload's split (``eval_sets``, the first and the last evaluation
    only) was in metrics.jsonl alone: the terminal never named it."""
    he = {"humaneval": {"accuracy": 0.0, "pass@1": 0.0, "prompts": 164}}
    evals = [{**_eval("coder", 0), "eval_accuracy": 0.558, "time": 1.0, "eval_sets": he},
             {**_eval("coder", 50), "eval_accuracy": 0.688, "time": 60.0},
             {**_eval("coder", 300), "eval_accuracy": 0.769, "time": 531.0,
              "eval_sets": {"humaneval": {**he["humaneval"], "accuracy": 0.012}}}]
    progress, buf = _progress(heartbeat_s=60)
    progress.update(_tick(evals, {}))
    lines = buf.getvalue().splitlines()
    v0, v50 = (next(x for x in lines if f"coder v{v}:" in x) for v in (0, 50))
    assert v0.endswith("(4 prompts, 1.0s); humaneval 0.000 (164 prompts)") and "humaneval" not in v50, lines
    assert accuracy_changes(evals) == ["held-out accuracy 0.558 (v0) -> 0.769 (v300) in 530s",
                                       "humaneval 0.000 (v0) -> 0.012 (v300), 164 prompts"]
