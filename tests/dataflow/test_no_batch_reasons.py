"""What a trainer's timeout says when no batch came: the reason that holds it back."""

from __future__ import annotations

import pytest

from astraflow.dataflow.layer import BatchTimeout
from tests.dataflow.test_data_layer import make_layer, run


def test_a_batch_no_node_ever_leased_for_says_no_node_leased(tmp_path):
    """A run whose rollout partitions have no node (or whose nodes never started): the timeout
    says so, not that the first evaluation round is pending."""
    layer = make_layer(tmp_path, eval_every=5)

    async def go():
        with pytest.raises(BatchTimeout) as err:
            await layer.next_batch("p", 0, timeout=0.2)
        return str(err.value)

    msg = run(go())
    assert "no RaaS node has leased a task yet" in msg and "evaluation round" not in msg, msg
