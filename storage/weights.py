"""Weight store: versioned checkpoint shards per policy, committed atomically.

Why it exists: trainers publish weights and RaaS nodes pull them without talking to each
other. The store is a directory on shared storage (``paths.policy_dir``); a version is a plain
``torch.distributed.checkpoint`` (DCP) directory, as written by Megatron's ``torch_dist``
format or by ``dcp.save``, plus our own manifest and commit marker.

Publish protocol (invariant: a reader never sees a partial version)
-------------------------------------------------------------------
1. Any number of ranks write their DCP shards into ``staging(policy, v)`` (never read).
2. After all ranks finished, one process calls ``commit``: it computes the manifest (tensor
   names, shapes and dtypes from the DCP metadata; size and sha256 of every file), fsyncs every
   file, writes ``manifest.json``, renames the staging directory to ``v<N>`` and writes the
   ``COMMITTED`` marker last (temp, fsync, rename). A version directory without ``COMMITTED``
   does not exist for readers (``latest``, ``versions``, ``get``, ``load``).
3. Retention keeps the newest ``keep_last`` committed versions and never deletes a version a
   reader holds (``hold``). To retire a version it first renames ``COMMITTED`` away (the version
   disappears for new readers), re-checks the holds, and only then deletes the directory.

Overlap invariant (publish vs. pull): a reader holds a version for as long as it reads it
(``load`` does so itself). A hold is a file with the reader's pid and host under
``paths.readers_dir`` (``storage/holds.py``); a hold of a dead pid on this host is stale and
ignored, a hold from another host counts until its owner removes it or it times out. A reader
takes the hold and then checks that the version is still committed, so retention and a new
reader cannot both win.

Sparse bf16 deltas between consecutive versions live under ``paths.delta_dir`` and are written
by the delta writer; this module reports them (``WeightVersion.delta_from``: the highest
``from`` version with a committed delta, i.e. a delta directory holding a ``COMMITTED`` file)
and deletes those no reader can use any more (``_prune_deltas``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from storage import holds, paths
from storage.atomic import fsync_path, write_atomically
from storage.checkpoint import (DCP_METADATA, iter_checkpoint, quiet_dcp_logger, read_checkpoint, read_metadata,
                                save_failure)
from storage.full_disk import full_disk_in

MANIFEST_FORMAT = "astraflow-weights-v1"
_RETIRING = "COMMITTED.retiring"


@dataclass(frozen=True)
class WeightVersion:
    """A committed weight version. Written by the weight store at commit; read by RaaS nodes
    (which version to pull, full or delta), trainers that resume and ``astraflow export``.
    """

    policy: str
    version: int
    #: absolute path of the version's manifest.json.
    manifest_path: str
    #: the version a sparse delta to this one starts from, ``None`` if no delta was written.
    delta_from: int | None = None
    #: sha256 of every shard file, by file name relative to the version directory.
    checksums: Mapping[str, str] = field(default_factory=dict)
    #: ``time.time()`` of the commit.
    committed_at: float = 0.0

    @property
    def path(self) -> str:
        """The version directory (a plain DCP checkpoint directory)."""
        return str(Path(self.manifest_path).parent)


class VersionNotCommitted(KeyError):
    """The asked-for version is not committed (never was, not yet, or retired by retention)."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the message as written
        return str(self.args[0]) if self.args else ""


class ChecksumMismatch(RuntimeError):
    """A file of a committed version no longer matches the manifest's sha256."""


class DamagedVersion(ValueError):
    """A committed version whose manifest cannot be read or does not match the sha256 its commit
    marker records; the message names the file and how to go on from the version before it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _metadata_sha256(manifest: dict, policy: str, version: int) -> str:
    """The manifest's sha256 of the version's ``.metadata`` (checked before it is unpickled)."""
    rec = manifest.get("files", {}).get(DCP_METADATA)
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str):
        raise ChecksumMismatch(f"{policy} v{version}: the manifest has no sha256 of {DCP_METADATA}, so it cannot "
                               "be read safely; delete the version and re-publish it")
    return rec["sha256"]


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not paths.is_tmp(p.name))


class WeightStore:
    """Versioned weights of every policy under one root directory (shared storage)."""

    def __init__(self, root: str | Path, keep_last: int = 3, hold_timeout_s: float = 3600.0):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the latest version is always kept), got {keep_last}")
        self.root = Path(root).absolute()
        self.keep_last = keep_last
        #: a hold older than this is a dead reader's (a pull or load is far shorter); on another
        #: host its pid cannot be checked, and a killed reader never removes its hold
        self.hold_timeout_s = hold_timeout_s
        self._host = socket.gethostname()

    # -- writing -----------------------------------------------------------------------------
    def staging(self, policy: str, version: int) -> Path:
        """Directory where any number of ranks write the DCP shards of ``version``. Created if
        absent; never cleared here (ranks may be writing). Readers never look at it."""
        d = paths.staging_dir(self.root, policy, self._check_version(version))
        d.mkdir(parents=True, exist_ok=True)
        return d

    def discard_staging(self, policy: str, version: int) -> None:
        """Remove a staging directory (e.g. left by a crashed publish). Call from one process."""
        stage = paths.staging_dir(self.root, policy, self._check_version(version))
        if stage.exists():
            shutil.rmtree(stage)

    def discard_uncommitted(self, policy: str) -> list[int]:
        """Remove what a dead publisher left: staging directories and every version directory
        without ``COMMITTED``: a commit that died between its rename and its marker, or a version
        retention had begun to delete (it renames the marker away first, so a directory it left
        half-removed has none either); and its unfinished deltas (``_prune_deltas``). Only when no
        publisher of the policy is alive (before a replacement trainer starts, or a resumed run's
        trainers). Returns the versions removed."""
        staged = paths.staging_root(self.root, policy)
        found = [(d, int(m.group(1))) for root in (staged, paths.policy_dir(self.root, policy)) if root.is_dir()
                 for d in root.iterdir() if (m := paths.VERSION_DIR_RE.match(d.name))]
        gone = [(d, v) for d, v in found if d.parent == staged or not (d / "COMMITTED").exists()]
        for d, _ in gone:
            shutil.rmtree(d, ignore_errors=True)
        self._prune_deltas(policy, writer_alive=False)
        return sorted({v for _, v in gone})

    def commit(self, policy: str, version: int, meta: dict | None = None, *,
               whole_tensors: bool = False) -> WeightVersion:
        """Publish what the ranks wrote into ``staging(policy, version)``; call once, after all
        ranks finished. Returns the committed version; then applies retention.
        ``whole_tensors``: the checkpoint holds every tensor whole and contiguous, saved by one
        ``dcp.save`` (``publish`` does so); readers may then take the bytes directly."""
        version = self._check_version(version)
        stage = paths.staging_dir(self.root, policy, version)
        final = paths.version_dir(self.root, policy, version)
        if paths.commit_file(self.root, policy, version).exists():
            raise ValueError(
                f"{policy} v{version} is already committed and versions are immutable: publish a new "
                "version number"
            )
        if not (stage / DCP_METADATA).exists():
            raise ValueError(
                f"nothing to commit for {policy} v{version}: {stage} has no DCP checkpoint "
                f"({DCP_METADATA} missing); save the shards into store.staging({policy!r}, {version}) "
                "on every rank first (dcp.save / Megatron dist_checkpointing)"
            )
        if meta is not None:
            json.dumps(meta)  # must be JSON: fail here, not after the rename
        tensors = self._tensor_table(stage)
        files = {}
        for f in _files(stage):
            fsync_path(f)
            files[f.relative_to(stage).as_posix()] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
        for d in sorted({f.parent for f in _files(stage)} | {stage}, reverse=True):
            fsync_path(d)
        committed_at = time.time()
        manifest = {
            "format": MANIFEST_FORMAT,
            "policy": policy,
            "version": version,
            "checkpoint": "torch_dcp",
            "tensors": tensors,
            "files": files,
            "meta": meta or {},
            "whole_tensors": bool(whole_tensors),
            "committed_at": committed_at,
        }
        write_atomically(stage / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
        if final.exists():  # a previous commit died between rename and COMMITTED
            shutil.rmtree(final)
        os.rename(stage, final)
        fsync_path(final.parent)
        fsync_path(stage.parent)
        write_atomically(
            paths.commit_file(self.root, policy, version),
            json.dumps({"committed_at": committed_at, "manifest_sha256": _sha256(final / "manifest.json")}).encode(),
        )
        self.apply_retention(policy)
        return self._version_record(policy, version, manifest)

    def publish(self, policy: str, version: int, state_dict: dict, meta: dict | None = None,
                *, thread_count: int = 1) -> WeightVersion:
        """Single-process convenience: ``dcp.save`` (no process group) into staging, then commit."""
        import torch
        import torch.distributed.checkpoint as dcp

        bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"publish takes a flat dict of tensors; {bad[:3]} are not tensors")
        # whole contiguous tensors with their values in memory (no lazy conjugate or negation
        # bit, which the file's raw bytes would lose): a reader takes them straight from the file
        state_dict = {k: v.resolve_conj().resolve_neg().contiguous() for k, v in state_dict.items()}
        self.discard_staging(policy, version)
        stage = self.staging(policy, version)
        writer = dcp.FileSystemWriter(stage, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        quiet_dcp_logger()
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.save(state_dict, storage_writer=writer, no_dist=True)
        except BaseException as err:  # (DCP's CheckpointException is one) nothing of a failed write stays behind
            # the errno in the chain says why; with none, a disk left with no room for the state is
            # taken to be why (a quota does not show in the free space: only its errno tells it)
            need = sum(v.numel() * v.element_size() for v in state_dict.values())
            full = full_disk_in(err) is None and shutil.disk_usage(stage).free < need
            self.discard_staging(policy, version)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            raise save_failure(err, f"publishing {policy} v{version}", stage, full=full) from err
        return self.commit(policy, version, meta, whole_tensors=True)

    # -- reading -----------------------------------------------------------------------------
    def policies(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if paths.is_plain_name(n) and (self.root / n).is_dir())

    def versions(self, policy: str) -> list[int]:
        """Committed versions of ``policy``, ascending."""
        try:
            names = os.listdir(paths.policy_dir(self.root, policy))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            m = paths.VERSION_DIR_RE.match(n)
            if m and paths.commit_file(self.root, policy, int(m.group(1))).exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self, policy: str) -> WeightVersion | None:
        """The newest committed version, ``None`` if there is none."""
        for v in reversed(self.versions(policy)):
            try:
                return self.get(policy, v)
            except VersionNotCommitted:
                continue  # retired between the listing and the read; try the next one
        return None

    def get(self, policy: str, version: int) -> WeightVersion:
        return self._version_record(policy, version, self.manifest(policy, version))

    def manifest(self, policy: str, version: int) -> dict:
        """The manifest of a committed version (tensors, files with sha256, the commit's meta)."""
        if not paths.commit_file(self.root, policy, version).exists():
            known = self.versions(policy)
            raise VersionNotCommitted(
                f"{policy} v{version} is not a committed version under {self.root} (committed: "
                f"{known or 'none'}); use latest() or one of versions()"
            )
        mfile, marker = paths.manifest_file(self.root, policy, version), paths.commit_file(self.root, policy, version)
        try:
            expected = json.loads(marker.read_bytes()).get("manifest_sha256")
        except (OSError, ValueError, AttributeError) as err:
            if not marker.exists():
                raise VersionNotCommitted(f"{policy} v{version} was retired while it was read") from None
            raise DamagedVersion(
                f"{marker} is damaged ({type(err).__name__}: {err}): write it again as "
                f'{{"manifest_sha256": "<sha256 of {mfile.name}>"}} if {mfile.name} is whole, or move '
                f"{mfile.parent} out of the run directory to go on from the version before it") from None
        try:
            data = mfile.read_bytes()
            if expected and hashlib.sha256(data).hexdigest() != expected:
                raise ValueError(f"its sha256 is not the one {marker.name} records")
            manifest = json.loads(data)
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
                raise ValueError("it is not a manifest (a JSON object with 'files')")
        except (OSError, ValueError, AttributeError) as err:  # JSON and UTF-8 errors are ValueErrors
            if not marker.exists():
                raise VersionNotCommitted(f"{policy} v{version} was retired while it was read") from None
            raise DamagedVersion(
                f"{mfile} is damaged ({type(err).__name__}: {err}): move {mfile.parent} out of the run "
                "directory to go on from the version before it, or restore the file") from None
        return manifest

    def verify(self, policy: str, version: int) -> None:
        """Recompute every file's sha256 and compare with the manifest (``ChecksumMismatch``)."""
        man = self.manifest(policy, version)
        vdir = paths.version_dir(self.root, policy, version)
        for rel, rec in man["files"].items():
            p = vdir / rel
            if not p.exists() or _sha256(p) != rec["sha256"]:
                raise ChecksumMismatch(f"{policy} v{version}: {rel} does not match its manifest checksum")

    def load(self, policy: str, version: int, *, verify: bool = False, hold: bool = True) -> dict:
        """All tensors of a committed version (``read_checkpoint``), held against retention
        while it is read. ``verify`` checks sha256 first. A version written by ``publish``
        (whole contiguous tensors, one file; its manifest says ``whole_tensors``) is read
        straight from the file's bytes. The ``.metadata`` pickle is checked against its manifest
        sha256 and unpickled with DCP's classes only (``storage.safe_pickle``). ``hold=False``
        is for a reader that cannot write hold files (a store it may only read): it takes none."""
        with self.hold(policy, version) if hold else nullcontext():
            if verify:
                self.verify(policy, version)
            man = self.manifest(policy, version)
            return read_checkpoint(paths.version_dir(self.root, policy, version),
                                   whole_tensors=bool(man.get("whole_tensors")),
                                   metadata_sha256=_metadata_sha256(man, policy, version))

    def iter_tensors(self, policy: str, version: int) -> Iterator[tuple[str, Any]]:
        """A committed version's tensors one at a time (``iter_checkpoint``), every file checked
        against its sha256 first. Takes no hold: the caller holds the version (``hold``) while it reads."""
        self.verify(policy, version)
        yield from iter_checkpoint(paths.version_dir(self.root, policy, version),
                                   metadata_sha256=_metadata_sha256(self.manifest(policy, version), policy, version))

    @contextmanager
    def hold(self, policy: str, version: int) -> Iterator[WeightVersion]:
        """Keep ``version`` from retention while the block runs (pull or load it inside)."""
        hold = holds.take(self.root, policy, version, self._host)
        try:
            yield self.get(policy, version)  # after the hold: retention cannot race past it
        finally:
            hold.unlink(missing_ok=True)

    def held_versions(self, policy: str) -> set[int]:
        """Versions with a live hold (stale holds, of dead pids on this host or older than
        ``hold_timeout_s``, are removed)."""
        return holds.held(self.root, policy, self._host, self.hold_timeout_s)

    def discard_holds(self, policy: str) -> int:
        """Remove every reader's hold on ``policy``'s versions, however alive its owner looks.
        Only when no reader can be alive (a resumed run before its RaaS nodes and trainers
        start): the hold of a reader on another host killed with the run would otherwise keep
        its version from retention for good. Returns how many were removed."""
        return holds.discard_all(self.root, policy)

    # -- retention ---------------------------------------------------------------------------
    def apply_retention(self, policy: str) -> list[int]:
        """Delete committed versions older than the newest ``keep_last``, except held ones, and
        the deltas to versions no longer there. Returns the versions deleted."""
        committed = self.versions(policy)
        candidates = committed[:-self.keep_last] if len(committed) > self.keep_last else []
        deleted = []
        for v in candidates:
            if v in self.held_versions(policy):
                continue
            marker = paths.commit_file(self.root, policy, v)
            retiring = marker.with_name(_RETIRING)
            os.rename(marker, retiring)  # invisible to new readers from here on
            if v in self.held_versions(policy):  # a reader got its hold in first
                os.rename(retiring, marker)
                continue
            shutil.rmtree(paths.version_dir(self.root, policy, v))
            deleted.append(v)
        self._prune_deltas(policy)
        return deleted

    def _prune_deltas(self, policy: str, writer_alive: bool = True) -> None:
        """Delete the deltas no reader can use. A reader applies the delta ``v-1 -> v`` to the
        ``v-1`` it keeps in memory, while it holds ``v``: a delta is usable exactly while its
        ``to`` version is committed or held, whether or not ``v-1`` is still on disk (with
        ``keep_last`` 1 it never is). A delta without ``COMMITTED`` and a writer's temporary
        directory go only when no writer is alive (``discard_uncommitted``)."""
        root = paths.deltas_root(self.root, policy)
        names = os.listdir(root) if root.is_dir() else []
        usable = set(self.versions(policy)) | self.held_versions(policy)
        for n in names:
            m = paths.DELTA_DIR_RE.match(n)
            if m and (root / n / "COMMITTED").exists():
                stale = int(m.group(2)) not in usable
            else:
                stale = not writer_alive and bool(m or paths.is_tmp(n))
            if stale:
                shutil.rmtree(root / n, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _check_version(version: int) -> int:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"weight versions are integers >= 0, got {version!r}")
        return version

    @staticmethod
    def _tensor_table(ckpt: Path) -> dict:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = read_metadata(ckpt).state_dict_metadata
        table = {}
        for k, m in sorted(md.items()):
            if isinstance(m, TensorStorageMetadata):
                table[k] = {"shape": list(m.size), "dtype": str(m.properties.dtype).removeprefix("torch.")}
            else:
                table[k] = {"kind": "bytes"}
        return table

    def delta_from(self, policy: str, version: int) -> int | None:
        """The newest version a committed sparse delta to ``version`` starts from (``None``: no
        delta); ``WeightVersion.delta_from`` without reading the manifest."""
        try:
            names = os.listdir(paths.deltas_root(self.root, policy))
        except FileNotFoundError:
            return None
        froms = [int(m.group(1)) for n in names if (m := paths.DELTA_DIR_RE.match(n)) and int(m.group(2)) == version]
        done = [f for f in froms if (paths.delta_dir(self.root, policy, f, version) / "COMMITTED").exists()]
        return max(done) if done else None

    def _version_record(self, policy: str, version: int, manifest: dict) -> WeightVersion:
        return WeightVersion(
            policy=policy,
            version=version,
            manifest_path=str(paths.manifest_file(self.root, policy, version)),
            delta_from=self.delta_from(policy, version),
            checksums={k: v["sha256"] for k, v in manifest["files"].items()},
            committed_at=float(manifest["committed_at"]),
        )
