"""The boundary between the trainer actor and the thing that does the optimisation.

The trainer actor owns the loop (``next_batch`` -> ``train_step`` -> ``publish``); a backend
owns a model and its optimiser. ``torch`` (plain PyTorch, CPU or one GPU) and ``megatron``
(Megatron-core, tensor parallel, multi-process) implement it with the same GRPO loss and the
same ``Batch`` contract, so the backend choice changes nothing outside ``training/``.
"""

from __future__ import annotations

from typing import Protocol

from astraflow.contracts import Batch, WeightVersion


class TrainerBackend(Protocol):
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimiser step on the batch; returns loss and diagnostics."""

    def publish(self, store, policy: str, version: int) -> WeightVersion:
        """Write the current weights as ``version`` of ``policy`` into the weight store and
        commit it (all ranks finish writing before the commit marker). A backend that can
        also ``snapshot()`` its weights (a dict of CPU tensors) takes them as ``state=`` and
        is published by a helper thread while it trains the next step."""

    def close(self) -> None: ...
