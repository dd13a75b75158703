"""The two parts of the RL algorithm a config chooses by name: how a batch's rewards become
advantages (``trainer.advantage``) and the policy loss (``trainer.loss_fn``).

Built-ins are registered here; a researcher's own is named ``package.module:function`` and
imported in the trainer process, so a new estimator or loss needs no change in AstraFlow:

* an **advantage estimator** takes the batch's items (``BatchItem``: the sequence with its
  reward, and its group's mean, std and size as the data layer stamped them) and returns one
  advantage per item, in order;
* a **loss** has ``grpo_loss``'s contract: ``loss_fn(new_logprobs, old_logprobs, advantages,
  mask, clip_low, clip_high, *, num_tokens)`` with ``[B, T]`` log-probs and mask, ``[B]``
  advantages and ``num_tokens`` the whole batch's loss tokens (the normaliser, so micro-batches
  and data-parallel shares add up to one step); it returns the loss, or ``(loss, stats)`` with
  ``stats`` a dict of floats logged with the step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import numpy as np

from astraflow.batches import BatchItem, grpo_advantage
from astraflow.registry import Registry


def _check_advantage(obj: object) -> str | None:
    return None if callable(obj) else "is not a function of the batch's items"


def _check_loss(obj: object) -> str | None:
    if not callable(obj):
        return "is not a function"
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if "num_tokens" not in params and not takes_any:
        return ("does not take num_tokens (the whole batch's loss tokens, by which a micro-batch's loss is "
                "normalised): give it a num_tokens keyword, as astraflow.training.grpo:grpo_loss has")
    return None


ADVANTAGES: Registry[Callable[[Sequence[BatchItem]], np.ndarray]] = Registry("advantage estimator", _check_advantage)
LOSSES: Registry[Callable] = Registry("loss", _check_loss)


def _rewards(items: Sequence[BatchItem]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([it.sequence.reward for it in items], np.float64),
            np.array([it.group_mean for it in items], np.float64))


@ADVANTAGES.register("grpo")
def grpo(items: Sequence[BatchItem]) -> np.ndarray:
    """GRPO: the reward normalised within its group, ``(r - mean) / (std + 1e-6)``."""
    return np.array([grpo_advantage(it.sequence.reward, it.group_mean, it.group_std) for it in items], np.float32)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(items: Sequence[BatchItem]) -> np.ndarray:
    """Dr. GRPO: the reward minus its group's mean, not divided by the group's std (which
    weighs groups that are almost all right or all wrong up)."""
    r, mean = _rewards(items)
    return (r - mean).astype(np.float32)


@ADVANTAGES.register("rloo")
def rloo(items: Sequence[BatchItem]) -> np.ndarray:
    """REINFORCE leave-one-out: the reward minus the mean of the other samples of its group,
    ``G / (G - 1) * (r - mean)`` (0 for a group of one)."""
    r, mean = _rewards(items)
    g = np.array([it.group_size for it in items], np.float64)
    return np.where(g > 1, g / np.maximum(g - 1, 1) * (r - mean), 0.0).astype(np.float32)


@ADVANTAGES.register("batch_norm")
def batch_norm(items: Sequence[BatchItem]) -> np.ndarray:
    """REINFORCE++ with a group baseline: the reward minus its group's mean, then normalised
    over the whole batch (zero mean, unit std; all zero when every one is)."""
    r, mean = _rewards(items)
    a = r - mean
    if not np.any(a):
        return np.zeros(len(items), np.float32)
    return ((a - a.mean()) / (a.std() + 1e-6)).astype(np.float32)


def _grpo_loss(*args, **kwargs):
    from astraflow.training.grpo import grpo_loss

    return grpo_loss(*args, **kwargs)


LOSSES.register("grpo")(_grpo_loss)


def advantage_fn(name: str) -> Callable[[Sequence[BatchItem]], np.ndarray]:
    """The estimator ``name`` names (a built-in, or ``module:function``), checked to give one
    finite advantage per item when it is called (`advantages`)."""
    return ADVANTAGES.resolve(name)


def advantages(fn: Callable[[Sequence[BatchItem]], np.ndarray], items: Sequence[BatchItem], name: str) -> np.ndarray:
    """``fn(items)`` as float32, one finite advantage per item, or a ValueError naming ``name``."""
    out = np.asarray(fn(items), dtype=np.float32).reshape(-1)
    if out.shape != (len(items),):
        raise ValueError(f"trainer.advantage {name}: returned {out.size} advantages for {len(items)} sequences; "
                         "return one per item, in order")
    if not np.isfinite(out).all():
        raise ValueError(f"trainer.advantage {name}: returned an advantage that is not finite")
    return out


def loss_fn(name: str) -> Callable:
    """The loss ``name`` names (``grpo``, or ``module:function``)."""
    return LOSSES.resolve(name)


def loss_by_name(dotted: str) -> Callable:
    """The loss ``module:function`` names (an attribute of the module, or a name it registered),
    without the config's checks: what a Megatron rank, given a checked config, looks up."""
    import importlib

    from storage.ownership import add_user_dir

    module, _, name = dotted.partition(":")
    add_user_dir()  # a loss of the user's, from the directory `astraflow` was started in
    mod = importlib.import_module(module)
    return getattr(mod, name) if hasattr(mod, name) else LOSSES.get(name)


def is_builtin_loss(name: str) -> bool:
    return name == "grpo"


def user_loss(fn: Callable, name: str, new, old, adv, mask, clip_low: float, clip_high: float,
              num_tokens: int) -> tuple[Any, dict[str, float]]:
    """``fn`` called with the loss contract (module docstring): ``(loss, stats)``, a ValueError
    naming ``name`` for what it returns that is neither a scalar tensor nor such a pair."""
    import torch

    out = fn(new, old, adv, mask, clip_low, clip_high, num_tokens=num_tokens)
    loss, stats = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not isinstance(stats, dict):
        raise ValueError(f"trainer.loss_fn {name}: return a scalar tensor, or (loss, stats) with stats a dict of "
                         f"floats; got {type(out).__name__}")
    return loss.reshape(()), {str(k): float(v) for k, v in stats.items()}
