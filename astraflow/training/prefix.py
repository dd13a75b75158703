"""Token log-probs with each distinct prompt of a micro-batch forwarded once.

A GRPO group's samples share their prompt (an agentic group its first observation): the plain
forward (``grpo.token_logprobs``) runs that prefix once per sample. ``PrefixSharing`` runs each
distinct prefix once, repeats its key/value cache along the rows that have it, and runs the rest
of every row on top: the same log-probs (to float rounding) at every token after the prefix,
the same gradients (they flow back through the repeated cache into the one prefix forward), for
a fraction of the work when prompts are long next to what follows them.

A row's prefix is its tokens before its first loss token; log-probs are computed from there on
(0 before, where no built-in loss or the KL term reads them; a row without loss tokens gets 0
throughout). Left-padded prefixes and right-padded remainders keep every row's positions and
attention those of the plain forward.

It applies only where the model keeps transformers' plain per-layer key/value cache (no
state-space layers; sliding windows only when the rows fit in them) and where it saves work.
The first micro-batch with loss tokens it applies to is also computed the plain way (in fp32
where the model runs in it) and compared: a model whose cached forward disagrees or fails turns
it off for good, with a warning; micro-batches before it are forwarded whole.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from astraflow.training.grpo import token_logprobs

log = logging.getLogger("astraflow.training")

#: share only when the tokens forwarded drop below this fraction of the plain forward's
WORTH_IT = 0.8
#: the first-use check's tolerance for a model it cannot run in fp32 (bf16 rounds the two apart)
HALF_ATOL = 5e-2


@dataclass
class Layout:
    """How the rows of a right-padded micro-batch split into shared prefixes and remainders."""

    group: torch.Tensor  # [B] long: each row's prefix (an index into ``prefixes``)
    prefixes: torch.Tensor  # [G, P] left-padded prefix tokens
    prefix_mask: torch.Tensor  # [G, P]
    rest: torch.Tensor  # [B, C] right-padded tokens after each row's prefix
    rest_mask: torch.Tensor  # [B, C]
    start: torch.Tensor  # [B] long: where each row's remainder starts (its prefix length)

    def forwarded(self) -> int:
        return self.prefixes.numel() + self.rest.numel()


def layout(tokens: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> Layout:
    """Split a right-padded ``[B, T]`` micro-batch: a row's prefix is its tokens before its first
    loss token, rows with equal prefixes share one; a row without any loss token is its first
    token and no remainder (nothing of it is read)."""
    lengths = attention_mask.sum(-1).cpu()
    has_loss = loss_mask.any(-1).cpu()
    first = torch.where(has_loss, loss_mask.to(torch.int8).argmax(-1).cpu(), 1).clamp(min=1)
    ends = torch.where(has_loss, lengths, first)  # where each row's remainder ends
    host = tokens.cpu()
    slot: dict[bytes, int] = {}
    heads, group = [], []
    for i, p in enumerate(first.tolist()):
        key = host[i, :p].numpy().tobytes()
        if key not in slot:
            slot[key] = len(heads)
            heads.append(i)
        group.append(slot[key])
    B, dev = tokens.shape[0], tokens.device
    P = int(first.max()) if B else 0
    C = max(int((ends - first).max()), 1) if B else 1
    prefixes = torch.zeros((len(heads), P), dtype=tokens.dtype)  # padding: masked, any valid id
    prefix_mask = torch.zeros((len(heads), P), dtype=attention_mask.dtype)
    for g, i in enumerate(heads):
        p = int(first[i])
        prefixes[g, P - p:] = host[i, :p]
        prefix_mask[g, P - p:] = 1
    rest = torch.zeros((B, C), dtype=tokens.dtype)
    rest_mask = torch.zeros((B, C), dtype=attention_mask.dtype)
    for i in range(B):
        p, n = int(first[i]), int(ends[i])
        rest[i, :n - p] = host[i, p:n]
        rest_mask[i, :n - p] = 1
    return Layout(torch.tensor(group, device=dev), prefixes.to(dev), prefix_mask.to(dev), rest.to(dev),
                  rest_mask.to(dev), first.to(dev))


def plain_cache(cache, width: int) -> bool:
    """Whether ``cache`` is transformers' plain per-layer key/value cache, whose rows can be
    repeated (``batch_select_indices``) with nothing else to keep in step; a sliding-window layer
    only where rows of ``width`` tokens fit in its window (it never drops a key)."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # a transformers without per-layer caches
        return False
    layers = getattr(cache, "layers", None)
    return type(cache) is DynamicCache and bool(layers) and all(
        type(layer) is DynamicLayer
        or (type(layer) is DynamicSlidingWindowLayer and width < getattr(layer, "sliding_window", 0) - 1)
        for layer in layers)


def shared_logprobs(model, lay: Layout, width: int) -> torch.Tensor | None:
    """``[B, width]`` log-probs of every token after each row's prefix (0 elsewhere) from one
    forward of the distinct prefixes and one of the remainders on their repeated cache; ``None``
    when the model's cache cannot be repeated by row."""
    # transformers names the cache argument (and output) ``cache`` from 5.20, ``past_key_values`` before
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=lay.prefixes, attention_mask=lay.prefix_mask,
                position_ids=(lay.prefix_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
    cache = getattr(out, kw, None)
    if not plain_cache(cache, lay.prefixes.shape[1] + lay.rest.shape[1]):
        return None
    cache.batch_select_indices(lay.group)
    mask = torch.cat([lay.prefix_mask[lay.group], lay.rest_mask], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, lay.prefixes.shape[1]:]
    logits = model(input_ids=lay.rest, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache}).logits
    # the prefix's last position predicts each row's first remainder token, the remainder the rest
    logits = torch.cat([out.logits[:, -1:][lay.group], logits[:, :-1]], dim=1)
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, lay.rest[..., None])[..., 0]
    picked = picked * lay.rest_mask.to(picked.dtype)
    B, C = lay.rest.shape
    cols = lay.start[:, None] + torch.arange(C, device=lay.rest.device)
    cols = torch.where(lay.rest_mask.bool(), cols, width)  # padding lands in a column that is dropped
    full = torch.zeros((B, width + 1), dtype=picked.dtype, device=picked.device)
    return full.scatter(1, cols, picked)[:, :width]


class PrefixSharing:
    """``logprobs(model, tokens, attention_mask, loss_mask)``: ``token_logprobs`` with shared
    prefixes where that saves work (module docstring); ``enabled`` False turns it off for good."""

    def __init__(self, enabled: bool = True, atol: float = 1e-3):
        self.enabled = enabled
        #: the check's tolerance on log-probs (both ways in fp32)
        self.atol = atol
        self._checked = False
        #: the tokens the forwards ran on so far (padding included)
        self.forwarded = 0

    def logprobs(self, model, tokens: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor) -> torch.Tensor:
        lay = layout(tokens, attention_mask, loss_mask) if self.enabled else None
        unchecked = not self._checked and not bool(loss_mask.any())  # nothing to check it on yet
        if lay is None or unchecked or lay.forwarded() >= WORTH_IT * tokens.numel():
            self.forwarded += tokens.numel()
            return token_logprobs(model, tokens, attention_mask)
        if not self._checked and not self._agrees(model, lay, tokens, attention_mask, loss_mask):
            return self.logprobs(model, tokens, attention_mask, loss_mask)
        new = shared_logprobs(model, lay, tokens.shape[1])
        if new is None:
            self._off("the model's key/value cache cannot be repeated by row")
            return self.logprobs(model, tokens, attention_mask, loss_mask)
        self.forwarded += lay.forwarded()
        return new

    def _agrees(self, model, lay: Layout, tokens, attention_mask, loss_mask) -> bool:
        """Both ways on one micro-batch with loss tokens, without gradients: whether their
        log-probs of the loss tokens agree (else sharing is turned off). In fp32, so that the
        forwards' structure is compared, not bf16's rounding; a model whose attention runs only
        in half precision (flash attention) is compared as the step runs it, within ``HALF_ATOL``."""
        self._checked = True
        self.forwarded += lay.forwarded() + tokens.numel()
        try:
            with torch.no_grad():
                try:
                    with torch.autocast(tokens.device.type, enabled=False):
                        shared, plain, atol = *self._both(model, lay, tokens, attention_mask), self.atol
                except Exception:
                    shared, plain, atol = *self._both(model, lay, tokens, attention_mask), HALF_ATOL
        except Exception as err:  # a forward that takes no cache, or positions, this way
            self._off(f"its cached forward raised {type(err).__name__}: {err}")
            return False
        if shared is None:
            self._off("the model's key/value cache cannot be repeated by row")
            return False
        gap = float(((shared - plain).abs() * loss_mask.to(plain.dtype)).max())
        if not gap <= atol:
            self._off(f"its log-probs differ from the plain forward's by up to {gap:.3g}")
            return False
        return True

    @staticmethod
    def _both(model, lay: Layout, tokens, attention_mask):
        return shared_logprobs(model, lay, tokens.shape[1]), token_logprobs(model, tokens, attention_mask)

    def _off(self, why: str) -> None:
        self.enabled = False
        log.warning("trainer: each sequence is forwarded whole from now on, prompts not shared: %s", why)
