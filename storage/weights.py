"""Weight store: versioned checkpoint shards per policy, committed atomically.

(API skeleton: the storage implementation fills in the bodies.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class WeightVersion:
    """A committed weight version. Written by the weight store at commit; read by RaaS nodes
    (which version to pull, full or delta) and by the data layer (staleness).
    """

    policy: str
    version: int
    #: absolute path of the version's manifest.json.
    manifest_path: str
    #: full shards are on disk (False only once retention removed them but a delta remains).
    has_full: bool = True
    #: the version a sparse delta to this one starts from, ``None`` if no delta was written.
    delta_from: int | None = None
    #: sha256 of every shard file, by file name relative to the version directory.
    checksums: Mapping[str, str] = field(default_factory=dict)
    #: ``time.time()`` of the commit.
    committed_at: float = 0.0
