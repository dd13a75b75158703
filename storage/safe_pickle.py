"""Unpickling files from the run directory without letting them run code.

``AllowlistUnpickler`` resolves only the globals it is given; the DCP metadata reader below and
the data layer's snapshot (``astraflow.dataflow.durable``) build on it.

Reading a DCP checkpoint's ``.metadata`` file (a pickle):

Why: the run directory lives on storage other users of a cluster may be able to write to, and
a plain ``pickle.load`` (what ``torch.distributed.checkpoint.FileSystemReader`` does) calls
whatever a forged file names. ``load_dcp_metadata`` unpickles with a ``find_class`` that
resolves only what the DCP writers (``dcp.save``, Megatron's ``dist_checkpointing``) put into
the file: DCP's metadata and save-plan dataclasses, ``torch.Size``, dtypes and layouts. Any
other reference raises ``UnsafeCheckpointError`` before anything is called. When the caller
knows the file's sha256 (a committed version's manifest), the bytes are checked first and the
same bytes are unpickled, so the file cannot be swapped between the check and the load.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path, PurePosixPath

#: the classes and functions a DCP ``.metadata`` may refer to, by module. Everything here only
#: builds plain records (dataclasses, enums, ``torch.Size``, paths); ``_get_layout`` looks a
#: layout up by name. Torch dtypes, layouts and memory formats are allowed separately.
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # Megatron's planner keeps the save plans in the metadata
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
    }),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
}


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something AstraFlow and torch never write (a reference to
    arbitrary code, or a checksum that does not match the manifest): it is refused unread."""


class AllowlistUnpickler(pickle.Unpickler):
    """Unpickles ``data`` resolving only the globals in ``allowed`` (module -> names); any other
    reference (a function to call, a class with a custom reduce) goes to ``refuse``, which
    raises. Persistent ids are refused too."""

    allowed: dict[str, frozenset[str]] = {}

    def __init__(self, data: bytes, source: Path | str, allowed: dict[str, frozenset[str]] | None = None):
        super().__init__(io.BytesIO(data))
        self._source = source
        if allowed is not None:
            self.allowed = allowed

    def find_class(self, module: str, name: str):
        if name in self.allowed.get(module, ()):
            return super().find_class(module, name)
        return self.refuse(module, name)

    def refuse(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{self._source} refers to {module}.{name}, which is not allowed here; "
                                     "nothing in it was run")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"{self._source} holds a persistent id; nothing in it was run")


class _MetadataUnpickler(AllowlistUnpickler):
    allowed = ALLOWED_GLOBALS

    def refuse(self, module: str, name: str):
        import torch

        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):  # constants, not callables
            return value
        raise UnsafeCheckpointError(
            f"{self._source} refers to {module}.{name}, which a checkpoint's metadata never contains: "
            "the file was not written by AstraFlow/torch (it may have been forged); nothing in it was run. "
            "Delete the version (or the whole checkpoint directory) and re-publish it"
        )

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self._source} holds a persistent id, which a checkpoint's metadata never "
                                    "does; delete the version and re-publish it")


def load_dcp_metadata(source: str | Path, *, sha256: str | None = None):
    """The ``Metadata`` in ``source`` (a DCP checkpoint's ``.metadata`` file), unpickled with
    only the classes DCP writes. ``sha256``: the file's checksum from the version's manifest,
    checked before unpickling. Raises ``UnsafeCheckpointError`` on a foreign class, a checksum
    mismatch, or a shard path that leaves the directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    source = Path(source)
    data = source.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise UnsafeCheckpointError(
            f"{source} does not match the sha256 of its version's manifest: it changed after the commit "
            "(it may have been forged) and was not unpickled. Delete the version and re-publish it"
        )
    try:
        metadata = _MetadataUnpickler(data, source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated or garbage: not a metadata file either
        raise UnsafeCheckpointError(f"{source} is not a readable DCP metadata file ({type(err).__name__}: {err}); "
                                    "delete the version and re-publish it") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data or {}, dict):
        raise UnsafeCheckpointError(f"{source} holds a {type(metadata).__name__}, not DCP metadata; "
                                    "delete the version and re-publish it")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            raise UnsafeCheckpointError(f"{source} names shard file {rel!r}, outside its checkpoint directory; "
                                        "delete the version and re-publish it")
    return metadata
