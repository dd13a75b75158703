"""The boundary between the trainer actor and the thing that does the optimisation.

The trainer actor owns the loop (``next_batch`` -> ``train_step`` -> ``publish``); a backend
owns a model and its optimiser. ``torch`` (plain PyTorch, CPU or one GPU) and ``megatron``
(Megatron-core, tensor parallel, multi-process) implement it with the same GRPO loss and the
same ``Batch`` contract (``sim``, no model, only takes a step's time), so the backend choice
changes nothing outside ``training/``.

What a backend can do beyond train and publish is declared by its ``supports_*`` properties;
the trainer reads them and calls a capability's methods only when it is declared.
"""

from __future__ import annotations

from typing import Any, Protocol

from astraflow.batches import Batch
from astraflow.contracts import WeightVersion


class BackendProcessLost(RuntimeError):
    """A process the backend computes in was killed from outside (SIGKILL: the out-of-memory
    killer, an administrator), not failed on its own: the trainer reports it (``error_lost`` in
    its state) and the run replaces the trainer as it replaces one whose worker was lost."""


class TrainerBackend(Protocol):
    @property
    def supports_snapshot(self) -> bool:
        """``snapshot()`` copies the weights, and ``publish`` takes such a copy as ``state=``:
        the trainer then publishes version n in a helper thread while step n+1 trains."""

    @property
    def supports_resume(self) -> bool:
        """``load_state_dict`` continues from committed weights (a run resumed on its run
        directory); without it a run directory with versions > 0 cannot be resumed."""

    @property
    def supports_optimizer_state(self) -> bool:
        """``optimizer_state`` / ``load_optimizer_state`` save and restore the optimiser's
        moments (``trainer.optimizer_checkpoint_every``)."""

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimiser step on the batch; returns loss and diagnostics."""

    def publish(self, store, policy: str, version: int, state: dict | None = None) -> WeightVersion:
        """Write the current weights (or ``state``, a ``snapshot()``; only with
        ``supports_snapshot``) as ``version`` of ``policy`` into the weight store and commit it
        (all ranks finish writing before the commit marker). Floating-point parameters go out in
        the configured ``publish_dtype``, recorded as ``meta["dtype"]``."""

    def snapshot(self) -> dict:
        """A copy of the weights as they are published (CPU tensors), unaffected by later steps."""

    def state_dict(self) -> dict:
        """The current weights at full precision (with ``supports_optimizer_state``: saved with
        the optimiser state when versions are published in a narrower dtype)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from these weights (a committed version, read by the trainer, or the master
        weights saved with the optimiser state), cast to the backend's own dtype."""

    def optimizer_state(self) -> dict[str, Any]:
        """The optimiser's state, for a checkpoint."""

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Continue with a saved optimiser state."""

    def close(self) -> None: ...
