"""What the Megatron backend sends its ranks: a batch as arrays, and its data-parallel shares.

``collate`` turns a ``Batch`` into right-padded next-token arrays; ``drop_zero_advantage``
leaves out rows that cannot change the step; ``balance_by_tokens`` and ``split_for_data_parallel``
give every data-parallel replica its share of the rows; ``combine_metrics`` folds the replicas'
step metrics back into the metrics of one step on the whole batch. Pure numpy, no Megatron.

Loss normalisation across shares: every share carries ``num_tokens``, the loss-token count of
the *whole* batch, so each replica's loss is its part of the whole batch's token mean and the
gradients are summed (not averaged) over the data-parallel group: the step is the one a single
replica would take on the whole batch.
"""

from __future__ import annotations

import heapq
from typing import Any, Mapping, Sequence

import numpy as np

from astraflow.batches import Batch


def collate(batch: Batch, advantages: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A batch as right-padded arrays aligned to next-token prediction; ``advantages``: one per
    sequence (``trainer.advantage``'s estimator), GRPO's when not given.

    ``tokens`` ``[B, T]``; ``mask``/``old_logprobs`` ``[B, T-1]`` for targets ``tokens[:, 1:]``;
    ``advantages`` ``[B]``; ``lengths`` ``[B]`` (each row's real token count, what the
    data-parallel split balances). Padding has mask 0 and cannot affect real tokens (causal
    attention).
    """
    if not len(batch):
        raise ValueError("empty batch: the data layer must serve at least one sequence")
    t = max(len(it.sequence.tokens) for it in batch.items)
    if t < 2:
        raise ValueError("every batch needs a sequence of at least 2 tokens (a prompt and a target)")
    b = len(batch)
    tokens = np.zeros((b, t), np.int64)
    mask = np.zeros((b, t - 1), np.float32)
    old = np.zeros((b, t - 1), np.float32)
    adv = np.zeros((b,), np.float32)
    lengths = np.zeros((b,), np.int64)
    for i, it in enumerate(batch.items):
        n = len(it.sequence.tokens)
        tokens[i, :n] = it.sequence.tokens
        mask[i, : n - 1] = it.loss_mask[1:]
        old[i, : n - 1] = it.sequence.logprobs[1:]
        adv[i] = it.advantage if advantages is None else advantages[i]
        lengths[i] = n
    return {"tokens": tokens, "mask": mask, "old_logprobs": old, "advantages": adv, "lengths": lengths}


def drop_zero_advantage(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """``collate``'s arrays without the rows whose advantage is 0, trimmed to the longest kept
    row, plus ``num_tokens`` (the whole batch's loss tokens, the loss normaliser) and
    ``num_sequences``. Unchanged when every row or no row has an advantage (a batch without
    signal still steps the optimiser, on zero gradients)."""
    keep = arrays["advantages"] != 0
    if keep.all() or not keep.any():
        return arrays
    mask = arrays["mask"][keep]
    width = int(np.nonzero(mask.any(0))[0].max()) + 2 if mask.any() else 2  # last loss target + 1
    out = {"tokens": arrays["tokens"][keep, :width], "mask": mask[:, : width - 1],
           "old_logprobs": arrays["old_logprobs"][keep, : width - 1], "advantages": arrays["advantages"][keep],
           "num_tokens": float(arrays["mask"].sum()), "num_sequences": len(keep)}
    if "lengths" in arrays:
        out["lengths"] = np.minimum(arrays["lengths"][keep], width)
    return out


def takes_num_tokens(loss_fn: str) -> bool:
    """Whether the ``module:function`` loss accepts ``num_tokens`` (the batch-wide normaliser),
    by name or as one of its ``**kwargs``."""
    import inspect

    from astraflow.training.algorithms import loss_by_name

    fn = loss_by_name(loss_fn)
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "num_tokens" or p.kind is p.VAR_KEYWORD for p in params)


def balance_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices per part, the parts' token totals as even as a greedy split gets them.

    Longest-first greedy (LPT): rows in order of decreasing length (ties: lower index first),
    each to the part with the fewest tokens so far (ties: fewer rows, then lower part index).
    The heaviest part ends at most the longest row's length above the lightest, and a part gets
    no row only when there are fewer rows than parts. Each part lists its rows in batch order.
    Deterministic, so every caller computes the same split.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    heap = [(0, 0, p) for p in range(parts)]
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        total, rows, p = heapq.heappop(heap)
        shares[p].append(i)
        heapq.heappush(heap, (total + int(lengths[i]), rows + 1, p))
    return [sorted(s) for s in shares]


def split_for_data_parallel(arrays: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
    """One payload per data-parallel replica: its rows (``balance_by_tokens`` on ``lengths``),
    trimmed to its own longest row, with the whole batch's ``num_tokens`` and
    ``num_sequences``. A replica may get no rows (fewer rows with an advantage than
    replicas): it then contributes zero gradients to the step."""
    lengths = np.asarray(arrays["lengths"])
    num_tokens = float(arrays.get("num_tokens", np.asarray(arrays["mask"]).sum()))
    num_sequences = int(arrays.get("num_sequences", len(lengths)))
    out = []
    for rows in balance_by_tokens(lengths, parts):
        idx = np.asarray(rows, np.int64)
        width = min(max(int(lengths[idx].max()) if len(idx) else 2, 2), arrays["tokens"].shape[1])
        out.append({"tokens": arrays["tokens"][idx, :width], "mask": arrays["mask"][idx, : width - 1],
                    "old_logprobs": arrays["old_logprobs"][idx, : width - 1],
                    "advantages": arrays["advantages"][idx], "lengths": lengths[idx],
                    "num_tokens": num_tokens, "num_sequences": num_sequences})
    return out


#: step metrics that are not per-token means: how ``combine_metrics`` folds each
_SUMMED = ("loss", "tokens")
_SHARED = ("grad_norm",)  # computed after the gradient reduction: equal on every replica
_SLOWEST = ("step_s",)


def combine_metrics(shares: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The metrics of one step from those of its data-parallel replicas: ``loss`` (each a
    part of the whole batch's token mean) and ``tokens`` summed, ``grad_norm`` taken from
    the first, ``step_s`` the slowest, every other metric (the loss's per-token statistics)
    averaged with the replicas' loss tokens as weights. A replica without rows has no
    statistics and weight 0."""
    if len(shares) == 1:
        return dict(shares[0])
    out: dict[str, float] = {}
    weights = [float(m.get("tokens", 0.0)) for m in shares]
    for key in dict.fromkeys(k for m in shares for k in m):
        have = [(m[key], w) for m, w in zip(shares, weights) if key in m]
        if key in _SUMMED:
            out[key] = float(sum(v for v, _ in have))
        elif key in _SHARED:
            out[key] = float(have[0][0])
        elif key in _SLOWEST:
            out[key] = float(max(v for v, _ in have))
        else:
            total = sum(w for _, w in have)
            out[key] = float(sum(v * w for v, w in have) / total) if total > 0 else float(np.mean([v for v, _ in have]))
    return out
