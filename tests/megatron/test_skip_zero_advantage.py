"""The Megatron backend leaves rows whose advantage is 0 out of what it sends its ranks and
normalises the loss by the whole batch's tokens: the step is the one on the whole batch."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from astraflow.batches import Batch, BatchItem  # noqa: E402
from astraflow.contracts import Sequence  # noqa: E402
from astraflow.training.megatron.backend import (  # noqa: E402
    MegatronBackend, MegatronBackendConfig, collate, drop_zero_advantage,
)
from tests.megatron.helpers import loss_fn_name, prompts, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.megatron


def _batch(tokens: np.ndarray, behaviour_lp: np.ndarray, prompt_len: int = 4, rewards=None) -> Batch:
    """Two GRPO groups: rows 0-2 scored alike (advantage 0), rows 3-5 did not; the alike
    group's sequences are the longest, so leaving them out also trims the padding."""
    rewards = rewards or [1.0, 1.0, 1.0, 1.0, 0.0, 0.25]
    lengths = [12, 12, 11, 8, 9, 7]
    items = []
    for i, (toks, r, n) in enumerate(zip(tokens, rewards, lengths)):
        toks = toks[:n]
        gen = np.arange(n) >= prompt_len
        lp = np.zeros(n, np.float32)
        lp[1:] = behaviour_lp[i, : n - 1]
        lp[~gen] = 0.0
        group = rewards[:3] if i < 3 else rewards[3:]
        seq = Sequence.build(toks, gen, lp, np.where(gen, 0, -1), np.where(gen, 0, -1), r)
        items.append(BatchItem(sequence=seq, loss_mask=gen, group_mean=float(np.mean(group)),
                               group_std=float(np.std(group)), group_size=3, staleness=0, task_id=f"g{i // 3}/{i}"))
    return Batch(policy="p", version=0, items=tuple(items))


def test_rows_without_advantage_are_dropped_and_padding_trimmed():
    toks = prompts(batch=6, length=12)
    arrays = collate(_batch(toks, np.zeros((6, 11), np.float32)))
    out = drop_zero_advantage(arrays)
    assert list(out["advantages"]) == list(arrays["advantages"][3:]) and np.all(out["advantages"] != 0)
    assert out["tokens"].shape == (3, 9) and out["mask"].shape == (3, 8)  # the longest kept row: 9 tokens
    assert out["num_tokens"] == arrays["mask"].sum() and out["num_sequences"] == 6
    nothing = dict(arrays, advantages=np.zeros(6, np.float32))
    assert drop_zero_advantage(nothing) is nothing  # no signal at all: the step still runs on everything


@pytest.mark.timeout(240)
def test_skipping_is_the_same_step(tmp_path):
    hf_dir = save_tiny_llama(tmp_path / "hf", tied=False)
    toks = prompts(batch=6, length=12)
    after = {}
    for skip in (False, True):
        with MegatronBackend(MegatronBackendConfig(
            hf_checkpoint=str(hf_dir), tp_size=1, lr=1e-3, loss_fn=loss_fn_name(), skip_zero_advantage=skip,
            start_timeout_s=120, step_timeout_s=120,
        )) as be:
            batch = _batch(toks, be.logprobs(toks))
            m = be.train_step(batch)
            assert m["num_sequences"] == 6 and m["trained_sequences"] == (3 if skip else 6)
            after[skip] = (be.logprobs(toks), m["loss"])
            alike = be.train_step(_batch(toks, be.logprobs(toks), rewards=[1.0] * 6))  # no signal: a zero step
            assert alike["trained_sequences"] == (0 if skip else 6)  # as the torch backend counts it
    np.testing.assert_allclose(after[True][0], after[False][0], atol=1e-6)
    assert after[True][1] == pytest.approx(after[False][1], abs=1e-7)


@pytest.mark.timeout(240)
def test_a_users_loss_trains_every_row_and_is_told_the_batchs_tokens(tmp_path):
    """A loss named in the config (``trainer.loss_fn``) with ``num_tokens`` required: every row
    is sent (no zero-advantage skip, a KL term has a gradient there) and the loss gets the whole
    batch's loss tokens, on one replica as on several."""
    hf_dir = save_tiny_llama(tmp_path / "hf", tied=False)
    toks = prompts(batch=6, length=12)
    with MegatronBackend(MegatronBackendConfig(
        hf_checkpoint=str(hf_dir), tp_size=1, lr=1e-3, loss_fn="tests.megatron.helpers:keyword_num_tokens_loss",
        start_timeout_s=120, step_timeout_s=120, advantage="dr_grpo",
    )) as be:
        batch = _batch(toks, be.logprobs(toks))
        m = be.train_step(batch)
    assert m["trained_sequences"] == 6 and m["user_loss_num_tokens"] == float(collate(batch)["mask"].sum())
