"""Reading a DCP checkpoint directory (a weight version) into one state dict, in one process.

The weight store (``storage.weights``) writes and commits versions; this module reads the
tensors of one, whatever number of ranks wrote it: straight from the files' bytes when every
item is a whole tensor saved by ``publish``, through ``torch.distributed.checkpoint`` otherwise.
The ``.metadata`` pickle is read by ``storage.safe_pickle`` (only DCP's own classes), never by
DCP's ``FileSystemReader.read_metadata``, which would run whatever a forged file names.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

from storage.full_disk import full_disk_in
from storage.safe_pickle import load_dcp_metadata

#: the file every DCP checkpoint directory holds.
DCP_METADATA = ".metadata"


class CheckpointReadError(RuntimeError):
    """A ``dcp.load`` that failed, as an ``Exception``: DCP's ``CheckpointException`` is a
    ``BaseException``, which a Dask actor call does not send back (its caller sees only the
    worker's connection dropped) and ``except Exception`` does not catch. ``failures``: DCP's,
    each rank's error and its frames; not sent across processes (the message says what failed)."""

    def __init__(self, message: str, failures: dict | None = None):
        super().__init__(message)
        self.failures = failures or {}

    def __reduce__(self):  # the message alone: a rank's exception may not unpickle, and its frames weigh
        return type(self), (str(self),)


def quiet_dcp_logger() -> None:
    """DCP's own logger sits at DEBUG behind a NullHandler: every save builds log records that
    nobody sees, which costs time on a small publish. Raise it to WARNING."""
    import logging

    logger = logging.getLogger("c10d-NullHandler-dcp_logger")
    if logger.level < logging.WARNING:
        logger.setLevel(logging.WARNING)


def read_metadata(path: str | Path, *, sha256: str | None = None):
    """The DCP ``Metadata`` of checkpoint directory ``path``, read safely (``load_dcp_metadata``;
    ``sha256``: the manifest's checksum of the ``.metadata`` file, checked before unpickling)."""
    return load_dcp_metadata(Path(path) / DCP_METADATA, sha256=sha256)


def _reader(path: Path, metadata):
    """A ``FileSystemReader`` for ``path`` that hands DCP the already (safely) read metadata
    instead of unpickling the file itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _PreparsedReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _PreparsedReader(path)


def read_checkpoint(path: str | Path, *, whole_tensors: bool = False, metadata_sha256: str | None = None) -> dict:
    """Every tensor of a DCP checkpoint directory (a version directory) at its global shape, on
    CPU, in this process: no process group, whatever number of ranks wrote it. Non-tensor
    entries (Megatron's ``_extra_state`` byte blobs) are skipped.

    ``whole_tensors`` (the version's manifest says so: written by ``publish``): take the
    tensors straight from the file's bytes, which saves unpickling every tensor; any other
    layout, or anything unexpected in the file, goes through ``dcp.load``. Takes no hold: to
    read a committed version that retention may delete, use ``WeightStore.load``.
    ``metadata_sha256``: the manifest's checksum of ``.metadata``; a mismatch, or a class DCP
    never writes, raises ``UnsafeCheckpointError`` before anything in the file is called."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not (path / DCP_METADATA).is_file():
        raise ValueError(f"{path} is not a DCP checkpoint (no {DCP_METADATA}): pass a committed version directory")
    metadata = read_metadata(path, sha256=metadata_sha256)
    if whole_tensors:
        state = _read_whole_tensors(path, metadata)
        if state is not None:
            return state
    state = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    _dcp_load(state, path, metadata)
    return state


def iter_checkpoint(path: str | Path, *, metadata_sha256: str | None = None) -> Iterator[tuple[str, Any]]:
    """``read_checkpoint``'s tensors one at a time, ``(name, tensor)``, each read when asked for:
    a reader that is done with one before the next holds one tensor's memory, not the version's."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    metadata = read_metadata(path, sha256=metadata_sha256)
    for name, m in metadata.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):  # not Megatron's byte blobs
            one = {name: torch.empty(tuple(m.size), dtype=m.properties.dtype)}
            _dcp_load(one, path, metadata)
            yield name, one.pop(name)


def _dcp_load(state: dict, path: Path, metadata) -> None:
    """``dcp.load`` of ``state``'s tensors from checkpoint directory ``path``, in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    quiet_dcp_logger()
    with warnings.catch_warnings():  # a single-process load is the intent; DCP warns about it
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=_reader(path, metadata), no_dist=True)
        except CheckpointException as err:
            failures = err.failures or {}
            cause = next((f[0] if isinstance(f, tuple) else f for f in failures.values()), err)
            why = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            raise CheckpointReadError(f"reading the checkpoint {path} failed ({why}); a file of it may be damaged "
                                      "or cut short", failures) from None


def _read_fully(path: Path, buf: bytearray) -> bool:
    """Fill ``buf`` from the start of ``path``: one read returns at most ~2 GiB on Linux, so it
    takes as many as it needs. False: the file ended first (it shrank meanwhile)."""
    view, got = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                return False
            got += n
    return True


def _read_whole_tensors(vdir: Path, metadata) -> dict | None:
    """The tensors of a DCP checkpoint whose items are whole tensors saved with ``torch.save``
    (an uncompressed zip per item, its one storage record holding exactly the tensor's bytes),
    read as views of each file's bytes; ``None`` when anything differs from that layout."""
    import io
    import zipfile

    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = metadata.state_dict_metadata
    if not all(isinstance(m, TensorStorageMetadata) and len(m.chunks) == 1
               and tuple(m.chunks[0].sizes) == tuple(m.size) and not any(m.chunks[0].offsets)
               for m in tensors.values()):
        return None
    files: dict[str, bytearray] = {}
    state = {}
    for index, info in metadata.storage_data.items():
        meta = tensors.get(index.fqn)
        if meta is None or info.transform_descriptors:
            return None
        buf = files.get(info.relative_path)
        if buf is None:
            path = vdir / info.relative_path
            buf = files[info.relative_path] = bytearray(path.stat().st_size)
            if not _read_fully(path, buf):
                return None
        item = memoryview(buf)[info.offset : info.offset + info.length]
        try:
            with zipfile.ZipFile(io.BytesIO(item)) as z:
                records = [r for r in z.infolist() if r.filename.rsplit("/", 2)[-2:-1] == ["data"]]
        except zipfile.BadZipFile:
            return None
        dtype = meta.properties.dtype
        numel = 1
        for n in meta.size:
            numel *= n
        if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or \
                records[0].file_size != numel * dtype.itemsize:
            return None
        header = item[records[0].header_offset : records[0].header_offset + 30]
        start = (info.offset + records[0].header_offset + 30
                 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little"))
        state[index.fqn] = (torch.frombuffer(buf, dtype=dtype, count=numel, offset=start).view(tuple(meta.size))
                            if numel else torch.empty(tuple(meta.size), dtype=dtype))
    return state if len(state) == len(tensors) else None


def save_failure(err: BaseException, what: str, where: Path, full: bool) -> Exception:
    """The ``Exception`` to raise for a ``dcp.save`` into ``where`` that failed with ``err``
    (DCP's ``CheckpointException``, a ``BaseException``, carries each rank's error): an
    ``OSError`` for a write the system refused, else a ``RuntimeError`` naming the rank's error.
    A full disk, quota or file-size limit is found anywhere in the chain (torch's zip writer
    raises its own error with the ``OSError`` as its context); with none there, ENOSPC when
    ``full`` (the caller saw no room left)."""
    cause = err
    for failure in (getattr(err, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, BaseException):
            cause = exc
            break
    refused = full_disk_in(err)
    if refused is not None:
        cause = refused
    elif not isinstance(cause, OSError) and full:
        cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if isinstance(cause, OSError):
        return OSError(cause.errno, f"{what} failed: {cause.strerror or cause}", cause.filename or str(where))
    return RuntimeError(f"{what} into {where} failed: {type(cause).__name__}: {cause}")
