"""Multi-turn statistics in step records and evaluation rounds (per difficulty)."""

from __future__ import annotations

from astraflow.contracts import SequenceSummary, TrajectoryRef
from astraflow.dataflow.evals import EvalRounds, episode_summary
from astraflow.dataflow.record import Generated
from storage.trajectories import EntryRef


def ref(task_id: str, score: float, kind: str = "train", **stats) -> TrajectoryRef:
    summary = SequenceSummary(ref=EntryRef(segment="s", index=0), reward=score, policy_tokens={"p": (5, 0)},
                              num_tokens=20, finish_reason="stop")
    base = {"turns": 2.0, "tool_calls": 1.0, "invalid_calls": 0.0, "truncated": 0.0, "success": score,
            "engine_s": 1.0, "tool_s": 0.5, "env_s": 0.5}
    return TrajectoryRef(task_id=task_id, group_id=task_id.split("/")[0], kind=kind, attempt=0, node="n",
                         sequences=(summary,), score=score, stats={**base, **stats})


def test_episode_summary_means_and_rates():
    s = episode_summary([ref("a/0", 1).stats, ref("a/1", 0, invalid_calls=1.0, tool_calls=3.0, truncated=1.0).stats],
                        prefix="x_")
    assert s == {"x_turns": 2.0, "x_tool_calls": 2.0, "x_invalid_call_rate": 0.25, "x_truncated_frac": 0.5,
                 "x_env_time_fraction": 0.5}
    assert episode_summary([], prefix="x_") == {}


def test_step_windows_are_per_policy():
    g = Generated.for_policies(["p", "q"])
    g.add(ref("a/0", 1))
    g.add(ref("e/0", 1, kind="eval", turns=9.0))  # evaluation episodes are not training statistics
    assert g.take_episode_stats("p")[0] == 1 and g.take_episode_stats("p") == (0, {})
    g.add(ref("b/0", 0, turns=4.0))
    n, sums = g.take_episode_stats("p")
    assert n == 1 and sums["turns"] == 4.0
    n, sums = g.take_episode_stats("q")  # its first record sees every episode since the start
    assert n == 2 and sums["turns"] == 6.0


def test_a_stalled_policys_window_stays_the_same_size():
    """A policy whose trainer takes no step keeps sums, not one record per episode."""
    import pickle

    g = Generated.for_policies(["p", "q"])
    sizes = []
    for i in range(300):
        g.add(ref(f"a/{i}", i % 2, turns=float(i % 3)))
        g.take_episode_stats("p")
        sizes.append(len(pickle.dumps(g)))
    assert sizes[-1] < sizes[10] + 16  # counters grow by a byte or two, not by episodes
    n, sums = g.take_episode_stats("q")
    assert n == 300 and sums["turns"] == sum(float(i % 3) for i in range(300))


def test_a_window_saved_as_a_list_is_still_read():
    g = Generated.for_policies(["p"])
    g.episode_stats["p"] = [{"turns": 2.0}, {"turns": 4.0}]  # an earlier release's form
    g.add(ref("a/0", 1, turns=6.0))
    n, sums = g.take_episode_stats("p")
    assert n == 3 and sums["turns"] == 12.0 and sums["tool_calls"] == 1.0


def test_eval_round_reports_difficulty_and_episode_stats():
    written = []
    payloads = [{"q": 1, "difficulty": 1}, {"q": 2, "difficulty": 2}, {"q": 3, "difficulty": 2}]
    rounds = EvalRounds(payloads, [""] * 3, k=2, policies=["p"], workflow="agent", by_source=False, started=0.0,
                        write=written.append)
    tasks = rounds.start(0)
    scores = {"eval-v0-0": [1, 1], "eval-v0-1": [1, 0], "eval-v0-2": [0, 0]}
    for t in tasks:
        gid, j = t.group_id, int(t.task_id.split("/")[1])
        rounds.record(t, ref(t.task_id, scores[gid][j], kind="eval", invalid_calls=float(j)))
    (rec,) = written
    assert rec["eval_accuracy"] == (1 + 0.5 + 0) / 3 and rec["eval_pass@2"] == 2 / 3
    assert rec["eval_by_difficulty"] == {"1": {"accuracy": 1.0, "pass@2": 1.0, "prompts": 1},
                                         "2": {"accuracy": 0.25, "pass@2": 0.5, "prompts": 2}}
    assert rec["eval_turns"] == 2.0 and rec["eval_invalid_call_rate"] == 0.5


def plain_ref(task_id: str, score: float, kind: str = "train", **stats) -> TrajectoryRef:
    """A single-turn episode whose workload reports statistics of its own (``reward_and_stats``)."""
    summary = SequenceSummary(ref=EntryRef(segment="s", index=0), reward=score, policy_tokens={"p": (5, 0)},
                              num_tokens=20, finish_reason="stop")
    return TrajectoryRef(task_id=task_id, group_id=task_id.split("/")[0], kind=kind, attempt=0, node="n",
                         sequences=(summary,), score=score, stats=stats)


def test_a_workloads_own_statistics_are_means():
    s = episode_summary([{"code_timeout": 1.0, "code_pass": 0.0}, {"code_pass": 1.0}], prefix="episode_")
    assert s == {"episode_code_timeout": 0.5, "episode_code_pass": 0.5}


def test_second_eval_sets_run_first_and_last_and_are_reported_apart():
    written = []
    payloads = [{"q": 1}, {"q": 2}, {"q": 3, "eval_set": "humaneval"}]
    rounds = EvalRounds(payloads, [""] * 3, k=1, policies=["p"], workflow="single_turn", by_source=False,
                        started=0.0, write=written.append, final=4)
    for version, expect in ((0, 3), (2, 2), (4, 3)):
        tasks = rounds.start(version)
        assert len(tasks) == expect
        for t in tasks:
            extra = t.prompt.get("eval_set") is not None
            rounds.record(t, plain_ref(t.task_id, 0.0 if extra else 1.0, kind="eval",
                                       code_timeout=float(extra), code_pass=float(not extra)))
    first, middle, last = written
    assert first["eval_accuracy"] == 1.0 and first["eval_prompts"] == 2 and first["eval_code_timeout"] == 0.0
    assert first["eval_sets"] == {"humaneval": {"accuracy": 0.0, "pass@1": 0.0, "prompts": 1,
                                                "code_timeout": 1.0, "code_pass": 0.0}}
    assert "eval_sets" not in middle and last["eval_sets"]["humaneval"]["prompts"] == 1


def test_a_step_record_has_the_training_episodes_success_rate():
    """A multi-turn episode's reward is its return (shaping included: a per-call cost, per-turn
    rewards), so the step record says how many of the episodes succeeded as well."""
    from collections import Counter

    from astraflow.dataflow.config import DataflowConfig
    from astraflow.dataflow.record import step_record

    g = Generated.for_policies(["p"])
    for i, score in enumerate((1.0, 1.0, 0.0, 1.0)):
        g.add(ref(f"a/{i}", score))

    def record() -> dict:
        return step_record(policy="p", version=1, elapsed=1.0, metrics={}, batch_metrics={}, cfg=DataflowConfig(),
                           counts=Counter(), staleness_hist=Counter(), generated=g, trainer_wait_s=0.0,
                           node_versions={}, by_source=None)

    rec = record()
    assert rec["episode_success"] == 0.75 and rec["episode_turns"] == 2.0
    assert "episode_success" not in record()  # no episodes since: no rate
