"""The records of a training batch, as the data layer serves it (``BatchRefs`` of ``RowRef``:
rows named in the trajectory store) and as the trainer trains on it (``Batch`` of ``BatchItem``:
the rows read back). Contracts between components, like ``astraflow.contracts``; the wire
format of both is ``astraflow.transport``'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from astraflow.contracts import Sequence
from storage.trajectories import EntryRef


def group_stats(rewards) -> tuple[float, float]:
    """The mean and standard deviation of a group's rewards, as the data layer stamps them at
    ingest. A group scored alike gets its reward and 0 exactly (``np.mean`` of 0.1s is not 0.1),
    so each of its advantages is exactly 0 (a step skips such rows)."""
    if np.ptp(rewards) == 0:
        return float(rewards[0]), 0.0
    return float(np.mean(rewards)), float(np.std(rewards))


def grpo_advantage(reward: float, group_mean: float, group_std: float) -> float:
    """GRPO advantage: ``reward`` normalised within its group (a group of equal rewards: 0)."""
    return (reward - group_mean) / (group_std + 1e-6)


@dataclass(frozen=True, eq=False)
class BatchItem:
    """One training sequence for one policy, as the trainer consumes it.

    Made from a ``RowRef`` and its stored row on the trainer's side, read by the trainer's
    loss. ``loss_mask`` is already restricted to the tokens of the batch's policy.
    """

    sequence: Sequence
    loss_mask: np.ndarray
    #: group statistics of ``sequence.reward`` over the group for this policy, stamped at ingest.
    group_mean: float
    group_std: float
    group_size: int
    #: the trainer version the batch was served to minus the oldest version among the tokens
    #: this policy generated in the sequence (``Item.oldest_version`` in the data layer).
    staleness: int
    task_id: str
    #: True when a replay policy reused an already-consumed sample on purpose.
    replayed: bool = False

    @property
    def advantage(self) -> float:
        """GRPO advantage: the reward normalised within its group."""
        return grpo_advantage(self.sequence.reward, self.group_mean, self.group_std)


@dataclass(frozen=True, eq=False)
class Batch:
    """A fixed-size batch of sequences for one policy, as its trainer trains on it: made on
    the trainer's side from the data layer's ``BatchRefs`` (``astraflow.training.rows``)."""

    policy: str
    #: the trainer version that asked for it (staleness is measured against it).
    version: int
    items: tuple[BatchItem, ...]
    #: data-layer metrics at batch time (counts, staleness histogram, wait time).
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class RowRef:
    """One training sequence of a served batch, by reference: where its row lives in the
    trajectory store and what only the data layer knows of it. Written by the data layer's
    ``next_batch``; the trainer reads the row and makes the ``BatchItem`` (same fields)."""

    ref: EntryRef
    task_id: str
    #: ``Sequence.reward`` of the stored row (known from the node's ``SequenceSummary``)
    reward: float
    group_mean: float
    group_std: float
    group_size: int
    staleness: int
    replayed: bool = False

    @property
    def advantage(self) -> float:
        """``BatchItem.advantage`` of the row it names."""
        return grpo_advantage(self.reward, self.group_mean, self.group_std)


@dataclass(frozen=True, eq=False)
class BatchRefs:
    """A ``Batch`` by reference: the rows to train on, named, without their token arrays.
    Written by the data layer's ``next_batch``; the trainer's side reads the rows from the
    trajectory store (``astraflow.training.rows``) and trains on the ``Batch`` they make."""

    policy: str
    version: int
    items: tuple[RowRef, ...]
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)
