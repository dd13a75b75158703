"""The GRPO loss, shared by every trainer backend.

Group-relative policy optimisation: each sampled sequence's advantage is its reward normalised
within its group (``BatchItem.advantage``, from the group mean/std the data layer stamped at
ingest; ``trainer.advantage`` chooses another estimator, ``training.algorithms``, and
``trainer.loss_fn`` another loss), and the policy is pushed along it with a PPO-style clipped
importance ratio against the *behaviour* log-probs the inference engine recorded (so stale or
partially-rolled-out tokens are corrected per token). No KL term here (``trainer.kl_coef`` adds
one in the torch backend). The loss is token-level: a sum over every loss token of the batch
divided by the number of loss tokens in the whole batch (also when the batch is split into
micro-batches: pass ``num_tokens``).

Off-policy correction (``trainer.off_policy``) decides how a token's importance ratio
``r = exp(new - behaviour)`` enters the loss, i.e. how stale data is accepted:

* ``ppo_clip`` (default): the clipped PPO surrogate above.
* ``tis``: truncated importance sampling. The policy-gradient term ``A * log pi_new`` is
  weighted per token by ``min(r, is_cap)``, detached (a weight, not a path for gradients):
  stale tokens with a large ratio cannot blow up the step, and nothing is clipped to zero.
* ``m2po``: second-moment masking. The tokens with the largest ``(log r)^2`` are masked out
  until the mean ``(log r)^2`` of the kept tokens is at most ``m2_tau``; kept tokens use the
  *unclipped* ratio ``-r * A``. It bounds the drift of the batch as a whole while keeping
  most tokens (even quite stale ones) in the gradient. The mask is computed over the whole
  batch: a trainer that splits it into micro-batches computes every token's ratio first
  (``keep_mask``), so the micro-batch size does not change the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from astraflow.batches import Batch


OFF_POLICY = ("ppo_clip", "tis", "m2po")
"""Known ``off_policy`` corrections of ``grpo_loss`` (see the module docstring)."""


def m2_keep_mask(log_ratio: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """M2PO's token mask: drop the loss tokens with the largest ``(log r)^2`` (fewest needed)
    so that the mean ``(log r)^2`` of the kept loss tokens is ``<= tau``. Returns a bool mask
    of the kept tokens (a subset of ``mask``)."""
    sel = mask.bool()
    m2 = log_ratio.detach().float() ** 2
    vals = m2[sel]
    keep = torch.zeros_like(sel)
    if vals.numel() == 0:
        return keep
    order = torch.argsort(vals)  # ascending: the smallest are kept first
    prefix_mean = torch.cumsum(vals[order], 0) / torch.arange(1, vals.numel() + 1, dtype=vals.dtype,
                                                                device=vals.device)
    # prefix means of an ascending sequence never decrease: keep the longest prefix <= tau
    n_keep = int((prefix_mean <= tau).sum())
    kept = torch.zeros(vals.numel(), dtype=torch.bool, device=vals.device)
    kept[order[:n_keep]] = True
    keep[sel] = kept
    return keep


def grpo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    num_tokens: int | float | None = None,
    *,
    off_policy: str = "ppo_clip",
    is_cap: float = 2.0,
    m2_tau: float = 0.04,
    keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss with the chosen off-policy correction.

    ``new_logprobs``/``old_logprobs``/``mask``: ``[B, T]`` (the mask selects loss tokens);
    ``advantages``: ``[B]`` (one per sequence) or ``[B, T]``. With ``r = exp(new - old)``, per
    token: ``ppo_clip``: ``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``; ``tis``:
    ``-min(r, is_cap).detach() * A * new``; ``m2po``: ``-r * A`` on the tokens kept by
    ``m2_keep_mask(log r, mask, m2_tau)``, 0 elsewhere. Returns ``(loss, stats)``; the loss
    is the masked sum divided by ``num_tokens`` (default: the number of loss tokens in
    ``mask``; masked-out M2PO tokens still count, so masking shrinks the step). ``keep_mask``:
    M2PO's mask computed over the whole batch (``m2_keep_mask`` of every micro-batch's log
    ratios), this call's slice of it; None: computed over this call's tokens.
    """
    if off_policy not in OFF_POLICY:
        raise ValueError(f"unknown off_policy {off_policy!r}; known: {', '.join(OFF_POLICY)}")
    mask = mask.to(new_logprobs.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = adv.to(new_logprobs.dtype)
    log_ratio = new_logprobs - old_logprobs.to(new_logprobs.dtype)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss_mask = mask
    if off_policy == "ppo_clip":
        per_token = -torch.minimum(unclipped, clipped)
    elif off_policy == "tis":
        weight = torch.clamp(ratio, max=is_cap).detach()
        per_token = -weight * adv * new_logprobs
    else:  # m2po
        keep = m2_keep_mask(log_ratio, mask, m2_tau) if keep_mask is None else keep_mask.bool() & mask.bool()
        loss_mask = keep.to(mask.dtype)
        per_token = -unclipped
    denom = float(num_tokens) if num_tokens is not None else float(mask.sum().item())
    denom = max(denom, 1.0)
    loss = (per_token * loss_mask).sum() / denom
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        stats = {
            "ratio_mean": float((ratio * mask).sum() / n),
            # k3 estimator of KL(behaviour || current), a drift diagnostic only
            "approx_kl": float(((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum() / n),
        }
        if off_policy == "ppo_clip":  # the only correction that clips
            # the tokens the clip takes out of the gradient: min() chose the clipped term (a ratio
            # past the range on the side its advantage pushes towards, not the other side)
            stats["clip_frac"] = float(((clipped < unclipped).to(mask.dtype) * mask).sum() / n)
        if off_policy == "tis":
            stats["is_truncated_frac"] = float(((ratio > is_cap).to(mask.dtype) * mask).sum() / n)
        if off_policy == "m2po":
            stats["m2_masked_frac"] = float(((mask - loss_mask) * mask).sum() / n)
    return loss, stats


@dataclass
class Collated:
    """A batch as right-padded tensors. ``logprob`` entries are aligned to the token index:
    ``old_logprobs[b, t]`` is the behaviour log-prob of ``tokens[b, t]``."""

    tokens: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    old_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    rewards: torch.Tensor  # [B] float32


def collate(batch: Batch, pad_id: int, advantages: np.ndarray | None = None) -> Collated:
    """Right-pad the batch's sequences into tensors; ``advantages``: one per sequence (the
    estimator ``trainer.advantage`` chose, ``training.algorithms``), GRPO's when not given."""
    if not len(batch):
        raise ValueError("collate: the batch is empty")
    items = batch.items
    T = max(len(it.sequence.tokens) for it in items)
    B = len(items)
    tokens = np.full((B, T), pad_id, dtype=np.int64)
    attn = np.zeros((B, T), dtype=np.int64)
    lmask = np.zeros((B, T), dtype=bool)
    old = np.zeros((B, T), dtype=np.float32)
    for i, it in enumerate(items):
        n = len(it.sequence.tokens)
        tokens[i, :n] = it.sequence.tokens
        attn[i, :n] = 1
        lmask[i, :n] = it.loss_mask
        old[i, :n] = it.sequence.logprobs
    # the first token has no prediction: it can never carry a loss
    lmask[:, 0] = False
    return Collated(
        tokens=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(attn),
        loss_mask=torch.from_numpy(lmask),
        old_logprobs=torch.from_numpy(old),
        advantages=(torch.tensor([it.advantage for it in items], dtype=torch.float32) if advantages is None
                    else torch.as_tensor(np.asarray(advantages, np.float32))),
        rewards=torch.tensor([it.sequence.reward for it in items], dtype=torch.float32),
    )


def token_logprobs(model, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Log-prob of every token under ``model`` in one forward (fp32 log-softmax, temperature 1).

    ``tokens``/``attention_mask``: ``[B, T]``, left- or right-padded (positions are computed
    from the mask). Returns ``[B, T]`` aligned to the token index; column 0 and pad positions
    are 0. Gradients flow when called with grad enabled.
    """
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=tokens, attention_mask=attention_mask, position_ids=pos).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None])[..., 0]
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    return out * attention_mask.to(out.dtype)
