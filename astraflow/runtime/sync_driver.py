"""The trainer-centred baseline (``run.mode: sync``), for honest comparisons.

Same engines, losses, stores and actors as AstraFlow's asynchronous mode; only the control
differs. One driver loop does what a verl-style central trainer does each iteration:

1. open one batch worth of groups in the data layer, less those already on their way or
   buffered (a resumed run restores what its previous incarnation opened), and wait until every
   policy's buffer can fill a batch (rollout phase, ``R``: the slowest episode decides);
2. train each policy in turn, one step each, publishing its new version (training phase,
   ``T``: the RaaS nodes sit idle);
3. make every RaaS node load the new weights before the next iteration (sync phase, ``S``).

The per-iteration times are returned so that a benchmark can compute the ideal overlap
speedup ``(R + T + S) / max(R, T)`` of a system that runs rollout and training concurrently.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def drive_sync(
    dl: Any,
    trainers: dict[str, Any],
    nodes: Callable[[], list[Any]],
    batch_size: int,
    groups_per_batch: int,
    max_steps: int,
    timeout_s: float,
    on_tick: Callable[[], None] = lambda: None,
    recover: Callable[[str, BaseException], bool] = lambda policy, err: False,
) -> list[dict[str, float]]:
    """Run ``max_steps`` lock-step iterations within ``timeout_s`` seconds in all (what is left
    of the run's deadline); returns one timing record per iteration.

    ``trainers`` is the orchestrator's dict of handles: when a step fails, ``recover(policy, error)`` says
    whether a lost trainer was restarted (its handle swapped in that dict); the step is then
    taken again by the new trainer unless the lost one had committed it already."""
    iterations: list[dict[str, float]] = []
    deadline = time.time() + timeout_s

    def left() -> float:  # a phase waits at most for what is left of the deadline
        return max(1.0, deadline - time.time())

    # each trainer at its own version: a resumed run may have stopped between two trainers' steps
    versions = {p: t.state().result(timeout=30)["version"] for p, t in trainers.items()}
    while min(versions.values()) < max_steps:
        version = min(versions.values())
        due = [p for p in trainers if versions[p] < max_steps]  # one ahead waits for the others
        t0 = time.time()
        lacking = _lacking(dl, {p: versions[p] for p in due}, groups_per_batch, batch_size // groups_per_batch)
        if lacking:
            dl.open_iteration(lacking).result(timeout=30)
        while True:
            st = dl.state(0).result(timeout=30)  # before `ready`: nothing ingested unseen
            ready = {p: dl.ready(p, versions[p]).result(timeout=30) for p in due}
            if all(n >= batch_size for n in ready.values()):
                break
            if st["outstanding_groups"] == 0 and st["pending"] == 0 and st["leased"] == 0 and not st.get("budget"):
                dl.open_iteration(1).result(timeout=30)  # filters dropped groups: top up
            if time.time() > deadline:
                raise TimeoutError(f"run deadline passed in sync iteration {version}: batches not ready ({ready})")
            on_tick()
            time.sleep(0.02)
        t1 = time.time()
        for p in due:
            try:
                trainers[p].step().result(timeout=left())
            except Exception as err:
                if not recover(p, err):
                    raise
                if trainers[p].state().result(timeout=30)["version"] <= versions[p]:
                    trainers[p].step().result(timeout=left())
            versions[p] += 1
        t2 = time.time()
        for fut in [n.refresh() for n in nodes()]:
            fut.result(timeout=left())
        t3 = time.time()
        iterations.append({"step": min(versions.values()), "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
                           "iteration_s": t3 - t0})
        on_tick()
    return iterations


def _lacking(dl: Any, versions: dict[str, int], groups_per_batch: int, group_size: int) -> int:
    """Groups the next batch still lacks: one batch's worth less the groups rolling out or
    allowed and not yet created, and the whole groups every policy already has buffered. A run
    resumed with a batch's worth restored would otherwise roll out a second one behind it, and
    train every later iteration on rows of the version before, for good."""
    st = dl.state(0).result(timeout=30)
    buffered = min(dl.ready(p, v).result(timeout=30) for p, v in versions.items())
    return max(groups_per_batch - st["outstanding_groups"] - (st.get("budget") or 0) - buffered // group_size, 0)
