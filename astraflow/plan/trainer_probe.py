"""The calibration's trainer in a process of its own, as a run places it (a worker of its own,
apart from the engine's).

The child builds the run's trainer backend, then takes ``repeats`` timed steps (after one
untimed warm-up) on a fixed batch, publishing each version as the trainer does: a backend that
``supports_snapshot`` commits version n in a helper thread while step n+1 trains, so a step's
time is its training, the snapshot and the wait for the previous publish (the trainer's
critical path); any other backend publishes in line. Before each step it tells the parent,
which generates beside it (``on_step``) as the run's engine does while the trainer trains.

The child answers through a pipe: ``("step", v)`` before step v, then ``("done", seconds)`` or
``("error", text)``. A child that fails, dies or passes ``timeout_s`` is a `PlanError` that
says so and, where it reported one, quotes its error.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from astraflow.batches import Batch, BatchItem
from astraflow.plan.pools import PlanError
from astraflow.training.config import TrainerConfig

#: seconds the child has to exit after its last answer before it is killed
EXIT_GRACE_S = 10.0


@dataclass(frozen=True)
class TrainerProbe:
    """What the child needs: the run's trainer, its model and one batch to step on."""

    trainer: TrainerConfig
    model: str
    seed: int
    policy: str
    items: tuple[BatchItem, ...]
    repeats: int
    weights_root: str
    """Where the child publishes its versions (the parent may read them from there)."""


async def trainer_steps(probe: TrainerProbe, on_step: Callable[[int], Awaitable[None]],
                        timeout_s: float = 600.0) -> list[float]:
    """The ``probe.repeats`` timed step times of a trainer in a child process; ``on_step(v)`` is
    awaited here when the child starts step v (v = 0 is the warm-up)."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no state (threads, torch) of this one
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(there, probe), name="astraflow-calibrate-trainer", daemon=True)
    proc.start()
    there.close()  # the child's end: EOF here once the child is gone
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if not await asyncio.to_thread(here.poll, 0.2):
                if time.monotonic() > deadline:
                    raise PlanError(f"--calibrate: the trainer process took more than {timeout_s:.0f}s; "
                                    "is the machine overloaded?")
                continue
            try:
                kind, value = here.recv()
            except EOFError:  # closed without an answer: it died
                proc.join(EXIT_GRACE_S)
                raise PlanError(f"--calibrate: the trainer process exited with code {proc.exitcode} before it "
                                "reported its steps (killed, or out of memory?); its output is above") from None
            if kind == "step":
                await on_step(value)
            elif kind == "done":
                return value
            else:
                raise PlanError(f"--calibrate: the trainer process failed: {value}")
    finally:
        here.close()
        proc.join(EXIT_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _child(conn, probe: TrainerProbe) -> None:
    """The child process: its steps' times, or its error, through ``conn``."""
    try:
        conn.send(("done", _steps(conn, probe)))
    except BaseException as err:
        traceback.print_exc()  # the whole story on stderr; the parent quotes the last line
        conn.send(("error", f"{type(err).__name__}: {err}"))
        conn.close()
        sys.exit(1)
    conn.close()


def _steps(conn, probe: TrainerProbe) -> list[float]:
    from astraflow.training.trainer import make_backend
    from storage.weights import WeightStore

    backend = make_backend(probe.trainer, probe.model, probe.seed)
    store = WeightStore(Path(probe.weights_root))
    steps: list[float] = []
    publishing: threading.Thread | None = None
    failed: list[BaseException] = []

    def publish(version: int, state: dict) -> None:
        try:
            backend.publish(store, probe.policy, version, state=state)
        except BaseException as err:  # re-raised by the step that waits for it
            failed.append(err)

    try:
        for v in range(probe.repeats + 1):
            conn.send(("step", v))
            t0 = time.perf_counter()
            backend.train_step(Batch(policy=probe.policy, version=v, items=probe.items))
            if backend.supports_snapshot:  # as the trainer: the publish overlaps the next step
                state = backend.snapshot()
                if publishing is not None:
                    publishing.join()
                publishing = threading.Thread(target=publish, args=(v + 1, state), name="calibrate-publish")
                publishing.start()
            else:
                backend.publish(store, probe.policy, v + 1)
            if failed:
                raise failed[0]
            if v:  # the first is a warm-up
                steps.append(time.perf_counter() - t0)
        if publishing is not None:
            publishing.join()
        if failed:
            raise failed[0]
    finally:
        backend.close()
    return steps
