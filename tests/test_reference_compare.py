"""The per-minute comparison of a run directory with the single-process reference
(``benchmarks/grpo_reference.py --compare-run``)."""

import io
import json

import pytest
from rich.console import Console

from benchmarks.grpo_reference import compare_with_run


def _run_dir(tmp_path, evals):
    lines = [{"step": 0, "policy": "solver", "time": 100.0, "loss": 0.1}]  # a step line is ignored
    lines += [{"step": 25 * i, "policy": "solver", "time": 1000.0 + 60 * m, "eval_accuracy": a}
              for i, (m, a) in enumerate(evals)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return tmp_path


def test_curves_compared_on_their_common_span(tmp_path):
    run = _run_dir(tmp_path, [(0, 0.3), (1, 0.5), (2, 0.7)])  # system: linear 0.3 -> 0.7 in 2 min
    reference = [(0.0, 0.3), (1.5, 0.55), (3.0, 0.9)]  # +30 points only at its last evaluation
    out = compare_with_run(run, reference, Console(file=io.StringIO()))
    assert out["common_minutes"] == 2.0
    assert out["mean_acc_system"] == pytest.approx(0.5, abs=1e-3)  # mean of a line over 0..2
    # piecewise linear: 0.3 -> 0.55 over 1.5 min, then on to 0.55 + 0.5 * 0.35 / 1.5 at 2 min
    at2 = 0.55 + 0.5 * 0.35 / 1.5
    assert out["mean_acc_reference"] == pytest.approx((1.5 * (0.3 + 0.55) / 2 + 0.5 * (0.55 + at2) / 2) / 2, abs=2e-3)
    assert out["gain30_min_system"] == 2.0  # first evaluation 30 points up: 0.7 at 2 min
    assert out["gain30_min_reference"] == 3.0
    assert [w["to_min"] for w in out["windows"]] == [0.67, 1.33, 2.0]


def test_a_run_without_evaluations_is_refused(tmp_path):
    run = _run_dir(tmp_path, [(0, 0.3)])
    with pytest.raises(ValueError, match="eval.every"):
        compare_with_run(run, [(0.0, 0.3), (1.0, 0.4)], Console(file=io.StringIO()))


def test_every_system_run_is_compared_with_every_reference(tmp_path):
    from benchmarks.system_vs_reference import compare_pairs

    (tmp_path / "fast").mkdir()
    (tmp_path / "slow").mkdir()
    fast = _run_dir(tmp_path / "fast", [(0, 0.3), (1, 0.62), (2, 0.7)])
    slow = _run_dir(tmp_path / "slow", [(0, 0.3), (1, 0.4), (2, 0.5)])
    ref = {"curve": [{"seconds": 0, "acc": 0.3}, {"seconds": 60, "acc": 0.5}, {"seconds": 120, "acc": 0.6},
                     {"seconds": 180, "acc": 0.65}]}
    never = {"curve": [{"seconds": 0, "acc": 0.3}, {"seconds": 120, "acc": 0.4}]}
    out = compare_pairs([("fast", fast), ("slow", slow)], [("ref", ref), ("never", never)],
                        Console(file=io.StringIO()))
    assert out["pairs"] == 4
    by = {(p["system"], p["reference"]): p for p in out["pair_details"]}
    assert by["fast", "ref"]["gain30_min_system"] == 1.0 and by["fast", "ref"]["gain30_min_reference"] == 2.0
    assert by["fast", "ref"]["gain30_ahead"] and by["fast", "never"]["gain30_ahead"]  # the other never got there
    assert not by["slow", "ref"]["gain30_ahead"] and not by["slow", "never"]["gain30_ahead"]  # never got there
    assert out["gain30_ahead_fraction"] == 0.5
    assert by["slow", "ref"]["mean_acc_ratio"] < 1 < by["fast", "ref"]["mean_acc_ratio"]
    assert out["min_acc_ratio"] == min(p["mean_acc_ratio"] for p in out["pair_details"])
    assert out["mean_acc_ratio"] == pytest.approx(sum(p["mean_acc_ratio"] for p in out["pair_details"]) / 4, abs=1e-3)


def test_compare_pairs_needs_both_sides():
    from benchmarks.system_vs_reference import compare_pairs

    with pytest.raises(ValueError, match="at least one"):
        compare_pairs([], [("ref", {"curve": []})], Console(file=io.StringIO()))
