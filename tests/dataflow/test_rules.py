"""Every shipped dataflow policy: its decision rule on hand-built inputs, and a state
save/restore through JSON that continues with the same decisions (random streams included)."""

from __future__ import annotations

import json
import math

import pytest

from astraflow.dataflow import rules as P


def roundtrip(policy, registry, name, **params):
    """state_dict -> JSON -> a fresh instance (different seed) -> load_state_dict."""
    fresh = P.make(registry, name, params, seed=12345)
    fresh.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    return fresh


def decisions(curator, keys, n=200):
    return [curator.accept(keys[i % len(keys)], {}) for i in range(n)]


# -- curators: decision rules ------------------------------------------------------------------


def test_accept_all_accepts_everything():
    c = P.make(P.CURATORS, "accept_all", {})
    c.observe("p0", [1.0, 1.0])
    assert all(c.accept(f"p{i}", {}) for i in range(20))


def test_filter_solved_threshold_decay_and_explore():
    c = P.make(P.CURATORS, "filter_solved", {"threshold": 0.7, "decay": 0.5, "explore": 0.0})
    c.observe("p", [1, 1, 1, 1])  # first observation: the rate itself
    assert c.success["p"] == 1.0 and not c.accept("p", {})
    c.observe("p", [0, 0, 0, 0])  # EMA: 0.5 * 1.0 + 0.5 * 0.0
    assert c.success["p"] == pytest.approx(0.5) and c.accept("p", {})
    c.observe("p", [1, 1, 1, 0])  # 0.5 * 0.5 + 0.5 * 0.75
    assert c.success["p"] == pytest.approx(0.625) and c.accept("p", {})
    c.observe("p", [1, 1, 1, 1])  # 0.8125 > 0.7
    assert c.success["p"] == pytest.approx(0.8125) and not c.accept("p", {})
    assert c.accept("never_seen", {})
    # exactly at the threshold is still accepted (skip only *above* it)
    c.success["edge"] = 0.7
    assert c.accept("edge", {})
    # explore: a solved prompt is retried with probability ``explore``
    ex = P.make(P.CURATORS, "filter_solved", {"threshold": 0.5, "explore": 0.25}, seed=3)
    ex.observe("s", [1, 1])
    frac = sum(decisions(ex, ["s"], 4000)) / 4000
    assert frac == pytest.approx(0.25, abs=0.03)
    with pytest.raises(ValueError, match="threshold"):
        P.make(P.CURATORS, "filter_solved", {"threshold": 1.5})


def test_greso_skip_probability_grows_with_streak_and_keeps_floor():
    c = P.make(P.CURATORS, "greso", {"floor": 0.2, "base": 0.5})
    assert c.skip_probability("p") == 0.0
    probs = []
    for _ in range(5):
        c.observe("p", [1.0, 1.0, 1.0])  # zero variance: streak + 1
        probs.append(c.skip_probability("p"))
    # rate 1: 1 - 0.5^k, capped at 1 - floor
    assert probs == pytest.approx([0.5, 0.75, 0.8, 0.8, 0.8])
    c.observe("p", [0.0, 1.0, 1.0])  # variance again: the streak resets
    assert c.streak["p"] == 0 and c.skip_probability("p") == 0.0
    # the floor holds empirically: a prompt with a long streak is still tried ~floor of the time
    for _ in range(20):
        c.observe("q", [0.0, 0.0])
    c.rate = 1.0
    c.target_skip = 1.0  # keep the rate at 1 for this check
    frac = sum(decisions(c, ["q"], 4000)) / 4000
    assert frac == pytest.approx(0.2, abs=0.03)
    with pytest.raises(ValueError, match="floor"):
        P.make(P.CURATORS, "greso", {"floor": 0.0})


def test_greso_rate_adapts_to_the_target_skip_fraction():
    c = P.make(P.CURATORS, "greso", {"floor": 0.05, "base": 0.1, "target_skip": 0.3})
    for _ in range(10):
        c.observe("z", [1.0, 1.0])
    # every proposal is a zero-variance prompt: skips far above target -> the rate shrinks
    decisions(c, ["z"], 300)
    assert c.rate < 0.2
    low = c.rate
    assert c.skip_probability("z") == pytest.approx(min(0.95, low * (1 - 0.1**10)))
    # now only fresh prompts: skip fraction falls below target -> the rate grows back (<= 1)
    decisions(c, [f"fresh{i}" for i in range(50)], 2000)
    assert c.rate > low and c.rate <= 1.0
    assert 0.05 <= c.rate


def test_curriculum_weights_by_difficulty_from_outcomes():
    c = P.make(P.CURATORS, "curriculum", {"target": 0.5, "width": 0.35, "floor": 0.1})
    assert c.weight("unseen") == 1.0
    c.observe("mid", [1, 0, 1, 0])
    c.observe("solved", [1, 1, 1, 1])
    c.observe("hard", [0, 0, 0, 0])
    assert c.weight("mid") == pytest.approx(1.0)
    assert c.weight("solved") == pytest.approx(max(0.1, math.exp(-((0.5 / 0.35) ** 2))))
    assert c.weight("hard") == c.weight("solved") and c.weight("hard") < c.weight("mid")
    # the success rate is a 0.5 moving average of outcomes
    c.observe("solved", [0, 0, 1, 1])
    assert c.rate["solved"] == pytest.approx(0.75)
    # a very easy prompt never drops below the floor
    far = P.make(P.CURATORS, "curriculum", {"target": 0.0, "width": 0.1, "floor": 0.2})
    far.observe("x", [1, 1])
    assert far.weight("x") == pytest.approx(0.2)
    # acceptance frequency follows the weight
    c2 = P.make(P.CURATORS, "curriculum", {}, seed=1)
    c2.observe("s", [1, 1, 1, 1])
    frac = sum(decisions(c2, ["s"], 4000)) / 4000
    assert frac == pytest.approx(c2.weight("s"), abs=0.03)


# -- filters and orderings ---------------------------------------------------------------------


def test_group_filters():
    keep_all = P.make(P.FILTERS, "keep_all", {})
    assert keep_all.keep([1.0, 1.0]) == (True, None)
    dza = P.make(P.FILTERS, "drop_zero_advantage", {})
    assert dza.keep([1.0, 1.0, 1.0]) == (False, "zero_advantage")
    assert dza.keep([0.0, 0.0]) == (False, "zero_advantage")
    assert dza.keep([0.0, 1.0, 1.0]) == (True, None)
    assert dza.keep([0.5]) == (True, None)  # a single sequence has no group to compare to
    # restore is trivial but must round-trip
    assert roundtrip(dza, P.FILTERS, "drop_zero_advantage").keep([1.0, 1.0]) == (False, "zero_advantage")
    assert roundtrip(keep_all, P.FILTERS, "keep_all").keep([1.0, 1.0]) == (True, None)


def test_fifo_edf_and_freshest_orders():
    V = P.BufferedGroupView
    groups = [V(ingest_seq=3, oldest_version=5), V(ingest_seq=1, oldest_version=7),
              V(ingest_seq=2, oldest_version=4), V(ingest_seq=4, oldest_version=4)]
    fifo = P.make(P.ORDERINGS, "fifo", {})
    edf = P.make(P.ORDERINGS, "edf", {})
    assert fifo.order(groups, version=8, max_staleness=4) == [1, 2, 0, 3]
    # deadline = oldest_version + max_staleness: 4 (ingest 2), 4 (ingest 4), 5, 7
    assert edf.order(groups, version=8, max_staleness=4) == [2, 3, 0, 1]
    # freshest: newest oldest_version first, the later ready among equals: 7, 5, 4 (ingest 4), 4 (ingest 2)
    freshest = P.make(P.ORDERINGS, "freshest", {})
    assert freshest.order(groups, version=8, max_staleness=4) == [1, 0, 3, 2]
    for name, pol in (("fifo", fifo), ("edf", edf), ("freshest", freshest)):
        assert roundtrip(pol, P.ORDERINGS, name).order(groups, 8, 4) == pol.order(groups, 8, 4)


# -- save / restore of the stateful curators ---------------------------------------------------


@pytest.mark.parametrize(
    "name,params",
    [
        ("accept_all", {}),
        ("filter_solved", {"threshold": 0.6, "explore": 0.3}),
        ("greso", {"floor": 0.1, "base": 0.3, "target_skip": 0.4}),
        ("curriculum", {"target": 0.5, "width": 0.3}),
    ],
)
def test_curator_state_roundtrip_continues_the_same_decisions(name, params):
    keys = [f"p{i}" for i in range(8)]
    outcomes = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 1],
                [0, 0, 0, 0], [1, 1, 1, 1]]
    a = P.make(P.CURATORS, name, params, seed=7)
    for k, r in zip(keys, outcomes):
        a.observe(k, r)
        a.observe(k, r)
    decisions(a, keys, 50)  # advance the random stream
    restored = roundtrip(a, P.CURATORS, name, **params)
    assert json.dumps(restored.state_dict(), sort_keys=True) == json.dumps(a.state_dict(), sort_keys=True)
    # both continue identically: same decisions, and observations keep them in step
    for r in range(3):
        assert decisions(restored, keys, 100) == decisions(a, keys, 100)
        for k, o in zip(keys, outcomes[r:] + outcomes[:r]):
            a.observe(k, o)
            restored.observe(k, o)
    assert restored.state_dict() == a.state_dict()


def test_restore_without_rng_state_is_accepted_and_foreign_state_rejected():
    a = P.make(P.CURATORS, "filter_solved", {})
    a.observe("p", [1, 1])
    old_format = {k: v for k, v in a.state_dict().items() if k != "rng_state"}
    b = P.make(P.CURATORS, "filter_solved", {})
    b.load_state_dict(old_format)
    assert b.success == {"p": 1.0}
    with pytest.raises(ValueError, match="unknown keys"):
        b.load_state_dict(P.make(P.CURATORS, "greso", {}).state_dict())
