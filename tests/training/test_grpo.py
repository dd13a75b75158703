import math

import numpy as np
import torch

from astraflow.batches import Batch, BatchItem
from astraflow.contracts import Sequence
from astraflow.training.grpo import collate, grpo_loss, token_logprobs


def test_grpo_loss_hand_computed():
    # two sequences, three token slots; the last slot of sequence 1 is masked out
    new = torch.tensor([[math.log(0.5), math.log(0.9), 0.0], [math.log(0.3), math.log(0.2), 5.0]])
    old = torch.tensor([[math.log(0.25), math.log(0.9), 0.0], [math.log(0.6), math.log(0.2), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    loss, st = grpo_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # ratios: 2.0 (A=+1 -> clipped to 1.28), 1.0, 0.5 (A=-2: min(-1.0, -1.6) = -1.6), 1.0
    per_token = [-1.28, -1.0, 1.6, 2.0]
    assert abs(loss.item() - sum(per_token) / 4) < 1e-6
    assert abs(st["clip_frac"] - 0.5) < 1e-6
    assert abs(st["ratio_mean"] - (2.0 + 1.0 + 0.5 + 1.0) / 4) < 1e-6
    # k3 of KL(behaviour || current) over behaviour samples: r - 1 - log r per token
    k3 = [r - 1 - math.log(r) for r in (2.0, 1.0, 0.5, 1.0)]
    assert abs(st["approx_kl"] - sum(k3) / 4) < 1e-6
    # explicit denominator (micro-batching normalises by the whole batch's tokens)
    loss8, _ = grpo_loss(new, old, adv, mask, num_tokens=8)
    assert abs(loss8.item() - sum(per_token) / 8) < 1e-6


def test_clip_frac_counts_only_the_tokens_the_clip_takes_out_of_the_gradient():
    # ratio 2.0 with A=+1 and 0.5 with A=-1 are clipped (no gradient); 2.0 with A=-1 and 0.5 with
    # A=+1 are past the range on the other side: min() keeps the unclipped term, the gradient flows
    new = torch.tensor([[math.log(2.0), math.log(0.5)], [math.log(2.0), math.log(0.5)]])
    old = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    _, st = grpo_loss(new, old, torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert st["clip_frac"] == 0.5
    flowing = new.clone().requires_grad_(True)
    loss, _ = grpo_loss(flowing, old, torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert (flowing.grad != 0).tolist() == [[False, True], [True, False]]


def test_grpo_gradient_direction():
    new = torch.zeros(2, 2, requires_grad=True)
    loss, _ = grpo_loss(new, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool))
    loss.backward()
    # positive advantage: raise log-prob (negative gradient of the loss); negative: lower it
    assert (new.grad[0] < 0).all() and (new.grad[1] > 0).all()


def _seq(tokens, n_prompt, reward, logprobs=None):
    n = len(tokens)
    gen = np.arange(n) >= n_prompt
    lp = logprobs if logprobs is not None else np.where(gen, -1.0, 0.0)
    return Sequence.build(tokens, gen, lp, np.where(gen, 0, -1), np.where(gen, 0, -1), reward)


def test_collate_and_token_logprobs(tiny_model):
    from astraflow.models import load_model

    model, tok = load_model(tiny_model)
    seqs = [_seq([1, 2, 3, 4, 5], 2, 1.0), _seq([7, 8, 9], 1, 0.0)]
    items = tuple(
        BatchItem(sequence=s, loss_mask=s.loss_mask, group_mean=0.5, group_std=0.5, group_size=2,
                  staleness=0, task_id=str(i))
        for i, s in enumerate(seqs)
    )
    c = collate(Batch(policy="p", version=0, items=items), tok.pad_token_id)
    assert c.tokens.shape == (2, 5)
    assert c.loss_mask.tolist() == [[False, False, True, True, True], [False, True, True, False, False]]
    assert torch.allclose(c.advantages, torch.tensor([1.0, -1.0]), atol=1e-5)
    with torch.no_grad():
        lp = token_logprobs(model, c.tokens, c.attention_mask)
        # same as separate unpadded forwards
        for i, s in enumerate(seqs):
            t = torch.tensor([s.tokens.tolist()], dtype=torch.long)
            ref = model(t).logits.float().log_softmax(-1)[0, :-1].gather(-1, t[0, 1:, None])[:, 0]
            assert torch.allclose(lp[i, 1 : len(s.tokens)], ref, atol=1e-5)
        # left padding gives the same values
        left = torch.full((1, 5), tok.pad_token_id)
        left[0, 2:] = torch.tensor([7, 8, 9])
        att = torch.tensor([[0, 0, 1, 1, 1]])
        lpl = token_logprobs(model, left, att)
        assert torch.allclose(lpl[0, 3:], lp[1, 1:3], atol=1e-5)


def test_only_the_clipping_correction_reports_a_clip_fraction():
    """``tis`` and ``m2po`` clip nothing: a clip fraction there would read as clipping."""
    import torch

    from astraflow.training.grpo import grpo_loss

    new = torch.tensor([[0.0, 0.5, -0.5]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.tensor([1.0])
    assert "clip_frac" in grpo_loss(new, old, adv, mask, off_policy="ppo_clip")[1]
    for mode in ("tis", "m2po"):
        assert "clip_frac" not in grpo_loss(new, old, adv, mask, off_policy=mode)[1], mode
