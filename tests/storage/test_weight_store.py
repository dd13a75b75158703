"""Weight store: atomic publish, committed-only reads, multi-rank shards, holds and retention."""

from __future__ import annotations

import hashlib
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp_mp

from storage import paths
from storage.weights import ChecksumMismatch, VersionNotCommitted, WeightStore
from storage_workers import dcp_rank, expected_full


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(32, 16, generator=g),
        "layers.0.mlp.weight": torch.randn(16, 16, generator=g).bfloat16(),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_publish_latest_load_exact(tmp_path):
    store = WeightStore(tmp_path / "w")
    assert store.latest("actor") is None and store.versions("actor") == []
    sd = _state(1)
    wv = store.publish("actor", 1, sd, meta={"layout": "hf", "model_config": {"hidden": 16}})
    assert store.latest("actor") == wv == store.get("actor", 1)
    assert wv.checksums.keys() == {".metadata", "__0_0.distcp"}
    _assert_same(store.load("actor", 1), sd)
    man = store.manifest("actor", 1)
    assert man["meta"] == {"layout": "hf", "model_config": {"hidden": 16}}
    assert man["tensors"]["layers.0.mlp.weight"] == {"shape": [16, 16], "dtype": "bfloat16"}
    store.publish("actor", 2, _state(2))
    assert store.latest("actor").version == 2 and store.policies() == ["actor"]
    with pytest.raises(ValueError, match="immutable"):
        store.publish("actor", 2, _state(3))
    with pytest.raises(ValueError, match="not tensors"):
        store.publish("actor", 3, {"x": 1})


def test_published_versions_are_read_straight_from_the_file(tmp_path, monkeypatch):
    """``publish`` writes whole contiguous tensors and says so in the manifest; ``load`` then
    takes them from the file's bytes without ``dcp.load`` and gets exactly what was saved
    (views and odd dtypes included). A version written by ranks and ``commit`` (no such
    promise) and a file that does not look as expected still go through ``dcp.load``."""
    import storage.checkpoint as checkpoint_mod

    store = WeightStore(tmp_path / "w")
    g = torch.Generator().manual_seed(0)
    sd = {**_state(1), "transposed": torch.randn(5, 3, generator=g).T, "scalar": torch.tensor(2.5),
          "empty": torch.zeros(0, 4), "half": torch.randn(6, generator=g).half()}
    store.publish("actor", 1, sd)
    assert store.manifest("actor", 1)["whole_tensors"] is True

    used_dcp = []
    real_load = dcp.load
    monkeypatch.setattr(dcp, "load", lambda *a, **k: used_dcp.append(1) or real_load(*a, **k))
    _assert_same(store.load("actor", 1), sd)
    assert used_dcp == []

    # a layout the fast reader does not recognise: dcp.load, same tensors
    monkeypatch.setattr(checkpoint_mod, "_read_whole_tensors", lambda vdir, md: None)
    _assert_same(store.load("actor", 1), sd)
    assert used_dcp == [1]
    monkeypatch.undo()

    # written by dcp.save into staging and committed: no promise, dcp.load
    with pytest.warns(UserWarning):
        dcp.save(_state(2), storage_writer=dcp.FileSystemWriter(store.staging("actor", 2)), no_dist=True)
    store.commit("actor", 2)
    assert store.manifest("actor", 2)["whole_tensors"] is False
    monkeypatch.setattr(dcp, "load", lambda *a, **k: used_dcp.append(2) or real_load(*a, **k))
    _assert_same(store.load("actor", 2), _state(2))
    assert used_dcp == [1, 2]


def test_fast_reader_refuses_what_it_does_not_recognise(tmp_path):
    """Compressed or resized records: ``_read_whole_tensors`` answers None (then dcp.load)."""
    import torch.distributed.checkpoint as dcp_mod

    from storage.checkpoint import _read_whole_tensors

    store = WeightStore(tmp_path / "w")
    store.publish("actor", 1, _state(1))
    vdir = paths.version_dir(store.root, "actor", 1)
    md = dcp_mod.FileSystemReader(vdir).read_metadata()
    assert _read_whole_tensors(vdir, md) is not None
    name = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[name].size = torch.Size([3, 3])  # bytes on disk no longer match
    md.state_dict_metadata[name].chunks[0].sizes = torch.Size([3, 3])
    assert _read_whole_tensors(vdir, md) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_latest_ignores_staging_and_uncommitted_version_dirs(tmp_path):
    store = WeightStore(tmp_path / "w")
    store.publish("p", 1, _state(1))
    # a version being written by the ranks: staged, never committed
    dcp.save(_state(7), checkpoint_id=store.staging("p", 7), no_dist=True)
    # a version whose commit died between the rename and the COMMITTED marker
    shutil.copytree(paths.version_dir(store.root, "p", 1), paths.version_dir(store.root, "p", 5))
    paths.commit_file(store.root, "p", 5).unlink()
    assert store.latest("p").version == 1
    assert store.versions("p") == [1]
    for v in (5, 7):
        with pytest.raises(VersionNotCommitted, match="committed: \\[1\\]"):
            store.get("p", v)
        with pytest.raises(VersionNotCommitted):
            store.load("p", v)
    # finishing the staged version makes it visible; the dead v5 directory is replaced on commit
    store.commit("p", 7)
    assert store.latest("p").version == 7
    with pytest.raises(ValueError, match="nothing to commit"):
        store.commit("p", 5)


def test_discard_uncommitted_removes_what_a_dead_publisher_left_after_the_newest_version(tmp_path):
    """Before a replacement trainer starts: half-published versions of the dead one go; the
    committed versions stay."""
    store = WeightStore(tmp_path / "w")
    store.publish("p", 1, _state(1))
    store.publish("p", 2, _state(2))
    dcp.save(_state(3), checkpoint_id=store.staging("p", 3), no_dist=True)  # staged, never committed
    shutil.copytree(paths.version_dir(store.root, "p", 2), paths.version_dir(store.root, "p", 4))
    paths.commit_file(store.root, "p", 4).unlink()  # renamed, marker never written
    assert store.discard_uncommitted("p") == [3, 4]
    assert store.versions("p") == [1, 2] and not paths.version_dir(store.root, "p", 4).exists()
    assert not any(paths.staging_root(store.root, "p").iterdir())
    _assert_same(store.load("p", 2), _state(2))
    assert store.discard_uncommitted("p") == [] and store.discard_uncommitted("q") == []


def test_discard_uncommitted_removes_a_version_retention_had_begun_to_delete(tmp_path):
    """A publisher killed inside retention, after retiring a version's marker (v2) or half-way
    through removing its directory (v1, the retired marker already removed): the older
    versions are invisible and would stay on disk for good."""
    store = WeightStore(tmp_path / "w", keep_last=2)
    for v in (1, 2, 3):
        store.publish("p", v, _state(v))
    assert store.versions("p") == [2, 3]  # v1 retired by retention
    shutil.copytree(paths.version_dir(store.root, "p", 2), paths.version_dir(store.root, "p", 1))
    paths.commit_file(store.root, "p", 1).unlink()
    paths.manifest_file(store.root, "p", 1).unlink()
    marker = paths.commit_file(store.root, "p", 2)
    marker.rename(marker.with_name("COMMITTED.retiring"))  # what the kill left: the marker gone, the files not
    assert store.versions("p") == [3] and paths.version_dir(store.root, "p", 2).exists()
    assert store.discard_uncommitted("p") == [1, 2]
    assert not paths.version_dir(store.root, "p", 2).exists() and store.versions("p") == [3]
    assert [d.name for d in paths.policy_dir(store.root, "p").iterdir() if d.name.startswith("v")] == ["v00000003"]
    _assert_same(store.load("p", 3), _state(3))


def test_manifest_checksums_are_verified(tmp_path):
    store = WeightStore(tmp_path / "w")
    wv = store.publish("p", 3, _state(3))
    vdir = paths.version_dir(store.root, "p", 3)
    for name, digest in wv.checksums.items():
        assert hashlib.sha256((vdir / name).read_bytes()).hexdigest() == digest
        assert store.manifest("p", 3)["files"][name]["bytes"] == (vdir / name).stat().st_size
    store.verify("p", 3)
    shard = vdir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="__0_0.distcp"):
        store.verify("p", 3)
    with pytest.raises(ChecksumMismatch):
        store.load("p", 3, verify=True)


def test_a_shard_cut_short_fails_its_read_with_an_exception_naming_the_version(tmp_path):
    """DCP's read error is a ``BaseException``: through a Dask actor call (a RaaS node's start, its
    weight watcher) it would drop the worker's connection instead of saying what failed."""
    from storage.checkpoint import CheckpointReadError

    store = WeightStore(tmp_path / "w")
    store.publish("p", 3, _state(3))
    vdir = paths.version_dir(store.root, "p", 3)
    shard = vdir / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(Exception) as err:  # an Exception, not only a BaseException
        store.load("p", 3)
    assert isinstance(err.value, CheckpointReadError) and f"reading the checkpoint {vdir} failed (RuntimeError: " in \
        str(err.value) and err.value.failures
    sent = pickle.loads(pickle.dumps(err.value))  # as a Dask actor call sends it to its caller
    assert isinstance(sent, CheckpointReadError) and str(sent) == str(err.value) and sent.failures == {}


def test_a_read_error_reaches_its_caller_whatever_the_ranks_exception_is():
    """DCP's failures (each rank's exception and frames) stay in the process that read: one that
    cannot be rebuilt from its args would make the error itself fail to unpickle at the caller."""
    from storage.checkpoint import CheckpointReadError

    class NeedsTwo(Exception):
        def __init__(self, a, b):
            super().__init__(a)

    err = CheckpointReadError("reading the checkpoint x failed", {0: (NeedsTwo("a", "b"), [])})
    sent = pickle.loads(pickle.dumps(err))
    assert str(sent) == "reading the checkpoint x failed" and sent.failures == {}


def test_retention_keeps_last_k_and_never_a_held_version(tmp_path):
    store = WeightStore(tmp_path / "w", keep_last=2)
    store.publish("p", 0, _state(0))
    with store.hold("p", 0) as held:
        assert held.version == 0
        for v in (1, 2, 3):
            store.publish("p", v, _state(v))
        assert store.versions("p") == [0, 2, 3]
        _assert_same(store.load("p", 0), _state(0))
    store.publish("p", 4, _state(4))
    assert store.versions("p") == [3, 4]
    assert not paths.version_dir(store.root, "p", 0).exists()
    assert not any(paths.readers_dir(store.root, "p").iterdir())  # holds released


def test_stale_hold_of_dead_process_is_ignored(tmp_path):
    store = WeightStore(tmp_path / "w", keep_last=1)
    store.publish("p", 0, _state(0))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    hold = paths.hold_file(store.root, "p", 0, f"{child.pid}-dead")
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text(f'{{"pid": {child.pid}, "host": "{store._host}", "since": {time.time()}}}')
    store.publish("p", 1, _state(1))
    assert store.versions("p") == [1] and not hold.exists()


def test_a_hold_older_than_the_timeout_is_a_dead_readers_on_any_host(tmp_path):
    """A reader on another host killed mid-pull leaves its hold; once older than any pull, it
    no longer keeps its version from retention. A recent one from another host still does."""
    store = WeightStore(tmp_path / "w", keep_last=1, hold_timeout_s=600)
    other = f"another-{store._host}"
    store.publish("p", 0, _state(0))
    old = paths.hold_file(store.root, "p", 0, "4242-killed")
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_text(f'{{"pid": 4242, "host": "{other}", "since": {time.time() - 601}}}')
    store.publish("p", 1, _state(1))
    assert store.versions("p") == [1] and not old.exists()  # retired despite the dead hold
    fresh = paths.hold_file(store.root, "p", 1, "4343-pulling")
    fresh.write_text(f'{{"pid": 4343, "host": "{other}", "since": {time.time() - 60}}}')
    assert store.held_versions("p") == {1}
    store.publish("p", 2, _state(2))
    assert store.versions("p") == [1, 2] and fresh.exists()  # kept for the recent hold


def test_discard_holds_frees_a_version_a_killed_reader_on_another_host_held(tmp_path):
    """Such a hold counts until its owner removes it, which a killed reader never does: the
    version would never be retired. A resumed run, with no reader alive, drops every hold."""
    store = WeightStore(tmp_path / "w", keep_last=1)
    store.publish("p", 0, _state(0))
    hold = paths.hold_file(store.root, "p", 0, "4242-killed")
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text(f'{{"pid": 4242, "host": "another-{store._host}", "since": {time.time()}}}')
    store.publish("p", 1, _state(1))
    assert store.versions("p") == [0, 1]  # kept for the hold
    assert store.discard_holds("p") == 1 and store.discard_holds("q") == 0
    assert store.held_versions("p") == set()
    store.publish("p", 2, _state(2))
    assert store.versions("p") == [2] and not paths.version_dir(store.root, "p", 0).exists()


@pytest.mark.timeout(120)
def test_two_rank_shards_load_in_one_process(tmp_path):
    root = tmp_path / "w"
    ctx = tmp_mp.start_processes(
        dcp_rank, args=(2, str(tmp_path / "pg"), str(root), "actor", 4), nprocs=2,
        join=False, start_method="spawn",
    )
    deadline = time.monotonic() + 100
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("2-rank DCP save did not finish within 100 s")
    store = WeightStore(root)
    stage_files = {p.name for p in store.staging("actor", 4).iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= stage_files
    wv = store.commit("actor", 4, meta={"layout": "megatron"})
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(wv.checksums)
    _assert_same(store.load("actor", 4, verify=True), expected_full())


def test_bad_input_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        WeightStore(tmp_path, keep_last=0)
    store = WeightStore(tmp_path)
    with pytest.raises(ValueError, match="path component"):
        store.staging("../x", 1)
    with pytest.raises(ValueError, match=">= 0"):
        store.staging("p", -1)


@pytest.mark.parametrize("damage", ["garbage", "edited", "not an object", "missing"])
def test_a_damaged_manifest_is_named_not_read(tmp_path, damage):
    """A manifest that is not JSON, was edited after the commit (its sha256 no longer matches the
    commit marker), is not a manifest or is gone: ``DamagedVersion`` names it and the way on."""
    from storage.weights import DamagedVersion

    store = WeightStore(tmp_path)
    store.publish("p", 1, {"w": torch.ones(2)})
    man = paths.manifest_file(tmp_path, "p", 1)
    if damage == "garbage":
        man.write_bytes(b"\xff{not json")
    elif damage == "edited":
        man.write_text(man.read_text().replace('"p"', '"q"', 1) + " ")
    elif damage == "not an object":
        man.write_text("[1, 2]")
    else:
        man.unlink()
    with pytest.raises(DamagedVersion, match=rf"{man} is damaged .*move .*v.*1 out of the run directory"):
        store.latest("p")


def test_a_version_retired_while_read_is_not_damaged(tmp_path):
    store = WeightStore(tmp_path)
    store.publish("p", 1, {"w": torch.ones(2)})
    shutil.rmtree(paths.version_dir(tmp_path, "p", 1))  # retention removed it, commit marker and all
    with pytest.raises(VersionNotCommitted):
        store.manifest("p", 1)


def test_a_publish_that_fails_part_way_leaves_nothing_and_names_the_os_error(tmp_path, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    store = WeightStore(tmp_path / "w")

    def full_disk(state_dict, storage_writer, no_dist):
        stage = Path(storage_writer.path)
        stage.mkdir(parents=True, exist_ok=True)
        (stage / "__0_0.distcp").write_bytes(b"x" * 1000)  # a part written before the disk filled
        raise CheckpointException("save failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(OSError, match="publishing p v1 failed: No space left on device") as info:
        store.publish("p", 1, _state(1))
    assert info.value.errno == errno.ENOSPC and "staging" in info.value.filename
    from storage import paths

    assert not paths.staging_dir(store.root, "p", 1).exists() and store.latest("p") is None


def test_a_read_only_store_names_the_hold_files_directory(tmp_path, monkeypatch):
    store = WeightStore(tmp_path / "w")
    store.publish("p", 1, _state(1))

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("storage.holds.write_atomically", refused)
    with pytest.raises(OSError, match="cannot write a reader's hold file in .*readers.*give this process write"):
        store.load("p", 1)


def test_lazily_conjugated_or_negated_tensors_are_published_with_their_values(tmp_path):
    store = WeightStore(tmp_path / "w")
    c = torch.tensor([1 + 2j, 3 - 4j])
    neg = torch.tensor([1.0, 2.0])._neg_view()
    store.publish("p", 1, {"conj": c.conj(), "neg": neg})
    got = store.load("p", 1)
    assert torch.equal(got["conj"], c.conj().resolve_conj()) and torch.equal(got["neg"], torch.tensor([-1.0, -2.0]))


def test_a_publish_whose_rank_fails_otherwise_raises_an_exception_the_trainer_catches(tmp_path, monkeypatch):
    """DCP's ``CheckpointException`` is a ``BaseException``: it would end a trainer's thread
    unreported. A full disk that torch's zip writer reports as its own error is still ENOSPC."""
    import errno
    import shutil
    from collections import namedtuple

    from torch.distributed.checkpoint.api import CheckpointException

    store = WeightStore(tmp_path / "w")

    def zip_writer_fails(state_dict, storage_writer, no_dist):
        raise CheckpointException("save failed", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})

    monkeypatch.setattr(dcp, "save", zip_writer_fails)
    with pytest.raises(RuntimeError, match="publishing p v1 into .* failed: RuntimeError: unexpected pos"):
        store.publish("p", 1, _state(1))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100, 100, 0))
    with pytest.raises(OSError) as info:
        store.publish("p", 1, _state(1))
    assert info.value.errno == errno.ENOSPC


def test_the_whole_tensor_read_takes_as_many_reads_as_a_shard_needs(tmp_path, monkeypatch):
    """One read() returns at most ~2 GiB on Linux (less on some network filesystems): a shard
    read in one call would come back part zeros, and the fast path would give up on every model
    past that size. Simulated with reads of 4 KiB at most."""
    import io

    import storage.checkpoint as ck

    class Capped(io.FileIO):
        def readinto(self, b):
            return super().readinto(memoryview(b).cast("B")[:4096])

    store = WeightStore(tmp_path / "w")
    sd = {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}
    store.publish("p", 0, sd)
    vdir = paths.version_dir(store.root, "p", 0)
    monkeypatch.setattr(ck, "open", lambda p, mode="r", buffering=-1: Capped(p, "rb"), raising=False)
    got = ck._read_whole_tensors(vdir, ck.read_metadata(vdir))
    assert got is not None and all(torch.equal(got[k], sd[k]) for k in sd)


def test_a_damaged_commit_marker_is_named_not_the_manifest(tmp_path):
    from storage.weights import DamagedVersion

    store = WeightStore(tmp_path)
    store.publish("p", 1, {"w": torch.ones(2)})
    marker = paths.commit_file(tmp_path, "p", 1)
    marker.write_bytes(b"\xff{not json")
    with pytest.raises(DamagedVersion, match=rf"{marker} is damaged .*write it again as") as err:
        store.latest("p")
    assert "manifest.json is damaged" not in str(err.value)
