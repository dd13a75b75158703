"""Trajectory store, memory room: the in-process backend (``memory://<name>``).

Why it exists: tests and benchmarks need a store with the directory backend's semantics
(``backends.StoreBackend``) inside one process, without a disk. A run refuses it
(``storage.config``): its processes could not share it. Stores live in a
registry by name as long as the process; nothing is durable, so a flush round is a no-op.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from storage import paths
from storage.trajectories.chunks import Piece

_BUFFERS = default_buffer_prototype()


class _MemoryState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.layout: bytes | None = None
        self.zarr: dict[str, dict] = {}
        self.markers: dict[str, dict[int, bytes]] = {}
        self.logs: dict[str, bytearray] = {}


#: in-process stores by name (``memory://<name>``); lives as long as the process.
_MEMORY_STORES: dict[str, _MemoryState] = {}
_MEMORY_LOCK = threading.Lock()


class MemoryBackend:
    """An in-process store (``memory://<name>``): the same semantics within one process."""

    supports_multiprocess = False
    durable = False

    def __init__(self, name: str, state: _MemoryState):
        self.name = name
        self.state = state

    def describe(self) -> str:
        return f"memory://{self.name}"

    def read_layout(self) -> bytes | None:
        return self.state.layout

    def create_layout(self, data: bytes) -> None:
        with self.state.lock:
            if self.state.layout is None:
                self.state.layout = data

    def replace_layout(self, data: bytes) -> None:
        with self.state.lock:
            self.state.layout = data

    def list_segments(self) -> list[str]:
        with self.state.lock:
            return sorted(self.state.markers)

    def zarr_store(self, segment: str, read_only: bool) -> Any:
        with self.state.lock:
            d = self.state.zarr.setdefault(segment, {})
        return MemoryStore(store_dict=d, read_only=read_only)

    def prepare_segment(self, segment: str, log_end: int) -> None:
        with self.state.lock:
            self.state.markers.setdefault(segment, {})
            del self.state.logs.setdefault(segment, bytearray())[log_end:]

    def list_markers(self, segment: str) -> list[int]:
        with self.state.lock:
            return sorted(self.state.markers.get(segment, {}))

    def read_marker(self, segment: str, seqno: int) -> bytes | None:
        with self.state.lock:
            return self.state.markers.get(segment, {}).get(seqno)

    def read_log(self, segment: str, offset: int, size: int = -1) -> bytes:
        with self.state.lock:
            return bytes(self.state.logs.get(segment, b"")[offset:offset + size if size >= 0 else None])

    def append_log(self, segment: str, offset: int, record: bytes) -> Callable[[], None]:
        with self.state.lock:
            log = self.state.logs.setdefault(segment, bytearray())
            if len(log) != offset:
                raise FileExistsError(f"memory://{self.name} segment {segment}: commit log is not {offset} bytes long")
            log += record
        return _nothing_to_flush

    def write_chunks(self, segment: str, pieces: list[Piece], buf: memoryview) -> None:
        with self.state.lock:
            d = self.state.zarr.setdefault(segment, {})
            for key, chunk_bytes, offset, nbytes, at in pieces:
                old = d.get(key)
                chunk = old.as_numpy_array() if old is not None else None
                if chunk is None or not chunk.flags.writeable or len(chunk) != chunk_bytes:
                    # a chunk of its own, written in place from now on (as a file is)
                    fresh = np.zeros(chunk_bytes, np.uint8)
                    if chunk is not None:
                        fresh[:min(len(chunk), chunk_bytes)] = chunk[:chunk_bytes]
                    chunk = fresh
                    d[key] = _BUFFERS.buffer.from_array_like(chunk)
                chunk[offset:offset + nbytes] = np.frombuffer(buf[at:at + nbytes], np.uint8)

    def read_chunks(self, segment: str, pieces: list[Piece], buf: memoryview) -> None:
        with self.state.lock:
            d = self.state.zarr.get(segment, {})
            for key, chunk_bytes, offset, nbytes, at in pieces:
                old = d.get(key)
                buf[at:at + nbytes] = old.as_numpy_array()[offset:offset + nbytes] if old is not None else bytes(nbytes)

    def metadata_changed(self, segment: str, key: str) -> None:
        return None

    def sync_metadata(self, segment: str, key: str) -> None:
        return None

    def release_segment(self, segment: str) -> None:
        return None

    def delete_segment(self, segment: str) -> None:
        with self.state.lock:
            for held in (self.state.zarr, self.state.markers, self.state.logs):
                held.pop(segment, None)

    def read_metadata(self, segment: str, key: str) -> bytes | None:
        with self.state.lock:
            buf = self.state.zarr.get(segment, {}).get(key)
        return None if buf is None else buf.to_bytes()


def open_memory_backend(name: str, mode: str) -> MemoryBackend:
    """The in-process store ``name``; ``mode="a"`` creates it when absent, ``mode="r"`` refuses a
    store that does not exist."""
    paths.check_name("memory store", name)
    with _MEMORY_LOCK:
        state = _MEMORY_STORES.get(name)
        if state is None and mode == "a":
            state = _MEMORY_STORES[name] = _MemoryState()
    if state is None:
        raise FileNotFoundError(
            f"no in-process trajectory store 'memory://{name}': open it with mode='a' first (memory "
            "stores exist only inside the process that created them)"
        )
    return MemoryBackend(name, state)


def _nothing_to_flush() -> None:
    """The flush round of a store that is not durable."""
