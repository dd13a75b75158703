"""A group filter may see more of a group than its rewards: a ``keep(rewards, group)`` gets the
``GroupView`` (how each sequence ended, its lengths), so a filter such as DAPO's overlong one
(drop groups with sequences cut by their token budget) can be written outside AstraFlow; a
``keep(rewards)`` is called as before."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from astraflow.contracts import Sequence
from astraflow.dataflow.rules import GroupView, KeepAll, keep_group
from tests.dataflow.helpers import make_trajectory, store_and_ref
from tests.dataflow.test_data_layer import make_layer
from tests.dataflow.user_rules import SEEN_GROUPS as SEEN


def _ended_by(traj, reason: str):
    s = traj.sequences[0]
    seq = Sequence.build(s.tokens, s.loss_mask, s.logprobs, s.policy_ids, s.versions, s.reward, finish_reason=reason)
    return replace(traj, sequences=(seq,))


def test_a_filter_that_takes_the_group_view_drops_groups_with_a_truncated_sequence(tmp_path):
    layer = make_layer(tmp_path, group_size=4, batch_size=8,
                       group_filter={"type": "tests.dataflow.user_rules:DropTruncated"})
    SEEN.clear()

    async def go():
        writer = layer.store.writer("n0")
        tasks = await layer.lease("n0", 8)  # two groups of four
        trajs = [make_trajectory(t, float(i % 2)) for i, t in enumerate(tasks)]
        trajs[5] = _ended_by(trajs[5], "length")  # one of the second group's was cut
        await layer.complete(store_and_ref(writer, trajs))

    asyncio.run(go())
    assert [g.finish_reasons for g in SEEN] == [("stop",) * 4, ("stop", "length", "stop", "stop")]
    assert all(g.policy == "p" and g.num_tokens == (7,) * 4 and g.generated_tokens == (4,) * 4 for g in SEEN)
    ledger = layer.ledger.summary()
    assert ledger["dropped_by_reason"] == {"truncated": 4}
    assert ledger["events"]["kept"] == 1  # the first group, kept for a batch (what NothingCompletes reads)


def test_a_filter_whose_keep_takes_no_group_is_called_without_it():
    """``keep(rewards)``, and a ``keep`` whose second argument is another optional one (written
    before views existed), get the rewards only, checked by the data layer's wrapper or not."""
    from astraflow.dataflow.rules import FILTERS, checked

    class Spread(KeepAll):
        def keep(self, rewards, min_spread=0.0):
            return max(rewards) - min(rewards) > min_spread, "alike"

    view = GroupView("p", "", ("stop",), (3,), (1,))
    for rule in (KeepAll(KeepAll.Params(), 0), Spread(KeepAll.Params(), 0)):
        assert keep_group(rule, [1.0, 0.0], view) == (True, None if type(rule) is KeepAll else "alike")
        assert keep_group(checked(rule, FILTERS, "t"), [1.0, 1.0], view)[0] == (type(rule) is KeepAll)
