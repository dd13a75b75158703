"""The off-policy corrections of the GRPO loss (``trainer.off_policy``) against hand-computed
values and gradients, and their selection through the config and the trainer factory."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from astraflow.training.config import TrainerConfig
from astraflow.training.grpo import grpo_loss, m2_keep_mask


def _inputs(log_ratios, adv, old=-1.0):
    lr = torch.tensor([log_ratios], dtype=torch.float64)
    old_lp = torch.full_like(lr, old)
    new = (old_lp + lr).clone().requires_grad_(True)
    mask = torch.ones_like(lr, dtype=torch.bool)
    return new, old_lp, torch.tensor([adv], dtype=torch.float64), mask


def test_ppo_clip_is_the_default_and_matches_hand_values():
    new, old, adv, mask = _inputs([math.log(1.5), math.log(0.5)], 1.0)
    loss, st = grpo_loss(new, old, adv, mask, 0.2, 0.28)
    # token 1: min(1.5, 1.28) = 1.28 ; token 2: min(0.5, 0.8) = 0.5
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2)
    loss.backward()
    # the clipped token has no gradient, the other has d(-r)/d new = -r
    assert new.grad[0].tolist() == pytest.approx([0.0, -0.5 / 2])


def test_tis_weights_the_policy_gradient_by_the_truncated_ratio():
    lrs = [math.log(3.0), math.log(0.5), 0.0]
    new, old, adv, mask = _inputs(lrs, -2.0)
    loss, st = grpo_loss(new, old, adv, mask, off_policy="tis", is_cap=2.0)
    # per token -min(r, C) * A * new ; new = old + log r with old = -1
    expect = sum(-min(math.exp(x), 2.0) * -2.0 * (-1.0 + x) for x in lrs) / 3
    assert loss.item() == pytest.approx(expect)
    loss.backward()
    # gradient: -min(r, C) * A / N : the weight is detached, truncated at C
    assert new.grad[0].tolist() == pytest.approx([2.0 * 2.0 / 3, 0.5 * 2.0 / 3, 1.0 * 2.0 / 3])
    assert st["is_truncated_frac"] == pytest.approx(1 / 3)
    # below the cap the gradient equals the unclipped surrogate's (-r * A)
    n2, o2, a2, m2 = _inputs([math.log(0.7)], 1.0)
    grpo_loss(n2, o2, a2, m2, off_policy="tis", is_cap=2.0)[0].backward()
    n3, o3, a3, m3 = _inputs([math.log(0.7)], 1.0)
    (-(torch.exp(n3 - o3) * a3[:, None])).sum().backward()
    assert n2.grad.item() == pytest.approx(n3.grad.item())


def test_m2po_masks_largest_second_moments_until_the_mean_is_bounded():
    lrs = [0.1, -0.2, 0.5, 1.0]  # (log r)^2 = 0.01, 0.04, 0.25, 1.0
    new, old, adv, mask = _inputs(lrs, 1.0)
    keep = m2_keep_mask(new - old, mask, tau=0.11)
    # ascending prefix means 0.01, 0.025, 0.1, 0.325: keep the three smallest
    assert keep[0].tolist() == [True, True, True, False]
    loss, st = grpo_loss(new, old, adv, mask, off_policy="m2po", m2_tau=0.11)
    assert loss.item() == pytest.approx(-sum(math.exp(x) for x in lrs[:3]) / 4)
    loss.backward()
    # unclipped ratio on kept tokens (even r = e^0.5 > 1 + clip_high), none on the masked one
    assert new.grad[0].tolist() == pytest.approx([-math.exp(x) / 4 for x in lrs[:3]] + [0.0])
    assert st["m2_masked_frac"] == pytest.approx(0.25)
    # a tight bound keeps only what fits, a loose one keeps everything
    assert m2_keep_mask(new - old, mask, tau=0.03)[0].tolist() == [True, True, False, False]
    assert bool(m2_keep_mask(new - old, mask, tau=10.0).all())
    # tokens outside the loss mask are never kept and do not count in the mean
    outside = torch.tensor([[True, True, False, True]])
    assert m2_keep_mask(new - old, outside, tau=0.11)[0].tolist() == [True, True, False, False]


def test_unknown_off_policy_is_rejected():
    new, old, adv, mask = _inputs([0.0], 1.0)
    with pytest.raises(ValueError, match="known: ppo_clip, tis, m2po"):
        grpo_loss(new, old, adv, mask, off_policy="vtrace")


def test_config_selects_the_correction_and_the_backend_uses_it(tiny_model):
    from astraflow.batches import Batch, BatchItem
    from astraflow.contracts import NOT_GENERATED, Sequence
    from astraflow.training.trainer import make_backend

    with pytest.raises(ValueError, match="torch backend only"):
        TrainerConfig(backend="megatron", off_policy="tis")
    with pytest.raises(ValueError):
        TrainerConfig(off_policy="nope")
    rng = np.random.default_rng(0)
    items = []
    for i in range(4):
        n_prompt, n_gen = 3, 5
        seq = Sequence.build(
            tokens=rng.integers(3, 200, n_prompt + n_gen), loss_mask=[0] * n_prompt + [1] * n_gen,
            logprobs=[0.0] * n_prompt + list(rng.uniform(-8, -3, n_gen)),
            policy_ids=[NOT_GENERATED] * n_prompt + [0] * n_gen,
            versions=[NOT_GENERATED] * n_prompt + [0] * n_gen, reward=float(i % 2),
        )
        items.append(BatchItem(sequence=seq, loss_mask=seq.loss_mask, group_mean=0.5, group_std=0.5,
                               group_size=4, staleness=0, task_id=f"t{i}"))
    batch = Batch(policy="p", version=0, items=tuple(items), metrics={})
    for mode, key in (("tis", "is_truncated_frac"), ("m2po", "m2_masked_frac")):
        cfg = TrainerConfig(off_policy=mode, is_cap=1.5, m2_tau=0.5, micro_batch=2)
        backend = make_backend(cfg, str(tiny_model), seed=0)
        assert (backend.off_policy, backend.is_cap, backend.m2_tau) == (mode, 1.5, 0.5)
        out = backend.train_step(batch)
        assert key in out and math.isfinite(out["loss"]) and out["grad_norm"] > 0


def test_m2po_takes_the_same_step_whatever_the_micro_batch(tiny_model):
    """M2PO's mask is over the whole batch: splitting it into micro-batches (a hardware setting
    a partition may change) does not change which tokens are masked, nor the gradient."""
    from astraflow.batches import Batch, BatchItem
    from astraflow.contracts import NOT_GENERATED, Sequence
    from astraflow.training.torch_backend import TorchBackend

    rng = np.random.default_rng(1)
    items = []
    for i in range(8):
        n_prompt, n_gen = 3, 4 + i % 3
        seq = Sequence.build(
            tokens=rng.integers(3, 200, n_prompt + n_gen), loss_mask=[0] * n_prompt + [1] * n_gen,
            # stale behaviour log-probs, some rows far staler than others: the mask binds unevenly
            logprobs=[0.0] * n_prompt + list(rng.uniform(-9, -1 if i < 4 else -4, n_gen)),
            policy_ids=[NOT_GENERATED] * n_prompt + [0] * n_gen,
            versions=[NOT_GENERATED] * n_prompt + [0] * n_gen, reward=float(i % 2))
        items.append(BatchItem(sequence=seq, loss_mask=seq.loss_mask, group_mean=0.5, group_std=0.5,
                               group_size=8, staleness=0, task_id=f"t{i}"))
    batch = Batch(policy="p", version=0, items=tuple(items), metrics={})
    grads, masked = {}, {}
    for mb in (None, 1, 3):
        be = TorchBackend(str(tiny_model), lr=1e-3, micro_batch_size=mb, off_policy="m2po", m2_tau=4.0,
                          grad_clip=1e9)
        be.optimizer.step = lambda: None  # keep the gradient, not the step
        out = be.train_step(batch)
        masked[mb] = out["m2_masked_frac"]
        grads[mb] = torch.cat([p.grad.flatten() for p in be.model.parameters() if p.grad is not None])
    assert 0 < masked[None] < 1 and masked[1] == pytest.approx(masked[None]) == masked[3]
    for mb in (1, 3):
        assert float((grads[mb] - grads[None]).norm() / grads[None].norm()) < 1e-4
