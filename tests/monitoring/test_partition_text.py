"""The partitions in `astraflow status`'s text agree with `status --json`: a removed partition
wants no worker, a partition's bounds say when the run's autoscaler is off, what its nodes lease
at once is shown, and a finished run's text keeps its autoscaler's last decision."""

from __future__ import annotations

from astraflow.runtime.monitoring.text import format_partitions, format_summary

PART = {"scheduler": "local", "role": "rollout", "nodes": 2, "live": 0, "serving": 0, "completed": 7,
        "episodes_per_s": 0.0, "autoscale": {"min_nodes": 1, "max_nodes": 3, "cooldown_s": 5.0},
        "capacity": {"node_capacity": 16, "engine_max_batch": 8, "engines_per_node": 1}}


def _row(text: str, name: str) -> list[str]:
    return next(line for line in text.splitlines() if line.startswith(name)).split()


def test_a_removed_partition_wants_no_worker_as_the_json_says():
    text = format_partitions({"partitions": {"gone": {**PART, "state": "removed"}, "on": {**PART, "state": "active"}}})
    assert _row(text, "gone")[5] == "0" and _row(text, "on")[5] == "2", text


def test_bounds_say_when_the_autoscaler_is_off_and_what_a_node_leases_is_shown():
    off = format_partitions({"partitions": {"r": {**PART, "state": "active"}}, "autoscale": None})
    assert "autoscale 1..3 nodes, cooldown 5s (not acting: the run's autoscaler is off)" in off, off
    assert "16 episodes a node, engine batch 8" in off
    on = format_partitions({"partitions": {"r": {**PART, "state": "active"}}, "autoscale": {"config": {}}})
    assert "autoscale 1..3 nodes" in on and "not acting" not in on


def test_a_finished_runs_text_keeps_its_autoscalers_last_decision():
    summary = {"status": "completed", "steps": {"solver": 5}, "autoscale": {
        "config": {"low_wait": 0.05, "high_wait": 0.3, "window_s": 30},
        "last": {"action": "hold", "reason": "trainer wait over the last 30 s 12.0% within [5%, 30%]"},
        "changes": [{"t": 0.0, "reason": "trainer wait 50% > high_wait 30%: add 1 worker(s) of r (1 -> 2)"}]}}
    text = format_summary(summary, "s.json")
    assert "autoscale: band [5%, 30%]" in text and "now: hold: trainer wait" in text and "(1 -> 2)" in text, text


def test_a_finished_runs_text_says_what_each_rollout_partition_generated():
    parts = {"gpu": {**PART, "hardware": "h100", "staleness_mean": 0.5, "staleness_max": 2, "consumed": 6,
                     "versions": {"solver": [0, 4]}},
             "train": {"scheduler": "local", "role": "train", "nodes": 1}}
    text = format_summary({"status": "completed", "steps": {"solver": 5}}, "s.json", parts)
    lines = text.splitlines()
    at = lines.index("rollout partitions:")
    assert lines[at + 1] == "  gpu (h100): 7 episodes, staleness mean 0.50 max 2 (6 consumed), serving solver:v0-v4 at the end", text
    assert "train" not in text.split("rollout partitions:")[1].split("ledger")[0]
    assert "rollout partitions" not in format_summary({"status": "completed"}, "s.json")


def test_a_resumed_runs_partition_episodes_are_said_to_be_its_last_incarnations():
    """A resume starts the nodes' episode counts afresh while the consumed sequences are the whole
    run's: a resumed run's text says which is which rather than '238 episodes ... (4800 consumed)'."""
    parts = {"cpu": {**PART, "completed": 238, "staleness_mean": 1.0, "staleness_max": 2, "consumed": 4800,
                     "versions": {"solver": [300]}}}
    resumed = {"status": "completed", "seconds": 6.0, "data_layer": {"elapsed_s": 42.0}}
    line = format_summary(resumed, "s.json", parts).splitlines()[3]
    assert line == ("  cpu (local): 238 episodes in its last incarnation, staleness mean 1.00 max 2 "
                    "(4800 consumed over the run), serving solver:v300 at the end"), line
    single = {"status": "completed", "seconds": 20.0, "data_layer": {"elapsed_s": 11.0}}
    assert "incarnation" not in format_summary(single, "s.json", parts)
