"""The trainer of one policy: a streaming consumer of batches and a publisher of versions.

It knows nothing about RaaS nodes, partitions or other policies' trainers. Its loop, in a
thread started by ``start()``::

    publish v0 (the initial weights, so every node starts from the same committed version)
    repeat max_steps times:
        batch = data_layer.next_batch(policy, version)      # waits, with a deadline; by reference:
        batch = rows.batch(batch)                           # its rows read from the trajectory store
        backend.train_step(batch)                           # GRPO
        backend.publish(weight_store, policy, version + 1)  # shards + manifest + marker
        data_layer.published(policy, version + 1, metrics)

Asynchronous overlap "training vs rollout": while this loop trains on batch k, RaaS nodes
keep generating with version <= k; the data layer bounds how stale consumed data may be.

The publish of the version just trained overlaps the next step (backends that
``supports_snapshot``: ``torch``, ``sim``): a helper thread writes and commits a copy of
the weights while the loop fetches and trains the next batch; versions are committed and
reported in order, at most one publish in flight. The next batch is requested only once its
step can start (an earlier request would train on staler data).

The optimiser state is checkpointed and restored on resume by ``optimizer_checkpoint``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from astraflow.batches import BatchRefs
from astraflow.training.backend import BackendProcessLost, TrainerBackend
from astraflow.training.config import TrainerConfig
from astraflow.training.numerics import NonFiniteSteps
from astraflow.training.optimizer_checkpoint import OptimizerCheckpoint
from astraflow.training.rows import BatchRows
from astraflow.transport import FollowsDataLayer, Link, bind, call_sync
from storage.weights import WeightStore

log = logging.getLogger("astraflow.training")


def make_backend(cfg: TrainerConfig, model_path: str, seed: int, log_dir: str | None = None) -> TrainerBackend:
    if cfg.backend == "torch":
        import torch

        from astraflow.training.torch_backend import TorchBackend

        torch.set_num_threads(cfg.threads)
        return TorchBackend(
            model_path, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.max_grad_norm,
            micro_batch_size=cfg.micro_batch, clip_low=cfg.clip_low, clip_high=cfg.clip_high, seed=seed,
            off_policy=cfg.off_policy, is_cap=cfg.is_cap, m2_tau=cfg.m2_tau, device=cfg.device,
            skip_zero_advantage=cfg.skip_zero_advantage, precision=cfg.precision,
            publish_dtype=cfg.resolved_publish_dtype, advantage=cfg.advantage, loss_fn=cfg.loss_fn,
            kl_coef=cfg.kl_coef, share_prompt=cfg.share_prompt,
        )
    if cfg.backend == "megatron":
        from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig

        return MegatronBackend(MegatronBackendConfig(
            hf_checkpoint=model_path, tp_size=cfg.tensor_parallel, dp_size=cfg.data_parallel, lr=cfg.lr,
            weight_decay=cfg.weight_decay, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            max_grad_norm=cfg.max_grad_norm, seed=seed,
            threads_per_rank=cfg.threads, skip_zero_advantage=cfg.skip_zero_advantage,
            publish_dtype=cfg.resolved_publish_dtype, advantage=cfg.advantage, log_dir=log_dir,
            **({} if cfg.loss_fn == "grpo" else {"loss_fn": cfg.loss_fn}),
        ))
    if cfg.backend == "sim":
        from astraflow.training.sim_backend import SimBackend

        return SimBackend(step_seconds=cfg.sim_step_seconds, seconds_per_token=cfg.sim_seconds_per_token,
                          schedule=cfg.sim_step_schedule)
    raise ValueError(f"unknown trainer backend {cfg.backend!r}; known: torch, megatron, sim")


class _Stopped(Exception):
    """``stop()`` was called while the loop waited for a batch, or returned before a version
    could be committed."""


class _Background:
    """``fn()`` in a daemon thread; ``result()`` waits and returns its value or raises its error.
    (Daemon, unlike a ``ThreadPoolExecutor``'s threads: one blocked in a call to the data layer
    must not hold up the worker's exit.)"""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as err:  # handed to whoever waits for the result
            self._error = err

    def result(self, timeout: float | None = None) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


class Trainer(OptimizerCheckpoint, FollowsDataLayer):
    """Dask actor: trains one policy."""

    def __init__(
        self,
        *,
        policy: str,
        cfg: TrainerConfig,
        model_path: str,
        weights_root: str,
        keep_versions: int,
        data_layer: Any,
        max_steps: int,
        seed: int = 0,
        write_deltas: bool = False,
        optimizer_path: str | None = None,
        store_url: str | None = None,
        log_dir: str | None = None,
    ):
        self.policy = policy
        self.cfg = cfg
        self.model_path = model_path
        self.weights_root = weights_root
        self.keep_versions = keep_versions
        self.dl = Link(data_layer, "the data layer")  # swapped by ``reconnect``
        #: reads the rows of the batches served by reference, from the trajectory store the
        #: nodes write (``storage.trajectories``); None: no store (a driver hands full batches)
        self.rows = BatchRows(store_url) if store_url else None
        self.max_steps = max_steps
        self.seed = seed
        #: where the backend's own processes log (a Megatron backend's ranks); None: its work directory
        self.log_dir = log_dir
        #: the version the backend's weights are at (= optimiser steps taken, counted from the
        #: initial weights, version 0); ``committed``: the newest version in the store
        self.version = 0
        self._start_version = 0  # the version it started from (a resumed run: its latest)
        self.committed = 0
        self.done = False
        self.error: str | None = None
        self.error_os: tuple[int, str | None] | None = None
        """(errno, filename) when the error was an ``OSError``: the orchestrator tells a full disk apart."""
        #: the error was a process of the backend killed from outside (``BackendProcessLost``): the
        #: orchestrator restarts the trainer as if its worker had been lost
        self.error_lost = False
        self.wait_s = 0.0
        #: seconds waited for batches up to the last fetch (``wait_s`` counts committed steps
        #: only); with ``_waiting_since`` it gives the autoscaler a wait that a starved trainer
        #: cannot hide (``state()["wait_total_s"]``)
        self._waited_s = 0.0
        self._waiting_since: float | None = None
        self.train_s = 0.0
        self.publish_s = 0.0
        #: seconds spent reading the rows of served batches (part of the wait for batches)
        self.read_s = 0.0
        self.last_metrics: dict[str, float] = {}
        #: held while ``committed`` and ``last_metrics`` change together: `state()` (another thread)
        #: shows a version with its own step's reward and loss
        self._shown_lock = threading.Lock()
        #: counts the steps in a row with a nan/inf loss or gradient norm (``max_nonfinite_steps``)
        self.nonfinite = NonFiniteSteps(policy, cfg.max_nonfinite_steps)
        self._stop = threading.Event()
        #: stepped by a driver (``run.mode: sync``), not by a loop of its own
        self._driven = False
        #: held while a version is published and reported; ``stop()`` takes it to close commits
        self._commit_lock = threading.Lock()
        #: set once ``stop()`` returned with the loop still running: no version commits after it
        self._closed = False
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        #: when the last version was committed: a done trainer waits no more, its wait fraction stays its last step's
        self._committed_at: float | None = None
        self.write_deltas = write_deltas
        #: the last versions' delta density, bytes and write seconds (``storage.deltas``): what state() shows
        self.delta_history: deque[dict[str, float]] = deque(maxlen=5)
        self._delta_thread: threading.Thread | None = None
        self._delta_base: tuple[int, dict] | None = None
        #: where the optimiser state is saved (``trainer.optimizer_checkpoint_every``); None: never
        self.optimizer_path = Path(optimizer_path) if optimizer_path else None
        #: the version whose optimiser state a resumed run continued with (None: fresh)
        self.optimizer_resumed_from: int | None = None
        #: built by ``start()``; None before (``stop()`` of a trainer never started saves nothing)
        self.backend: TrainerBackend | None = None
        self.store: WeightStore | None = None

    def start(self, run_loop: bool = True) -> int:
        """Build the backend, publish the initial version, start the loop (unless a driver
        calls ``step()`` itself: the trainer-centred baseline). Returns the version the loop
        starts from (a resumed run continues after its latest version)."""
        bind(self.dl)
        self.store = WeightStore(self.weights_root, keep_last=self.keep_versions)
        self.backend = make_backend(self.cfg, self.model_path, self.seed, self.log_dir)
        latest = self.store.latest(self.policy)
        if latest is None:
            self.backend.publish(self.store, self.policy, 0)
        else:  # resuming a run: continue from its newest committed weights
            self.version = self.committed = self._start_version = latest.version
            if latest.version > 0:
                if not self.backend.supports_resume:
                    raise ValueError(
                        f"trainer backend {self.cfg.backend!r} cannot resume from committed weights yet: "
                        "start a new run directory"
                    )
                self.backend.load_state_dict(self.store.load(self.policy, latest.version))
                self._load_optimizer()
        if run_loop:
            self._thread = threading.Thread(target=self._run, name=f"trainer-{self.policy}", daemon=True)
            self._thread.start()
        return self.version

    def step(self) -> dict[str, float]:
        """One step driven from outside (``run.mode: sync``): batch, train, publish, in turn."""
        self._driven = True
        trained = self._train_next()  # advances self.version: call it before reading the version
        self._commit(self.version, None, *trained)
        self.done = self.committed >= self.max_steps
        return self.last_metrics

    def _train_next(self) -> tuple[Any, dict[str, float], float, float]:
        """Fetch the next batch and take one optimiser step on it: ``(batch, metrics, wait_s,
        train_s)``; the backend's weights are then at ``self.version`` (not yet published)."""
        t0 = self._waiting_since = time.time()
        try:
            batch = self._fetch(self.version)
        finally:
            self._waiting_since = None
            t1 = time.time()
            self._waited_s += t1 - t0
        metrics = self.backend.train_step(batch)
        self.nonfinite.observe(metrics, self.version + 1)
        self.version += 1
        every = self.cfg.optimizer_checkpoint_every  # in steps; the version counts them
        if every and self.version % every == 0:
            self.save_optimizer()
        return batch, metrics, t1 - t0, time.time() - t1

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """Stop the loop, waiting up to ``timeout`` for it. A loop still running then (a long
        step) commits nothing more: whoever stopped it goes on to end the run, and a version
        reported after that would count a batch the data layer already wrote off (a commit
        already under way is waited for, up to ``timeout`` more)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)  # the loop saves the optimiser state on its way out
            if self._thread.is_alive():
                held = self._commit_lock.acquire(timeout=timeout)
                self._closed = True
                if held:
                    self._commit_lock.release()
        elif self.backend is not None:  # run.mode sync: a driver stepped this trainer
            try:
                self.save_optimizer_on_exit()
            finally:
                self.backend.close()  # the Megatron backend's rank processes and work directory
        return self.state()

    def state(self) -> dict[str, Any]:
        now = self._committed_at if self.done and self._committed_at is not None else time.time()
        elapsed = max(now - self._started_at, 1e-9)
        waited = self._waited_s + (now - since if (since := self._waiting_since) else 0.0)
        if self._driven:  # a driver steps it once each rollout phase ended: idle between steps is waiting too
            waited = max(waited, elapsed - self.train_s - self.publish_s)
        with self._shown_lock:
            version, metrics = self.committed, dict(self.last_metrics)
        return {
            "policy": self.policy,
            "version": version,
            "trained_version": self.version,
            "done": self.done,
            "error": self.error,
            "error_os": self.error_os,
            "error_lost": self.error_lost,
            "wait_s": self.wait_s,
            "train_s": self.train_s,
            "publish_s": self.publish_s,
            "read_s": self.read_s,
            # the wait in progress included: a trainer that gets no batch shows as waiting
            "wait_fraction": min(1.0, waited / elapsed),
            "wait_total_s": waited,
            # the wait for the next batch so far (0: not waiting): a starved trainer shows as such at once
            "batch_wait_s": max(now - since, 0.0) if since and not self.done else 0.0,
            "deltas": list(self.delta_history),
            **self.optimizer_resume_state(),
            "optimizer_save_failures": self.optimizer_save_failures,
            "last_metrics": metrics,
        }

    def _fetch(self, version: int):
        """The data layer's next batch for a trainer at ``version``: waits up to
        ``batch_timeout_s`` (then a ``TimeoutError`` naming that setting), in calls of at most 2 s
        so that ``stop()`` ends the wait (``_Stopped``) instead of sitting out the deadline
        when no node is generating any more (e.g. Ctrl-C)."""
        deadline = time.time() + self.cfg.batch_timeout_s
        while True:
            wait = max(min(2.0, deadline - time.time()), 0.01)
            try:
                served = call_sync(self.dl.next_batch, self.policy, version, wait, timeout=wait + 30)
            except TimeoutError as err:  # BatchTimeout: nothing within this call's wait
                if time.time() >= deadline:
                    raise TimeoutError(
                        f"trainer {self.policy}: no batch within trainer.batch_timeout_s = "
                        f"{self.cfg.batch_timeout_s:g} s (raise policies[{self.policy}].trainer.batch_timeout_s "
                        f"where rollouts are that slow); last answer: {err}"
                    ) from err
                if self._stop.is_set():
                    raise _Stopped from None
                continue
            return self._rows(served)

    def _rows(self, served: Any) -> Any:
        """The complete batch of a batch served by reference (its rows read here, in the
        trainer's process); a complete ``Batch`` as is. ``RowsUnreadable`` names a row that
        cannot be read: the step fails loudly and the data layer keeps the batch as served."""
        if isinstance(served, BatchRefs):
            if self.rows is None:
                raise ValueError(f"trainer {self.policy}: the data layer served a batch by reference but this "
                                 "trainer was built without store_url (where the trajectory store is)")
            t0 = time.time()
            served = self.rows.batch(served)
            self.read_s += time.time() - t0
        return served

    def _commit(self, version: int, state: dict | None, batch, metrics: dict[str, float],
                wait_s: float, train_s: float) -> None:
        """Publish ``version`` (``state``: a snapshot taken right after its step; None: the
        backend's current weights), then report the version, with its step's metrics, to the
        data layer. Nothing is committed once ``stop()`` returned (``_Stopped``)."""
        with self._commit_lock:
            if self._closed:
                raise _Stopped(f"stopped before v{version} was committed")
            self._commit_unlocked(version, state, batch, metrics, wait_s, train_s)

    def _commit_unlocked(self, version: int, state: dict | None, batch, metrics: dict[str, float],
                         wait_s: float, train_s: float) -> None:
        t0 = time.time()
        if state is None:
            self.backend.publish(self.store, self.policy, version)
        else:
            self.backend.publish(self.store, self.policy, version, state=state)
        publish_s = time.time() - t0
        self.wait_s += wait_s
        self.train_s += train_s
        self.publish_s += publish_s
        self._committed_at = time.time()
        with self._shown_lock:
            self.last_metrics = {
                **metrics,
                "reward_mean": float(sum(i.sequence.reward for i in batch.items) / max(len(batch), 1)),
                "wait_s": wait_s,
                "train_s": train_s,
                "publish_s": publish_s,
                "trainer_wait_fraction": self.wait_s / max(self._committed_at - self._started_at, 1e-9),
            }
            self.committed = version
        self.promote_optimizer()
        if self.write_deltas:
            self._write_delta_async(version)
        call_sync(self.dl.published, self.policy, version, self.last_metrics, batch.metrics, timeout=60)

    def _write_delta_async(self, version: int) -> None:
        """Asynchronous overlap "delta writing vs training": the sparse delta ``v-1 -> v`` is
        computed from the committed shards in a helper thread while the next step trains.
        Invariant: at most one delta is being written (the next version, once published, waits
        for it before it is reported); a version whose predecessor retention already removed gets
        no delta (readers then load full shards)."""
        if self._delta_thread is not None and self._delta_thread.is_alive():
            self._delta_thread.join()
        self._delta_thread = threading.Thread(target=self._write_delta, args=(version,), daemon=True)
        self._delta_thread.start()

    def _write_delta(self, version: int) -> None:
        from storage.deltas import write_version_delta

        t0 = time.time()
        new = self.store.load(self.policy, version)
        base = self._delta_base
        if base is None or base[0] != version - 1:
            prev_version = version - 1
            known = prev_version in self.store.versions(self.policy)
            base = (prev_version, self.store.load(self.policy, prev_version)) if known else None
        if base is not None:
            stats = write_version_delta(self.store.root, self.policy, version - 1, version, base[1], new)
            self.delta_history.append({"version": version, "density": stats.density, "delta_bytes": stats.delta_bytes,
                                       "full_bytes": stats.full_bytes, "write_s": time.time() - t0})
        self._delta_base = (version, new)

    def _run(self) -> None:
        overlap = self.backend.supports_snapshot  # publish version n while step n+1 trains
        publishing: _Background | None = None  # the previous version, committed meanwhile
        try:
            while self.version < self.max_steps and not self._stop.is_set():
                trained = self._train_next()
                if not overlap:
                    self._commit(self.version, None, *trained)
                    continue
                state = self.backend.snapshot()
                if publishing is not None:  # versions are committed in order, one at a time
                    publishing, previous = None, publishing
                    previous.result()
                publishing = _Background(
                    lambda a=(self.version, state, *trained): self._commit(*a), f"publish-{self.policy}",
                )
            if publishing is not None:
                publishing, pending = None, publishing
                pending.result()
            self.done = self.committed >= self.max_steps
        except _Stopped as err:
            log.info("trainer %s stopped at v%d (%s)", self.policy, self.version,
                     err or "while waiting for a batch")
        except Exception as err:  # reported through state(); the orchestrator fails the run
            self._fail(err)
            log.exception("trainer %s failed", self.policy)
        finally:
            if publishing is not None:  # an error elsewhere: still commit what was trained
                try:
                    publishing.result()
                except _Stopped:  # stop() returned first: that version is not committed, by design
                    pass
                except Exception:
                    log.exception("trainer %s: publishing v%d failed", self.policy, self.version)
            if self.backend is not None:
                try:
                    self.save_optimizer_on_exit()
                finally:  # the Megatron backend's rank processes, whatever else failed
                    self._close_backend()

    def _fail(self, err: Exception) -> None:
        """Report ``err`` through ``state()``; an ``OSError``'s errno and file go with it (a full disk)."""
        self.error = f"{type(err).__name__}: {err}"
        self.error_lost = isinstance(err, BackendProcessLost)
        if isinstance(err, OSError) and err.errno is not None:
            self.error_os = (err.errno, None if err.filename is None else str(err.filename))

    def _close_backend(self) -> None:
        """Close the backend on the loop's way out; a failure is logged, the loop's own error
        (``state()``) stays the one reported."""
        try:
            self.backend.close()
        except Exception:
            log.exception("trainer %s: closing the backend failed", self.policy)
