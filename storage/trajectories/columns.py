"""Trajectory store, columns room: many entries as concatenated columns (``TrajectoryStore.read_columns``).

Why it exists: a trainer turns a batch of entries into a few token tensors; building one
``StoredSequence`` per entry (five array copies and an object each) only to concatenate them
again costs more CPU than reading the bytes. ``Columns`` holds the entries of one read in the
order they were asked for: every per-token array concatenated once (entry ``i`` owns
``[offsets[i], offsets[i + 1])`` of each), the per-entry numbers as arrays, the string columns
as lists. Rows come out on demand (``row``, ``rows``) as views of those arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from storage.trajectories.layout import FLAT_DTYPES, EntryRef, StoredSequence


@dataclass(frozen=True, eq=False)
class Columns:
    """Entries ``refs`` (in that order) as columns. Per-token arrays have the on-disk dtypes
    (``layout.FLAT_DTYPES``); ``offsets`` is int64 of length ``len(refs) + 1`` starting at 0
    (the ``cu_seqlens`` of packed/varlen attention)."""

    refs: list[EntryRef]
    offsets: np.ndarray  # int64 (n + 1,)
    tokens: np.ndarray  # int32 (offsets[-1],)
    loss_mask: np.ndarray  # uint8
    logprobs: np.ndarray  # float32
    policy_ids: np.ndarray  # int16
    versions: np.ndarray  # int32
    seq_index: np.ndarray  # int64 (n,)
    num_sequences: np.ndarray  # int64 (n,)
    reward: np.ndarray  # float64 (n,)
    task_id: list[str]
    group_id: list[str]
    finish_reason: list[str]
    meta: list[str]

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per entry (int64)."""
        return np.diff(self.offsets)

    def split(self, name: str) -> list[np.ndarray]:
        """Per-token column ``name`` cut into one view per entry."""
        flat, o = self._flat(name), self.offsets.tolist()
        return [flat[a:b] for a, b in zip(o[:-1], o[1:])]

    def padded(self, name: str, pad: int | float = 0, width: int | None = None) -> np.ndarray:
        """Per-token column ``name`` as a ``(len, width)`` array, entry ``i`` in row ``i`` from
        column 0, the rest ``pad`` (``width``: the longest entry unless given; it must fit it).
        One vectorised scatter: no per-entry Python."""
        flat, lengths = self._flat(name), self.lengths
        longest = int(lengths.max()) if len(lengths) else 0
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width {width} is shorter than the longest entry ({longest} tokens): pass at least that")
        out = np.full((len(self), width), pad, dtype=flat.dtype)
        out[np.arange(width) < lengths[:, None]] = flat
        return out

    def row(self, i: int, copy: bool = False) -> StoredSequence:
        """Entry ``i`` as a ``StoredSequence``; its arrays are views of the columns unless ``copy``
        (a view keeps this whole read alive)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        arrays = [self._flat(k)[a:b] for k in FLAT_DTYPES]
        if copy:
            arrays = [x.copy() for x in arrays]
        return StoredSequence(self.task_id[i], self.group_id[i], int(self.seq_index[i]), int(self.num_sequences[i]),
                              *arrays, float(self.reward[i]), self.finish_reason[i], self.meta[i])

    def rows(self, copy: bool = False) -> list[StoredSequence]:
        """Every entry as a ``StoredSequence`` (see ``row``), built column-wise."""
        if not len(self):
            return []
        o = self.offsets.tolist()
        bounds = list(zip(o[:-1], o[1:]))
        flats = [self._flat(k) for k in FLAT_DTYPES]
        per = [[f[a:b].copy() for a, b in bounds] if copy else [f[a:b] for a, b in bounds] for f in flats]
        # positional: the fields in StoredSequence's order (cheaper than keywords, per row)
        return [StoredSequence(*f) for f in zip(
            self.task_id, self.group_id, self.seq_index.tolist(), self.num_sequences.tolist(), *per,
            self.reward.tolist(), self.finish_reason, self.meta)]

    def _flat(self, name: str) -> np.ndarray:
        if name not in FLAT_DTYPES:
            raise ValueError(f"{name!r} is not a per-token column: use one of {list(FLAT_DTYPES)}")
        return getattr(self, name)


def empty_columns() -> Columns:
    """The columns of a read of no entries."""
    return Columns([], np.zeros(1, np.int64), *(np.zeros(0, dt) for dt in FLAT_DTYPES.values()),
                   np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64), [], [], [], [])
