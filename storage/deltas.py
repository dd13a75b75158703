"""Sparse bf16 deltas between consecutive weight versions.

Why: a remote or cross-region RaaS node that holds version ``v-1`` should not pull every shard
of ``v``. At RL learning rates (1e-6..5e-6) only a fraction of the bf16 elements change from one
optimiser step to the next, so sending only the changed elements (where, and by how much) is
far smaller than the full bf16 weights.

Format of a delta directory (``storage.paths.delta_dir(root, policy, v-1, v)``), format 2::

    delta.safetensors   for each tensor <name> with changed elements, in chunks k = 0, 1, ...:
                        "<name>/gap/<k>"  the gaps between consecutive changed flat indices
                                          (uint32; uint64 for tensors of >= 2**32 elements)
                        "<name>/dif/<k>"  new minus old bf16 bit pattern, as int16 (wrapping)
                        each compressed with Blosc (bit-shuffle + zstd) and stored as uint8
    delta.json          format, tensor shapes, changed counts, sha256 of the base and of the result
                        (bf16 bits), sha256 of delta.safetensors, stats (density, delta vs full bytes)
    COMMITTED           written last; a directory without it is not a delta

Why this encoding: at RL learning rates an element that changes moves by one or two bf16 units
in the last place and the changed elements are a small share, spread evenly. Raw (int32 index,
bf16 value) pairs cost 6 bytes per changed element against 2 per element for the full weights,
which caps the saving at a third of the inverse density; gaps (small numbers) and bit
differences (almost all +-1) are nearly constant in their high bits, which bit-shuffling lines
up for zstd: a fraction of the raw pairs' bytes per changed element
(``benchmarks/weight_sync.py`` measures it).

Everything is compared and reconstructed on the **bf16 bit patterns** (``x.to(bfloat16)``), so
``apply_delta(bf16(v-1), delta) == bf16(v)`` bit for bit; the reader keeps its weights as bf16.
Versions published in bf16 (the trainer's ``publish_dtype``) are taken as they are: the same
delta, whichever dtype the versions were published in.
The directory is written under a temporary name, fsynced, renamed into place, then marked.

This module is part of ``storage`` and imports nothing from ``astraflow``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Mapping

import numpy as np
import torch
from numcodecs import Blosc
from safetensors.torch import load_file, save_file

from storage import paths
from storage.atomic import fsync_path, write_atomically

FORMAT = 2
#: elements per compressed chunk (Blosc buffers stay far below its 2 GiB limit)
CHUNK = 1 << 26
_CODEC = Blosc(cname="zstd", clevel=3, shuffle=Blosc.BITSHUFFLE)
DATA_FILE = "delta.safetensors"
META_FILE = "delta.json"
MARKER = "COMMITTED"


class DeltaMismatchError(RuntimeError):
    """A delta does not fit: its base is not the weights it is applied to, its file is corrupt,
    or the result's checksum differs from the writer's. The reader must pull full weights."""


@dataclass(frozen=True)
class DeltaStats:
    """What a delta costs. Written by ``write_delta`` (also stored in delta.json)."""

    #: number of tensors and of elements over all tensors.
    tensors: int
    elements: int
    #: elements whose bf16 bits changed.
    changed: int
    #: changed / elements.
    density: float
    #: compressed bytes of the delta payload (gaps + differences) and bytes of the full bf16 weights.
    delta_bytes: int
    full_bytes: int

    @property
    def compression(self) -> float:
        """full_bytes / delta_bytes (inf for an empty delta)."""
        return self.full_bytes / self.delta_bytes if self.delta_bytes else float("inf")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).reshape(-1)


def bf16_checksum(sd: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, shapes and bf16 bit patterns of a state dict (name order)."""
    h = hashlib.sha256()
    for name in sorted(sd):
        h.update(name.encode())
        h.update(repr(tuple(sd[name].shape)).encode())
        h.update(_bits(sd[name]).numpy().tobytes())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_delta(prev_sd: Mapping[str, torch.Tensor], new_sd: Mapping[str, torch.Tensor],
                out_dir: str | Path) -> DeltaStats:
    """Write the sparse bf16 delta ``prev_sd -> new_sd`` into ``out_dir`` atomically.

    ``out_dir`` should come from ``storage.paths.delta_dir`` (see ``write_version_delta``) and must
    not exist yet. Both state dicts must have the same names and shapes.
    """
    out_dir = Path(out_dir)
    if set(prev_sd) != set(new_sd):
        raise ValueError(
            "a delta needs the same tensor names in both versions: missing "
            f"{sorted(set(prev_sd) - set(new_sd))[:5]}, new {sorted(set(new_sd) - set(prev_sd))[:5]}; "
            "publish full weights instead"
        )
    if out_dir.exists():
        raise FileExistsError(f"delta {out_dir} already exists (deltas are written once)")
    payload: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    elements = changed = delta_bytes = 0
    for name in sorted(new_sd):
        if prev_sd[name].shape != new_sd[name].shape:
            raise ValueError(f"{name}: shape {tuple(prev_sd[name].shape)} -> {tuple(new_sd[name].shape)}; "
                             "a delta needs equal shapes, publish full weights instead")
        p, n = _bits(prev_sd[name]).numpy(), _bits(new_sd[name]).numpy()
        idx = np.flatnonzero(p != n)
        gaps = np.diff(idx, prepend=-1).astype(np.uint32 if n.size < 2**32 else np.uint64)
        dif = n[idx] - p[idx]  # int16 arithmetic wraps: old + dif == new again on the reader
        for k, start in enumerate(range(0, idx.size, CHUNK)):
            for key, arr in (("gap", gaps), ("dif", dif)):
                blob = _CODEC.encode(np.ascontiguousarray(arr[start:start + CHUNK]))
                payload[f"{name}/{key}/{k}"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                delta_bytes += len(blob)
        shapes[name] = list(new_sd[name].shape)
        counts[name] = int(idx.size)
        elements += n.size
        changed += idx.size
    stats = DeltaStats(tensors=len(shapes), elements=elements, changed=changed,
                       density=changed / max(elements, 1), delta_bytes=delta_bytes,
                       full_bytes=2 * elements)
    tmp = paths.tmp_sibling(out_dir)
    tmp.mkdir(parents=True)
    save_file(payload, str(tmp / DATA_FILE))
    meta = {
        "format": FORMAT,
        "shapes": shapes,
        "changed": counts,
        "base_sha256": bf16_checksum(prev_sd),
        "result_sha256": bf16_checksum(new_sd),
        "data_sha256": _file_sha256(tmp / DATA_FILE),
        "stats": asdict(stats),
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    for f in (DATA_FILE, META_FILE):
        fsync_path(tmp / f)
    os.rename(tmp, out_dir)
    write_atomically(out_dir / MARKER, meta["result_sha256"])  # fsyncs the marker, then out_dir
    return stats


def write_version_delta(weights_root: str | Path, policy: str, from_version: int, to_version: int,
                        prev_sd: Mapping[str, torch.Tensor], new_sd: Mapping[str, torch.Tensor]) -> DeltaStats:
    """``write_delta`` into the store's layout (``storage.paths.delta_dir``)."""
    if to_version != from_version + 1:
        raise ValueError(f"deltas join consecutive versions, got {from_version} -> {to_version}")
    return write_delta(prev_sd, new_sd, paths.delta_dir(Path(weights_root), policy, from_version, to_version))


def is_committed(delta_dir: str | Path) -> bool:
    return (Path(delta_dir) / MARKER).is_file()


def read_stats(delta_dir: str | Path) -> DeltaStats:
    return DeltaStats(**json.loads((Path(delta_dir) / META_FILE).read_text())["stats"])


def apply_delta(prev_sd: Mapping[str, torch.Tensor], delta_dir: str | Path,
                verify_base: bool = True) -> dict[str, torch.Tensor]:
    """bf16 weights of the new version: ``prev_sd`` (cast to bf16) with the delta applied.

    Raises ``DeltaMismatchError`` if the delta file is corrupt, ``prev_sd`` is not the version
    the delta starts from (``verify_base``), or the result differs from the writer's checksum.
    """
    delta_dir = Path(delta_dir)
    if not is_committed(delta_dir):
        raise ValueError(f"{delta_dir} has no {MARKER} marker: the delta is not committed; pull full weights")
    meta = json.loads((delta_dir / META_FILE).read_text())
    if meta["format"] != FORMAT:
        raise DeltaMismatchError(f"delta format {meta['format']} is not the one this reader knows ({FORMAT}); "
                                 "pull full weights")
    if _file_sha256(delta_dir / DATA_FILE) != meta["data_sha256"]:
        raise DeltaMismatchError(f"{delta_dir / DATA_FILE} does not match its checksum (corrupt or partial)")
    if set(prev_sd) != set(meta["shapes"]):
        raise DeltaMismatchError("the held weights have different tensor names than the delta's base")
    if verify_base and bf16_checksum(prev_sd) != meta["base_sha256"]:
        raise DeltaMismatchError("the held weights are not the version this delta starts from")
    payload = load_file(str(delta_dir / DATA_FILE))
    out: dict[str, torch.Tensor] = {}
    for name, shape in meta["shapes"].items():
        flat = _bits(prev_sd[name]).clone()
        _apply_chunks(flat.numpy(), payload, name, meta["changed"][name])
        out[name] = flat.view(torch.bfloat16).reshape(shape)
    if bf16_checksum(out) != meta["result_sha256"]:
        raise DeltaMismatchError("the weights rebuilt from the delta do not match the writer's checksum")
    return out


def _apply_chunks(flat: np.ndarray, payload: Mapping[str, torch.Tensor], name: str, count: int) -> None:
    """Add the bit differences of tensor ``name`` into ``flat`` (int16 bits, in place)."""
    last, seen = -1, 0
    for k in range((count + CHUNK - 1) // CHUNK):
        gap_dtype = np.uint32 if flat.size < 2**32 else np.uint64
        gaps = np.frombuffer(_CODEC.decode(payload[f"{name}/gap/{k}"].numpy()), dtype=gap_dtype)
        dif = np.frombuffer(_CODEC.decode(payload[f"{name}/dif/{k}"].numpy()), dtype=np.int16)
        if gaps.size != dif.size:
            raise DeltaMismatchError(f"{name}: chunk {k} has {gaps.size} indices but {dif.size} values")
        idx = last + np.cumsum(gaps, dtype=np.int64)
        if idx.size and idx[-1] >= flat.size:
            raise DeltaMismatchError(f"{name}: index {idx[-1]} is outside a tensor of {flat.size} elements")
        flat[idx] += dif  # wraps like the writer's subtraction
        last = int(idx[-1]) if idx.size else last
        seen += idx.size
    if seen != count:
        raise DeltaMismatchError(f"{name}: the delta holds {seen} changed elements, its metadata says {count}")


SyncKind = Literal["full", "delta"]


def choose_sync(held_version: int | None, latest: int, full_resync_every: int,
                delta_available: bool) -> SyncKind:
    """How a reader holding ``held_version`` catches up to ``latest``.

    ``"delta"`` only when the reader is exactly one version behind, the delta ``held -> latest``
    is committed, and ``latest`` is not a periodic full-resync version (a multiple of
    ``full_resync_every``; 0 disables periodic resyncs). Everything else is ``"full"``.
    """
    if full_resync_every < 0:
        raise ValueError(f"full_resync_every must be >= 0 (0 = never), got {full_resync_every}")
    if held_version is not None and held_version >= latest:
        raise ValueError(f"reader holds v{held_version}, latest is v{latest}: nothing to sync")
    if held_version is None or latest - held_version != 1 or not delta_available:
        return "full"
    if full_resync_every and latest % full_resync_every == 0:
        return "full"
    return "delta"
