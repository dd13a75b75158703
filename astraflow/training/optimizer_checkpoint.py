"""A trainer's optimiser-state checkpoint: saved every ``trainer.optimizer_checkpoint_every``
steps and when the trainer stops, loaded when a run resumes from its committed weights.

A mixin of ``Trainer`` (``trainer``), kept apart from its loop: what is saved (the optimiser
state, and the fp32 master weights when versions are published narrower), what is refused
(weights holding nan/inf, a checkpoint newer than the committed weights) and the warning when a
resume continues from rounded weights.

A checkpoint taken before its version is committed (right after its step, while the version
publishes) goes to ``<path>.pending`` and replaces the checkpoint only once the version is
committed (``promote_optimizer``): a publish that fails never costs the last usable one.

A save refused for want of room (a full disk, a quota, a file-size limit) stops the trainer the
way a publish's full disk does: a run that trained on would keep a checkpoint ever further
behind its weights, and its resume would continue from old moments without a word.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from pathlib import Path
from typing import Any

from astraflow.training.backend import TrainerBackend
from astraflow.training.numerics import nonfinite_tensors
from storage.atomic import write_atomically
from storage.full_disk import full_disk_in
from storage.weights import WeightStore

log = logging.getLogger("astraflow.training")


class OptimizerCheckpoint:
    """Saving and loading a trainer's optimiser state; uses the trainer's ``policy``, ``cfg``,
    ``backend``, ``store``, ``version``, ``optimizer_path``, ``optimizer_resumed_from``, ``error``
    and ``_fail``."""

    policy: str
    cfg: Any
    backend: TrainerBackend | None
    store: WeightStore | None
    version: int
    committed: int
    optimizer_path: Path | None
    optimizer_resumed_from: int | None
    error: str | None
    #: saves that failed other than for want of room (shown in the trainer's ``state()``)
    optimizer_save_failures: int = 0
    #: the version of the checkpoint waiting in ``<path>.pending`` for its commit (None: none)
    _pending_version: int | None = None
    _checkpoint_lock = threading.Lock()
    #: why a resumed trainer went on with fresh moments (None: it did not), and whether it went on
    #: from published weights rounded to their dtype: the run's console says both at a resume
    optimizer_fresh_why: str | None = None
    resumed_from_rounded: bool = False

    def optimizer_resume_state(self) -> dict[str, Any]:
        """What the trainer's ``state()`` says of the optimiser state it resumed with."""
        return {"optimizer_resumed_from": self.optimizer_resumed_from, "optimizer_fresh_why": self.optimizer_fresh_why,
                "resumed_from_rounded": self.resumed_from_rounded}

    def _pending_path(self) -> Path:
        return self.optimizer_path.with_name(self.optimizer_path.name + ".pending")

    def promote_optimizer(self) -> None:
        """The checkpoint waiting for its version's commit replaces the last one, once committed."""
        with self._checkpoint_lock:
            if self._pending_version is None or self._pending_version > self.committed:
                return
            try:
                os.replace(self._pending_path(), self.optimizer_path)
            except OSError:
                log.exception("trainer %s: promoting the optimiser state of v%d failed", self.policy,
                              self._pending_version)
            self._pending_version = None

    def save_optimizer(self) -> bool:
        """Write the backend's optimiser state (with the version its weights are at) to
        ``optimizer_path``, atomically; False when there is no path, the backend has none or its
        weights hold nan/inf (a resume must not continue from them).
        Versions published narrower than the fp32 master weights (``publish_dtype: bf16``) are
        rounded, so the master weights are saved with it (``master_weights``). A full disk,
        quota or file-size limit raises its ``OSError`` (the trainer stops, the run ends on it,
        resumable); any other failure is logged and counted in ``optimizer_save_failures``."""
        if (self.optimizer_path is None or not self.backend.supports_optimizer_state or self.version == 0
                or self.version == self._start_version):  # no step here: the state is not of this version
            return False
        import torch

        try:  # the weights are read from the backend too, which may have failed (its ranks stopped)
            bad = nonfinite_tensors(self.backend.state_dict())
            if bad:
                log.warning("trainer %s: not saving the optimiser state of v%d, weights hold nan/inf (%s)",
                            self.policy, self.version, ", ".join(bad[:3]))
                return False
            record = {"policy": self.policy, "version": self.version, "optimizer": self.backend.optimizer_state()}
            if self.cfg.resolved_publish_dtype != "fp32":
                record["master_weights"] = self.backend.state_dict()
            buf = io.BytesIO()
            torch.save(record, buf)
            self.optimizer_path.parent.mkdir(parents=True, exist_ok=True)
            with self._checkpoint_lock:
                ahead = self.version > self.committed  # its version still publishing (or failed to)
                write_atomically(self._pending_path() if ahead else self.optimizer_path, buf.getvalue())
                self._pending_version = self.version if ahead else None
            self.promote_optimizer()  # committed meanwhile
            return True
        except Exception as err:
            full = full_disk_in(err)
            if full is not None:
                raise OSError(full.errno, f"saving the optimiser state of v{self.version} failed: {full.strerror}",
                              str(full.filename or self.optimizer_path)) from err
            self.optimizer_save_failures += 1
            log.exception("trainer %s: saving the optimiser state of v%d failed", self.policy, self.version)
            return False

    def save_optimizer_on_exit(self) -> None:
        """The save as the trainer stops: a full disk then is reported through ``state()`` (as
        the trainer's error unless it has one already), not raised out of its thread or ``stop()``."""
        try:
            self.save_optimizer()
        except OSError as err:
            log.error("trainer %s: %s", self.policy, err)
            if self.error is None:
                self._fail(err)

    def _fail(self, err: Exception) -> None:
        raise NotImplementedError  # the trainer's: reports ``err`` through its ``state()``

    def _load_optimizer(self) -> None:
        """A resumed run: continue with the saved optimiser state when there is one. It may be
        a few steps older than the weights (saved every ``optimizer_checkpoint_every`` steps,
        and the run stopped without saving again): older moments still beat fresh ones. One
        newer than the weights (a trainer killed between a step and its commit) is not used."""
        path = self.optimizer_path
        rounded = self.store.manifest(self.policy, self.version)["meta"].get("dtype", "fp32") != "fp32"
        if path is None or not path.exists() or not self.backend.supports_optimizer_state:
            self.optimizer_fresh_why = ("its backend keeps no optimiser state" if path is not None
                                        and not self.backend.supports_optimizer_state else
                                        "no checkpoint was saved: trainer.optimizer_checkpoint_every")
            log.info("trainer %s: resuming at v%d with a fresh optimiser state", self.policy, self.version)
            self._warn_rounded(rounded, None)
            return
        import torch

        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if int(saved["version"]) > self.version:  # saved after its step, the trainer died before the commit
                raise ValueError(f"it is of v{saved['version']}, newer than the committed weights (its moments "
                                 "hold the gradient of a batch that will be trained again)")
            self.backend.load_optimizer_state(saved["optimizer"])
        except Exception as err:  # unreadable, or another model's: fresh moments, not a failed resume
            self.optimizer_fresh_why = f"{path.name} cannot be used: {type(err).__name__}: {err}"[:300]
            log.warning("trainer %s: %s cannot be used (%s: %s); starting with a fresh optimiser state",
                        self.policy, path, type(err).__name__, err)
            self._warn_rounded(rounded, None)
            return
        self.optimizer_resumed_from = int(saved["version"])
        master = saved.get("master_weights") if self.optimizer_resumed_from == self.version else None
        if master is not None:  # the exact weights the published version was rounded from
            self.backend.load_state_dict(master)
        gap = self.version - self.optimizer_resumed_from
        if gap:  # its saves failed, or the trainer stopped without its last one: the moments lag the weights
            log.warning("trainer %s: resuming at v%d with the optimiser state of v%d, %d step(s) older than the "
                        "weights (trainer.optimizer_checkpoint_every = %s; a gap past it means saves failed: see "
                        "the previous trainer log)", self.policy, self.version, self.optimizer_resumed_from, gap,
                        self.cfg.optimizer_checkpoint_every)
        else:
            log.info("trainer %s: resuming at v%d with the optimiser state of v%d", self.policy, self.version,
                     self.optimizer_resumed_from)
        self._warn_rounded(rounded and master is None, self.optimizer_resumed_from)

    def _warn_rounded(self, rounded: bool, checkpoint_version: int | None) -> None:
        """A resume that continues from a published version rounded to a narrower dtype."""
        self.resumed_from_rounded = rounded
        if rounded:
            log.warning("trainer %s: resuming from the published weights of v%d, rounded to their publish "
                        "dtype (the fp32 master weights are only in an optimiser checkpoint of the same version; "
                        "this one is of %s)", self.policy, self.version,
                        "none" if checkpoint_version is None else f"v{checkpoint_version}")
