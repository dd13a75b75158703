"""Config of the data layer: batches, leases, staleness and its dataflow rules."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from astraflow.configbase import Strict


class PolicySpec(Strict):
    """A dataflow policy chosen by registered name, with its own parameters."""

    type: str
    """Registered name of the policy class."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments of the policy."""


class DataflowConfig(Strict):
    """The data layer (owned by ``astraflow.dataflow``)."""

    batch_size: int = Field(default=64, ge=1)
    """Sequences per trainer batch (whole groups: a multiple of ``workload.group_size``)."""
    max_staleness: int = Field(default=2, ge=0)
    """Sequences generated more than this many versions before the consuming trainer
    version are dropped (counted in the ledger as ``stale``)."""
    lease_seconds: float = Field(default=30.0, gt=0)
    """A leased task that is not completed or renewed by a heartbeat within this time is
    requeued."""
    max_attempts: int = Field(default=3, ge=1)
    """A task failed or expired this many times ends as failed."""
    prefetch_groups: int = Field(default=4, ge=0)
    """Groups leased ahead of what the trainers need (bounds staleness and wasted work)."""
    curator: PolicySpec = PolicySpec(type="accept_all")
    """Prompt curator before rollout."""
    group_filter: PolicySpec = PolicySpec(type="keep_all")
    """Group filter after rollout."""
    ordering: PolicySpec = PolicySpec(type="fifo")
    """Buffer ordering (``fifo``, ``edf`` or ``freshest``)."""
    replay_ratio: float = Field(default=0.0, ge=0, lt=1)
    """Fraction of each batch filled with recently consumed samples (recorded as replays)."""
    lockstep: bool = False
    """Multi-policy: policies advance in lockstep (a version barrier) instead of independently."""
