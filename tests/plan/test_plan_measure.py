"""What a plan reports is measured over the steady part of a run, dropped samples included, and
a refused ``--pool`` size only suggests sizes that ``--pool`` accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from astraflow.plan.pools import MAX_NODES, PlanError, parse_pool
from astraflow.plan.simulate import measure


def _write_run(run: Path, drops, steps: int = 20, per_step: int = 32, ahead=lambda step: 0) -> None:
    """A finished run's records: ``per_step`` sequences generated and consumed a step, and
    ``drops(step)`` the data layer's cumulative (stale, overflow, filtered) counts at each step;
    ``ahead(step)``: batches the trainer had taken for its next steps when the step was recorded."""
    run.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, steps + 1):
        stale, overflow, filtered = drops(step)
        rows.append({"policy": "solver", "loss": 0.0, "step": step, "time": 3.0 * step, "wait_s": 0.0,
                     "sequences_generated": per_step * step, "rollouts_generated": per_step * step,
                     "num_sequences": per_step,
                     "generated_tokens_per_s": 1000.0, "consumed": per_step * (step + ahead(step)),
                     "staleness_hist": {"0": per_step * step}, "stale_dropped": stale,
                     "overflow_dropped": overflow, "filtered": filtered})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "summary.json").write_text(json.dumps({"nodes": {}}))


def test_drops_in_the_warm_up_are_not_reported(tmp_path):
    # 50 stale drops at step 2, inside the 4 steps (20 % of 20) left out; none after
    _write_run(tmp_path, lambda step: (50 if step >= 2 else 0, 0, 0))
    r = measure(tmp_path, {"h100": 8}, 1.0)
    assert r.dropped == {"stale": 0, "overflow": 0, "filtered": 0}
    assert r.dropped_fraction == {"stale": 0.0, "overflow": 0.0, "filtered": 0.0}


def test_drops_are_counted_over_the_steady_window_and_as_a_share_of_what_it_generated(tmp_path):
    # one stale and two filtered sequences a step from the start, three overflow at step 2 only
    _write_run(tmp_path, lambda step: (step, 3 if step >= 2 else 0, 2 * step))
    r = measure(tmp_path, {"h100": 8}, 1.0)
    # 4 of 20 steps are left out: the window runs from step 5's record to step 20's, 15 steps of
    # 32 sequences generated
    assert r.dropped == {"stale": 15, "overflow": 0, "filtered": 30}
    assert r.dropped_fraction == pytest.approx({"stale": 15 / 480, "overflow": 0.0, "filtered": 30 / 480})
    # a run of the same load twice as long (8 steps left out, 31 in the window) reports the same share
    longer = tmp_path / "longer"
    _write_run(longer, lambda step: (step, 3 if step >= 2 else 0, 2 * step), steps=40)
    r2 = measure(longer, {"h100": 8}, 1.0)
    assert r2.dropped["stale"] == 31 and r2.dropped_fraction == pytest.approx(r.dropped_fraction)
    assert set(r.to_json()["dropped_fraction"]) == {"stale", "overflow", "filtered"}


def test_trained_per_s_is_the_steps_batches_whatever_the_next_batch_counted_already(tmp_path):
    """A trainer that does not wait has taken its next batch when a step is recorded, except at
    the end: the data layer's ``consumed`` is a batch ahead at one end of the window only."""
    _write_run(tmp_path, lambda step: (0, 0, 0), ahead=lambda step: 1 if step < 20 else 0)
    r = measure(tmp_path, {"h100": 8}, 1.0)
    assert r.trained_per_s == pytest.approx(r.steps_per_s * 32)


@pytest.mark.parametrize("gpus_per_node", [8, 4, 3])
def test_a_refused_pool_size_only_suggests_sizes_that_are_accepted(gpus_per_node):
    top = MAX_NODES * gpus_per_node
    for gpus in (top + 1, top - 1, top + gpus_per_node + 1, 2 * top + 1, gpus_per_node + 1):
        with pytest.raises(PlanError) as err:
            parse_pool(f"h100={gpus}", gpus_per_node, None)
        msg = str(err.value)
        suggested = [int(n) for n in re.findall(r"(?<!')h100=(\d+)", msg)]  # not the quoted spec
        assert suggested, msg
        for size in suggested:  # each one offered parses
            assert parse_pool(f"h100={size}", gpus_per_node, None).gpus == size
    # just past the largest pool: the largest pool is offered, and why not the next size up
    with pytest.raises(PlanError, match=rf"use h100={top} \(a pool is at most {MAX_NODES} nodes\)"):
        parse_pool(f"h100={top + 1}", gpus_per_node, None)


def _report(per_pool: dict[str, float]):
    from astraflow.plan.planner import PlanReport
    from astraflow.plan.pools import SimShape
    from astraflow.plan.simulate import SimResult

    result = SimResult(pools={k: 8 for k in per_pool}, steps=10, steps_per_s=1.0, trajectories_per_s=100.0,
                       tokens_per_s=1e4, trained_per_s=100.0, trainer_wait=0.5,
                       staleness={"p50": 0, "p90": 1, "max": 2}, dropped={"stale": 0, "overflow": 0, "filtered": 0},
                       per_pool={k: {"share": s, "trajectories_per_s": 100 * s, "tokens_per_s": 1e4 * s}
                                 for k, s in per_pool.items()})
    shape = SimShape(step_seconds=1.0, prompt_tokens=64, response_mean=100.0, response_sigma=0.5, time_scale=1.0,
                     steps=10)
    sources = {k: "assumed" for k in ("step_seconds", "prompt_tokens", "response_tokens", "time_scale")}
    return PlanReport(shape=shape, shape_sources=sources, result=result, search=None)


def test_a_pool_that_generated_nothing_is_named_with_the_reason():
    from rich.console import Console

    from astraflow.plan.report import print_report

    console = Console(record=True, width=200)
    print_report(_report({"a100": 0.0, "h100": 1.0}), console)
    text = console.export_text()
    assert "pool(s) a100 generated (almost) nothing" in text and "in flight" in text
    console = Console(record=True, width=200)
    print_report(_report({"a100": 0.4, "h100": 0.6}), console)
    assert "generated (almost) nothing" not in console.export_text()


def test_a_pool_far_slower_per_gpu_is_named_when_the_trainer_waits():
    from rich.console import Console

    from astraflow.plan.report import print_report

    console = Console(record=True, width=200)
    print_report(_report({"cpu": 0.1, "h100": 0.9}), console)  # 8 GPUs each: a ninth of the rate per GPU
    assert "pool(s) cpu deliver under 25% of the fastest pool's trajectories/s per GPU" in console.export_text()
    console = Console(record=True, width=200)
    print_report(_report({"a100": 0.4, "h100": 0.6}), console)
    assert "deliver under" not in console.export_text()
    console = Console(record=True, width=200)
    print_report(_report({"a100": 0.0, "h100": 1.0}), console)  # idle, said once, for the reason it has
    assert "generated (almost) nothing" in console.export_text() and "deliver under" not in console.export_text()
