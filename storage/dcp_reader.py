"""Read a committed ``torch.distributed.checkpoint`` (DCP) directory in any process.

Megatron-core's ``torch_dist`` checkpoints are plain DCP directories (``.metadata`` plus
``__<rank>_<i>.distcp`` files). A reader — a RaaS node, a benchmark, a test — needs neither
Megatron nor a process group to load them, whatever world size wrote them: read the metadata,
allocate every tensor at its global shape, let ``dcp.load`` fill it (no process group means
DCP runs in single-process mode). Non-tensor entries (Megatron's ``_extra_state`` byte blobs)
are skipped; their names are reported so that a caller can check nothing it needs was skipped.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata


def dcp_tensor_shapes(path: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global shape and dtype of every tensor in a DCP directory (reads only the metadata)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a DCP checkpoint (no .metadata): pass a committed version directory")
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {
        k: (v.size, v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def read_dcp(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory at its global (unsharded) shape, on CPU.

    ``dtype`` casts after loading (None keeps the stored dtype).
    """
    shapes = dcp_tensor_shapes(path)
    sd = {k: torch.empty(size, dtype=dt) for k, (size, dt) in shapes.items()}
    with warnings.catch_warnings():
        # single-process load is the intent here; DCP warns about it even with no_dist=True
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return sd


def skipped_entries(path: str | Path) -> list[str]:
    """Names of the non-tensor entries ``read_dcp`` does not return."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return sorted(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
