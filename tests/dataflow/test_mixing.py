"""Source mixing on its own: prompt orders per source, rollout-ahead shares, batch quotas and
the saved state."""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest

from astraflow.dataflow.mixing import Mixer


def mixer(weights=None, n=(6, 3), seed=0) -> Mixer:
    weights = weights or {"a": 2.0, "b": 1.0}
    train = [{"q": i, "source": s} for s, k in zip(weights, n) for i in range(k)]
    return Mixer("mix", weights, train, ["p"], 4, random.Random(seed))


def test_sources_are_checked():
    with pytest.raises(ValueError, match="names source 'c'"):
        Mixer("mix", {"a": 1.0}, [{"source": "c"}], ["p"], 4, random.Random(0))
    with pytest.raises(ValueError, match=r"sources \['b'\] have no training prompts"):
        Mixer("mix", {"a": 1.0, "b": 1.0}, [{"source": "a"}], ["p"], 4, random.Random(0))
    single = Mixer("math", {"": 1.0}, [{"source": "x"}], ["p"], 4, random.Random(0))
    assert not single.mixing and single.source_of({"source": "x"}) == ""


def test_each_source_runs_through_its_prompts_once_per_epoch():
    m = mixer()
    first = [m.next_prompt("a") for _ in range(6)]
    assert sorted(first) == [0, 1, 2, 3, 4, 5] and m.epoch == {"a": 1, "b": 0}
    assert sorted(m.next_prompt("b") for _ in range(3)) == [6, 7, 8]
    m.next_prompt("a")
    assert m.epoch["a"] == 2
    assert mixer().next_prompt("a") == first[0]  # seeded


def test_pick_source_follows_the_weights_up_to_each_bound():
    m = mixer()
    rolling: Counter = Counter()
    picks = []
    while (s := m.pick_source(6, rolling, {"a": 0, "b": 0})) is not None:
        rolling[s] += 1
        picks.append(s)
    assert Counter(picks) == {"a": 4, "b": 2}  # shares of 6, 2:1
    assert m.pick_source(6, rolling, {"a": 0, "b": 0}) is None
    m.short["p"] = {"b": 9}  # a waiting batch lacks more of b than its groups in rollout bring
    assert m.pick_source(6, rolling, {"a": 0, "b": 0}) == "b"
    one = mixer({"": 1.0}, n=(3,))
    assert one.pick_source(5, Counter({"": 2}), {"": 2}) == "" and one.pick_source(5, Counter({"": 3}), {"": 2}) is None


def test_quotas_carry_credit_and_one_source_takes_it_all():
    m = mixer()
    totals: Counter = Counter()
    for _ in range(3):
        quota, m.credit["p"] = m.quotas("p", 16)
        totals.update(quota)
    assert totals == {"a": 32, "b": 16} and sum(m.credit["p"].values()) == pytest.approx(0)
    one = mixer({"": 1.0}, n=(3,))
    assert one.quotas("p", 10) == ({"": 10}, {"": 0.0})


def test_state_roundtrip_and_changed_sources_start_fresh(caplog):
    m = mixer()
    m.next_prompt("a")
    m.credit["p"] = {"a": 0.25, "b": -0.25}
    r = mixer(seed=5)
    r.load_state_dict(m.state_dict())
    assert (r.order, r.epoch, r.credit) == (m.order, m.epoch, m.credit)
    legacy = mixer({"": 1.0}, n=(3,))
    legacy.load_state_dict({"order": [2, 1], "epoch": 4})  # saved before sources existed
    assert legacy.order == {"": [2, 1]} and legacy.epoch == {"": 4}
    other = mixer({"a": 1.0, "c": 1.0})
    with caplog.at_level(logging.WARNING, logger="astraflow.dataflow"):
        other.load_state_dict(m.state_dict())
    assert other.epoch == {"a": 0, "c": 0} and "start fresh" in caplog.text
