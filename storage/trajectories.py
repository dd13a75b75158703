"""Zarr trajectory store: append-only segments written by RaaS nodes, read by the data layer.

(API skeleton: the storage implementation fills in the bodies; signatures are the contract the
components code against.)

Layout and commit protocol
--------------------------
Each writer owns one *segment* (a RaaS node writes its own; nobody else writes to it), so no
two processes ever write the same Zarr chunk and nothing relies on Zarr locking (it has none).
A segment holds flat per-token arrays (``tokens`` int32, ``loss_mask`` uint8, ``logprobs``
float32, ``policy_ids`` int16, ``versions`` int32) and per-entry index arrays (offsets, lengths,
rewards, ...). A batch of entries is published in two steps: (1) the chunk data of the flat and
index arrays is written; (2) a commit marker naming the entry range is created atomically
(write temp, fsync, ``os.link`` create-if-absent). Readers trust only committed ranges, so an
entry whose writer died between (1) and (2) is never visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAYOUT_VERSION = 1


@dataclass(frozen=True, eq=False)
class StoredSequence:
    """One stored entry: a single token sequence plus the keys the data layer indexes by.

    This is the on-disk schema and knows nothing of RL; ``astraflow.contracts.Trajectory``
    maps to and from it. Per-token arrays all have the same length.
    """

    task_id: str
    group_id: str
    #: position of this sequence within its trajectory, and how many the trajectory has.
    seq_index: int
    num_sequences: int
    tokens: np.ndarray  # int32
    loss_mask: np.ndarray  # bool or uint8
    logprobs: np.ndarray  # float32
    policy_ids: np.ndarray  # int16
    versions: np.ndarray  # int32
    reward: float
    finish_reason: str
    #: JSON text with everything else (policies, workflow, kind, attempt, provenance, rewards).
    meta: str


@dataclass(frozen=True)
class EntryRef:
    """Where one committed entry lives: segment name and entry index within the segment."""

    segment: str
    index: int


@dataclass(frozen=True)
class EntryInfo:
    """Index row of a committed entry: enough to route and filter without reading tokens."""

    ref: EntryRef
    task_id: str
    group_id: str
    seq_index: int
    num_sequences: int
    length: int
    reward: float
    min_version: int  # lowest version among generated tokens, -1 if none
    max_version: int
    meta: str


Cursor = dict  # segment name -> number of committed entries already seen
