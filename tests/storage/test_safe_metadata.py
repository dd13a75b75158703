"""A forged checkpoint file in the run directory never runs code when a node reads it.

A version's DCP ``.metadata`` is a pickle: the readers unpickle it with DCP's own classes only
(``storage.safe_pickle``) and, for a committed version, only once its bytes match the
manifest's sha256. Each forged file here would create a marker file if anything in it ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.metadata import Metadata

import storage.safe_pickle as safe_pickle
from storage import deltas, paths
from storage.checkpoint import DCP_METADATA, read_checkpoint, read_metadata
from storage.safe_pickle import UnsafeCheckpointError
from storage.weights import WeightStore


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(8, 4, generator=g), "mlp.weight": torch.randn(4, 4, generator=g).bfloat16()}


class _RunsShell:
    """Unpickling this calls ``os.system``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _TouchesFile:
    """Unpickling this calls ``Path.touch`` on the marker (a torch-free, shell-free payload)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _published(tmp_path) -> tuple[WeightStore, Path]:
    store = WeightStore(tmp_path / "w")
    store.publish("p", 1, _state(1))
    return store, paths.version_dir(store.root, "p", 1)


def _set_manifest_sha(store: WeightStore, vdir: Path) -> None:
    """What a forger with write access to the whole version does: fix the manifest up too."""
    man_path = paths.manifest_file(store.root, "p", 1)
    man = json.loads(man_path.read_text())
    man["files"][DCP_METADATA]["sha256"] = hashlib.sha256((vdir / DCP_METADATA).read_bytes()).hexdigest()
    man_path.write_text(json.dumps(man))
    marker = paths.commit_file(store.root, "p", 1)  # and the commit marker's record of the manifest
    commit = json.loads(marker.read_text())
    commit["manifest_sha256"] = hashlib.sha256(man_path.read_bytes()).hexdigest()
    marker.write_text(json.dumps(commit))


@pytest.mark.parametrize("payload", [_RunsShell, _TouchesFile])
def test_forged_metadata_is_refused_and_runs_nothing(tmp_path, payload):
    store, vdir = _published(tmp_path)
    marker = tmp_path / "ran"
    (vdir / DCP_METADATA).write_bytes(pickle.dumps(payload(marker)))
    _set_manifest_sha(store, vdir)  # past the checksum: the unpickler itself must refuse
    for read in (lambda: read_checkpoint(vdir), lambda: read_checkpoint(vdir, whole_tensors=True),
                 lambda: store.load("p", 1)):
        with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.system|pathlib\.Path\.touch|Path\.touch") as err:
            read()
        assert str(vdir / DCP_METADATA) in str(err.value) and "re-publish" in str(err.value)
    assert not marker.exists()


def test_forged_metadata_inside_valid_metadata_is_refused(tmp_path):
    """The payload hidden in an otherwise real Metadata (as a tensor's storage record)."""
    store, vdir = _published(tmp_path)
    marker = tmp_path / "ran"
    md = read_metadata(vdir)
    next(iter(md.storage_data.values())).transform_descriptors = [_RunsShell(marker)]
    (vdir / DCP_METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        read_checkpoint(vdir)
    assert not marker.exists()


def test_metadata_not_matching_the_manifest_is_not_unpickled(tmp_path, monkeypatch):
    store, vdir = _published(tmp_path)
    store.publish("p", 2, _state(2))
    other = paths.version_dir(store.root, "p", 2) / DCP_METADATA
    (vdir / DCP_METADATA).write_bytes(other.read_bytes())  # a real, valid metadata: not this version's
    unpickled = []

    class _Spy(safe_pickle._MetadataUnpickler):
        def load(self):
            unpickled.append(1)
            return super().load()

    monkeypatch.setattr(safe_pickle, "_MetadataUnpickler", _Spy)
    with pytest.raises(UnsafeCheckpointError, match="does not match the sha256"):
        store.load("p", 1)
    assert unpickled == []
    marker = tmp_path / "ran"
    (vdir / DCP_METADATA).write_bytes(pickle.dumps(_RunsShell(marker)))
    with pytest.raises(UnsafeCheckpointError, match="sha256"):
        store.load("p", 1)
    assert unpickled == [] and not marker.exists()


def test_other_torch_functions_and_escaping_paths_are_refused(tmp_path):
    _, vdir = _published(tmp_path)
    (vdir / DCP_METADATA).write_bytes(pickle.dumps(torch.load))  # a torch global that is not a dtype
    with pytest.raises(UnsafeCheckpointError, match=r"torch\.(serialization\.)?load"):
        read_checkpoint(vdir)
    store, vdir = _published(tmp_path / "again")
    md = read_metadata(vdir)
    next(iter(md.storage_data.values())).relative_path = "../../../etc/passwd"
    (vdir / DCP_METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="outside its checkpoint directory"):
        read_checkpoint(vdir)
    (vdir / DCP_METADATA).write_bytes(b"not a pickle")
    with pytest.raises(UnsafeCheckpointError, match="not a readable DCP metadata"):
        read_checkpoint(vdir)


def test_commit_refuses_a_forged_staging_metadata(tmp_path):
    store = WeightStore(tmp_path / "w")
    stage = store.staging("p", 1)
    marker = tmp_path / "ran"
    (stage / DCP_METADATA).write_bytes(pickle.dumps(_TouchesFile(marker)))
    with pytest.raises(UnsafeCheckpointError):
        store.commit("p", 1)
    assert not marker.exists() and store.versions("p") == []


def test_real_metadata_reads_as_dcp_reads_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    store, vdir = _published(tmp_path)
    ours, theirs = read_metadata(vdir), dcp.FileSystemReader(vdir).read_metadata()
    assert isinstance(ours, Metadata)
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    sd = _state(1)
    for got in (store.load("p", 1), read_checkpoint(vdir)):  # whole-tensor fast path and dcp.load
        assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


def test_forged_delta_payload_is_not_unpickled(tmp_path):
    """Deltas are safetensors plus JSON: a pickle in their place is refused as a corrupt file."""
    prev, new = _state(1), _state(2)
    ddir = tmp_path / "d"
    deltas.write_delta(prev, new, ddir)
    marker = tmp_path / "ran"
    data = ddir / deltas.DATA_FILE
    data.write_bytes(pickle.dumps(_RunsShell(marker)))
    meta = json.loads((ddir / deltas.META_FILE).read_text())
    meta["data_sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    (ddir / deltas.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(SafetensorError):
        deltas.apply_delta(prev, ddir)
    assert not marker.exists()
