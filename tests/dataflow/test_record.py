"""What the data layer writes on its own: metrics lines appended, the saved state written
atomically and restored (rules, prompt orders, random stream), including a state saved before."""

from __future__ import annotations

import json
import logging
import random

from astraflow.dataflow import record as rec
from astraflow.dataflow import rules as R
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.mixing import Mixer


def parts(seed=0, curator="greso"):
    cfg = DataflowConfig(curator={"type": curator})
    rules = {"curator": R.make(R.CURATORS, curator, {}, seed), "group_filter": R.make(R.FILTERS, "keep_all", {}),
             "ordering": R.make(R.ORDERINGS, "fifo", {})}
    mixer = Mixer("math", {"": 1.0}, [{}] * 5, ["p"], 4, random.Random(seed))
    return cfg, rules, mixer


def test_metrics_lines_are_appended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        log = rec.MetricsLog(str(path))
        log.write({"step": step, "x": 1.5})
        log.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    rec.MetricsLog(None).write({"step": 3})  # no path: nothing written, no error


def test_snapshot_saved_atomically_and_restored(tmp_path):
    cfg, rules, mixer = parts()
    rules["curator"].observe("p1", [1.0, 1.0])
    mixer.next_prompt()
    state = rec.snapshot(versions={"p": 3}, cfg=cfg, rules=rules, mixer=mixer, group_seq=7)
    assert state["policy_types"] == {"curator": "greso", "group_filter": "keep_all", "ordering": "fifo"}
    path = tmp_path / "dataflow_state.json"
    rec.save(path, state)
    assert [p.name for p in tmp_path.iterdir()] == ["dataflow_state.json"]  # no temp file left
    cfg2, rules2, mixer2 = parts(seed=9)
    versions = {"p": 0}
    assert rec.restore(rec.load(path), versions=versions, cfg=cfg2, rules=rules2, mixer=mixer2) == 7
    assert versions == {"p": 3} and rules2["curator"].streak == {"p1": 1}
    assert [mixer2.next_prompt() for _ in range(9)] == [mixer.next_prompt() for _ in range(9)]
    assert rec.load(tmp_path / "absent.json") is None


def test_a_changed_rule_type_starts_fresh(tmp_path, caplog):
    cfg, rules, mixer = parts()
    rules["curator"].observe("p1", [1.0, 1.0])
    state = json.loads(json.dumps(rec.snapshot(versions={"p": 1}, cfg=cfg, rules=rules, mixer=mixer, group_seq=0)))
    cfg2, rules2, mixer2 = parts(curator="filter_solved")
    with caplog.at_level(logging.WARNING, logger="astraflow.dataflow"):
        rec.restore(state, versions={"p": 0}, cfg=cfg2, rules=rules2, mixer=mixer2)
    assert rules2["curator"].success == {} and "dataflow.curator changed from 'greso'" in caplog.text


def test_generated_counts_training_and_evaluation_apart():
    from astraflow.contracts import SequenceSummary, TrajectoryRef

    # 5 tokens stored, 2 of them sampled by the policy (the rest: prompt)
    seq = SequenceSummary(ref=None, reward=1.0, policy_tokens={"p": (2, 0)}, num_tokens=5, finish_reason="stop")
    g = rec.Generated()
    g.add(TrajectoryRef("t", "g", "train", 0, "n", (seq, seq)))
    g.add(TrajectoryRef("e", "e", "eval", 0, "n", (seq,)))
    assert (g.episodes, g.sequences, g.train_sequences, g.tokens) == (2, 3, 2, 6)
    assert g.rates(1.5) == {"episodes_per_s": 2 / 1.5, "sequences_per_s": 2.0, "generated_tokens_per_s": 4.0}


def test_a_skipped_non_finite_step_writes_strict_json(tmp_path):
    import numpy as np
    import torch

    path = tmp_path / "metrics.jsonl"
    log = rec.MetricsLog(str(path))
    log.write({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "nonfinite_skipped": True,
               "reward_mean": np.float32("nan"), "tokens": np.int64(7), "kl": torch.tensor(float("-inf")),
               "hist": {"0": 2}, "series": [1.0, float("nan")]})
    log.close()

    def refuse(literal):
        raise AssertionError(f"{literal} written to metrics.jsonl")

    line = json.loads(path.read_text(), parse_constant=refuse)
    assert line == {"step": 3, "loss": None, "grad_norm": None, "nonfinite_skipped": True, "reward_mean": None,
                    "tokens": 7, "kl": None, "hist": {"0": 2}, "series": [1.0, None]}


def test_a_torn_last_metrics_line_is_cut_before_appending(tmp_path):
    from astraflow.dataflow.record import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # a crash mid-line
    log = MetricsLog(str(path))
    log.write({"step": 2})
    log.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
