"""The trainer's side of a batch served by reference: its rows read from the trajectory store.

The data layer's ``next_batch`` answers with a ``BatchRefs``: which stored rows to train on and
what only it knows of them (group statistics, staleness, replay). ``BatchRows.batch`` reads the
rows in the trainer's own process, from the store the RaaS nodes write (the run's
``storage.trajectories``, opened read-only), and makes the complete ``Batch`` every backend
trains on. A row that cannot be read fails the batch loudly, naming it; the data layer keeps
the batch as served, not consumed, until a version trained on it is committed (a trainer that
fails here never commits it, and a replaced trainer gets it back).
"""

from __future__ import annotations

import json
import threading
from typing import get_args

import numpy as np

from astraflow.batches import Batch, BatchItem, BatchRefs, RowRef
from astraflow.contracts import FinishReason, Sequence, sequence_from_stored
from storage.trajectories import StoredSequence, TrajectoryStore, open_trajectory_store
from storage.trajectories.columns import Columns

FINISH_REASONS = frozenset(get_args(FinishReason))


class RowsUnreadable(RuntimeError):
    """A row a batch names could not be read from the trajectory store (or is not the row the
    data layer named: another store, or a store rewritten behind the run)."""


class BatchRows:
    """Reads the rows of ``BatchRefs`` from the trajectory store at ``store_url`` (opened on
    first use, read-only). Thread-safe: the store object is not, so reads take a lock."""

    def __init__(self, store_url: str):
        self.url = store_url
        self._store: TrajectoryStore | None = None
        self._lock = threading.Lock()

    def batch(self, served: BatchRefs | Batch) -> Batch:
        """The complete ``Batch`` of ``served``; a ``Batch`` (already complete) is returned as is.
        ``RowsUnreadable`` names the first rows that could not be read."""
        if isinstance(served, Batch):
            return served
        items = served.items
        with self._lock:
            cols = self._read(served, items)
        for it, task_id in zip(items, cols.task_id):
            if task_id != it.task_id:
                raise RowsUnreadable(
                    f"batch v{served.version} of {served.policy}: row {it.ref.segment}[{it.ref.index}] of "
                    f"{self.url} is of task {task_id!r}, the data layer named {it.task_id!r}: the trainer "
                    "reads another trajectory store than the nodes write (check storage.trajectories)")
        out = _items(served.policy, items, cols) if _well_formed(cols) else [
            _item(served.policy, it, row) for it, row in zip(items, cols.rows())]  # raises naming what is wrong
        return Batch(policy=served.policy, version=served.version, items=tuple(out), metrics=served.metrics)

    def _read(self, served: BatchRefs, items: tuple[RowRef, ...]) -> Columns:
        refs = [it.ref for it in items]
        try:
            if self._store is None:
                self._store = open_trajectory_store(self.url, "r")
            # column-wise: one copy per column for the batch, rows as views of it
            return self._store.read_columns(refs)
        except Exception as err:
            bad = self._unreadable(items) if self._store is not None else list(items)
            named = "; ".join(f"{it.ref.segment}[{it.ref.index}] (task {it.task_id})" for it in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise RowsUnreadable(
                f"batch v{served.version} of {served.policy}: {len(bad)} of its {len(items)} rows "
                f"cannot be read from the trajectory store {self.url}"
                + (f": {named}{more}" if named else "") + f" ({type(err).__name__}: {err})") from err

    def _unreadable(self, items: tuple[RowRef, ...]) -> list[RowRef]:
        """The rows that fail when read one at a time (after a batched read failed)."""
        bad = []
        for it in items:
            try:
                self._store.read([it.ref])
            except Exception:
                bad.append(it)
        return bad


def _well_formed(cols: Columns) -> bool:
    """Whether every row passes ``Sequence``'s checks, tested on the columns at once."""
    gen = cols.policy_ids >= 0
    return bool(len(cols) and (cols.lengths > 0).all() and not (cols.loss_mask.astype(bool) & ~gen).any()
                and (gen == (cols.versions >= 0)).all() and np.isfinite(cols.reward).all()
                and set(cols.finish_reason) <= FINISH_REASONS)


def _items(policy: str, items: tuple[RowRef, ...], cols: Columns) -> list[BatchItem]:
    """``_item`` of every row, column-wise: the sequences are views of the batch's columns (checked
    by ``_well_formed``), the loss masks restricted to ``policy``'s tokens in one pass."""
    metas = [json.loads(m) for m in cols.meta]
    lengths = cols.lengths
    own_id = np.repeat(np.fromiter((m["policies"].index(policy) for m in metas), np.int16, len(metas)), lengths)
    loss_mask = cols.loss_mask.astype(bool)
    own = loss_mask & (cols.policy_ids == own_id)
    o = cols.offsets.tolist()
    out = []
    for i, (it, meta, reward, finish) in enumerate(zip(items, metas, cols.reward.tolist(), cols.finish_reason)):
        a, b = o[i], o[i + 1]
        seq = Sequence.checked_already(cols.tokens[a:b], loss_mask[a:b], cols.logprobs[a:b], cols.policy_ids[a:b],
                                       cols.versions[a:b], reward, meta.get("rewards", {}), finish)
        out.append(BatchItem(seq, own[a:b], it.group_mean, it.group_std, it.group_size, it.staleness, it.task_id,
                             it.replayed))
    return out


def _item(policy: str, it: RowRef, row: StoredSequence) -> BatchItem:
    """The ``BatchItem`` of one served row: its sequence, the loss mask restricted to the
    batch's policy's tokens, and the data layer's statistics."""
    meta = json.loads(row.meta)
    seq = sequence_from_stored(row, meta)
    pidx = meta["policies"].index(policy)
    return BatchItem(sequence=seq, loss_mask=seq.loss_mask & (seq.policy_ids == pidx), group_mean=it.group_mean,
                     group_std=it.group_std, group_size=it.group_size, staleness=it.staleness,
                     task_id=it.task_id, replayed=it.replayed)
