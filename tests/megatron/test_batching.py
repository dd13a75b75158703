"""The data-parallel split of the Megatron backend (``training/megatron/batching.py``): shares
balanced by token count, every share normalised by the whole batch, replica metrics folded
back into one step's. Pure numpy, no Megatron, no process."""

from __future__ import annotations

import numpy as np
import pytest

from astraflow.training.megatron.batching import (
    balance_by_tokens, combine_metrics, drop_zero_advantage, split_for_data_parallel,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("lengths, parts, want", [
    # longest first, each to the lightest part so far
    ([5, 3, 8, 1], 2, [[2, 3], [0, 1]]),                 # 8+1 | 5+3 (tie at 8: the part with fewer rows)
    ([4, 4, 4, 4], 2, [[0, 2], [1, 3]]),                 # equal lengths: alternate, by row count
    ([10, 1, 1, 1, 1, 1, 1], 2, [[0], [1, 2, 3, 4, 5, 6]]),  # one long row against many short ones
    ([7, 7, 6, 5, 4], 3, [[0, 4], [1], [2, 3]]),         # 11 | 7 | 11
    ([3, 2], 2, [[0], [1]]),                             # as many rows as parts: one each
    ([3], 2, [[0], []]),                                 # fewer rows than parts: a part without rows
    ([], 2, [[], []]),
    ([6, 2, 9], 1, [[0, 1, 2]]),                         # one part: every row, in batch order
])
def test_balance_by_tokens(lengths, parts, want):
    assert balance_by_tokens(lengths, parts) == want


def test_balance_bounds_and_determinism():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 500, rng.integers(1, 40)).tolist()
        parts = int(rng.integers(1, 6))
        shares = balance_by_tokens(lengths, parts)
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        totals = [sum(lengths[i] for i in s) for s in shares]
        assert max(totals) - min(totals) <= max(lengths)  # the greedy's bound
        if len(lengths) >= parts:
            assert all(shares)
        assert shares == balance_by_tokens(lengths, parts)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        balance_by_tokens([1], 0)


def _arrays(lengths, advantages):
    b, t = len(lengths), max(lengths)
    tokens = np.zeros((b, t), np.int64)
    mask = np.zeros((b, t - 1), np.float32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = np.arange(1, n + 1)
        mask[i, 1 : n - 1] = 1  # the first target is a prompt token
    return {"tokens": tokens, "mask": mask, "old_logprobs": -mask, "advantages": np.asarray(advantages, np.float32),
            "lengths": np.asarray(lengths, np.int64)}


def test_shares_are_trimmed_and_normalised_by_the_whole_batch():
    arrays = _arrays([9, 3, 6, 4], [1.0, -1.0, 0.5, -0.5])
    shares = split_for_data_parallel(arrays, 2)
    assert [s["lengths"].tolist() for s in shares] == [[9, 3], [6, 4]]  # 12 | 10 tokens
    assert [s["tokens"].shape for s in shares] == [(2, 9), (2, 6)] and shares[1]["mask"].shape == (2, 5)
    assert all(s["num_tokens"] == arrays["mask"].sum() == 14 and s["num_sequences"] == 4 for s in shares)
    assert sum(s["mask"].sum() for s in shares) == 14  # no loss token lost to the trimming
    np.testing.assert_array_equal(shares[1]["advantages"], [0.5, -0.5])


def test_after_dropping_zero_advantages_the_whole_batch_still_normalises():
    arrays = _arrays([9, 3, 6, 4], [0.0, 0.0, 0.0, 2.0])
    dropped = drop_zero_advantage(arrays)
    assert dropped["lengths"].tolist() == [4] and dropped["num_tokens"] == 14
    shares = split_for_data_parallel(dropped, 2)
    assert [len(s["advantages"]) for s in shares] == [1, 0]  # a replica without rows
    assert shares[1]["tokens"].shape == (0, 2) and shares[1]["mask"].shape == (0, 1)
    assert all(s["num_tokens"] == 14 and s["num_sequences"] == 4 for s in shares)


@pytest.mark.parametrize("shares, want", [
    ([{"loss": 0.5, "tokens": 30.0, "clip_frac": 0.1, "grad_norm": 2.0, "step_s": 1.0}],
     {"loss": 0.5, "tokens": 30.0, "clip_frac": 0.1, "grad_norm": 2.0, "step_s": 1.0}),
    ([{"loss": 0.5, "tokens": 30.0, "clip_frac": 0.1, "grad_norm": 2.0, "step_s": 1.0},
      {"loss": -0.2, "tokens": 10.0, "clip_frac": 0.5, "grad_norm": 2.0, "step_s": 3.0}],
     {"loss": 0.3, "tokens": 40.0, "clip_frac": 0.2, "grad_norm": 2.0, "step_s": 3.0}),
    # a replica without rows: no loss statistics, weight 0 in the others' means
    ([{"loss": 0.5, "tokens": 30.0, "clip_frac": 0.1, "entropy_proxy": 4.0, "grad_norm": 2.0, "step_s": 1.0},
      {"loss": 0.0, "tokens": 0.0, "entropy_proxy": 0.0, "grad_norm": 2.0, "step_s": 0.5}],
     {"loss": 0.5, "tokens": 30.0, "clip_frac": 0.1, "entropy_proxy": 4.0, "grad_norm": 2.0, "step_s": 1.0}),
])
def test_combine_metrics(shares, want):
    got = combine_metrics(shares)
    assert got == pytest.approx(want) and set(got) == set(want)
