"""Config of the run's storage: where trajectories go, how many weight versions are kept, deltas."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StorageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    trajectories: str | None = None
    """Trajectory store: a directory (or ``file://`` URL) every node, the data layer and the
    trainers reach; default ``<run>/trajectories``. A relative directory is made absolute when
    the config loads (against the directory ``astraflow`` runs in), as model paths are."""
    keep_trajectories: bool = True
    """Keep every trajectory for the run's life (the run's record: the episode viewer shows
    them all). False: a segment is deleted once no node writes to it and the data layer holds
    none of its rows (each node moves to a new segment every ``rollout.segment_max_entries``
    stored sequences), so the store stays about as large as what is in flight, not the whole
    run. Only with the run's own store (``trajectories`` left out)."""
    keep_versions: int = Field(default=3, ge=1)
    """Weight versions kept per policy (held versions are never deleted)."""
    deltas: bool = False
    """Write a sparse bf16 delta ``v-1 -> v`` after every commit (off the training critical
    path) and let RaaS nodes that are one version behind apply it instead of loading full
    shards. Nodes then serve the bf16 view of the weights (as GPU engines do), so trainers
    publish bf16 versions (``publish_dtype: auto``; ``fp32`` is refused): a version's committed
    weights are the ones its tokens were sampled with."""

    @field_validator("trajectories")
    @classmethod
    def _shared(cls, url: str | None) -> str | None:
        if url is not None and url.startswith("memory://"):
            raise ValueError(f"{url} is a store inside one process, and a run's nodes, data layer and trainers "
                             "are processes of their own: point storage.trajectories at a directory they all "
                             "reach, or leave it out (<run>/trajectories)")
        return url

    @model_validator(mode="after")
    def _own_store(self) -> "StorageConfig":
        if not self.keep_trajectories and self.trajectories is not None:
            raise ValueError(f"keep_trajectories: false deletes the segments of the run's own store, and "
                             f"storage.trajectories {self.trajectories} may hold other runs' segments: leave "
                             "storage.trajectories out (<run>/trajectories) or keep the trajectories")
        return self
