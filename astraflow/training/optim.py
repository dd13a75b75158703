"""The trainers' optimiser: torch's AdamW, fused (one kernel over every parameter instead of a
loop of small ones) where every parameter lies on a device torch has a fused AdamW for, else
torch's default implementation. The update rule and the state (moments and step count) are
the same either way, so optimiser checkpoints load across the two."""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: device types with a fused AdamW in torch
FUSED_DEVICES = ("cpu", "cuda")


def adamw(params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
          weight_decay: float) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``params``, fused where it can be."""
    params = list(params)
    fused = bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True if fused else None)
