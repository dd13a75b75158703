"""Sparse bf16 deltas: bit-exact reconstruction, integrity checks, atomic layout, sync rule."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from astraflow.rollout.weight_sync import VersionReader
from storage import paths
from storage.deltas import (
    DATA_FILE, META_FILE, DeltaMismatchError, apply_delta, choose_sync, is_committed,
    read_stats, write_delta, write_version_delta,
)
from storage.weights import WeightStore

pytestmark = pytest.mark.timeout(60)


def _versions(seed=0, lr=1e-3):
    g = torch.Generator().manual_seed(seed)
    prev = {"a.weight": torch.randn(64, 48, generator=g), "b.bias": torch.randn(7, generator=g),
            "emb": torch.randn(320, 16, generator=g).to(torch.bfloat16)}
    new = {k: (v.float() + lr * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in prev.items()}
    new["b.bias"] = prev["b.bias"].clone()  # an unchanged tensor gives an empty index set
    return prev, new


def _bits(t):
    return t.to(torch.bfloat16).view(torch.int16)


def test_apply_is_bit_identical_to_the_full_bf16_version(tmp_path):
    prev, new = _versions()
    d = paths.delta_dir(tmp_path, "pol", 3, 4)
    stats = write_version_delta(tmp_path, "pol", 3, 4, prev, new)
    assert is_committed(d) and read_stats(d) == stats
    assert 0 < stats.changed < stats.elements and stats.full_bytes == 2 * stats.elements
    out = apply_delta(prev, d)
    assert set(out) == set(new)
    for k in new:
        assert out[k].dtype == torch.bfloat16 and out[k].shape == new[k].shape
        assert torch.equal(out[k].view(torch.int16), _bits(new[k])), k
    # the unchanged tensor costs nothing; the payload is what the stats say it is
    meta = json.loads((d / META_FILE).read_text())
    assert meta["changed"]["b.bias"] == 0 and sum(meta["changed"].values()) == stats.changed
    assert 0 < stats.delta_bytes < (d / DATA_FILE).stat().st_size
    # no temporary directory is left next to the committed one
    assert [p.name for p in d.parent.iterdir()] == [d.name]


def test_changes_across_zero_and_the_exponent_wrap_exactly(tmp_path, monkeypatch):
    """Bit differences are int16 and wrap: a sign flip (0x8000 apart) or a large jump still
    reconstructs bit for bit; several small chunks per tensor join back in order."""
    import storage.deltas as deltas

    monkeypatch.setattr(deltas, "CHUNK", 5)
    prev = {"w": torch.tensor([1.0, -1.0, 0.0, -0.0, 3e38, -3e38, 1e-40, 2.0] * 3)}
    new = {"w": torch.tensor([-1.0, 1.0, -0.0, 0.0, -3e38, 3e38, -1e-40, 2.0] * 3)}
    d = tmp_path / "d"
    stats = write_delta(prev, new, d)
    assert stats.changed == 21
    assert torch.equal(apply_delta(prev, d)["w"].view(torch.int16), _bits(new["w"]))


def test_realistic_update_is_far_smaller_than_full_weights(tmp_path):
    """An Adam-sized step (2e-6 per element) on fp32 weights of scale 0.02 changes a few per cent
    of the bf16 elements by one unit; the encoded delta is >= 20x smaller than the bf16 weights."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2_000_000, generator=g) * 0.02
    step = torch.randn(w.shape, generator=g).sign() * 2e-6
    stats = write_delta({"w": w}, {"w": w + step}, tmp_path / "d")
    assert 0.01 < stats.density < 0.2
    assert stats.compression >= 20, stats


def test_sparsity_follows_the_learning_rate(tmp_path):
    prev, _ = _versions()
    small = {k: (v.float() * (1 + 1e-4)).to(v.dtype) for k, v in prev.items()}
    stats = write_delta(prev, small, tmp_path / "d")
    big = write_delta(prev, {k: v.float() * 1.5 for k, v in prev.items()}, tmp_path / "e")
    assert stats.density < 0.2 < big.density


def test_corrupt_file_wrong_base_and_wrong_result_are_refused(tmp_path):
    prev, new = _versions()
    d = tmp_path / "d"
    write_delta(prev, new, d)
    other, _ = _versions(seed=1)
    with pytest.raises(DeltaMismatchError, match="starts from"):
        apply_delta(other, d)
    meta = json.loads((d / META_FILE).read_text())
    meta["result_sha256"] = "0" * 64
    (d / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(DeltaMismatchError, match="checksum"):
        apply_delta(prev, d)
    raw = bytearray((d / DATA_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (d / DATA_FILE).write_bytes(bytes(raw))
    with pytest.raises(DeltaMismatchError, match="corrupt"):
        apply_delta(prev, d)


def test_uncommitted_or_mismatched_inputs_raise(tmp_path):
    prev, new = _versions()
    (tmp_path / "x").mkdir()
    with pytest.raises(ValueError, match="not committed"):
        apply_delta(prev, tmp_path / "x")
    with pytest.raises(ValueError, match="same tensor names"):
        write_delta(prev, {"a.weight": new["a.weight"]}, tmp_path / "y")
    write_delta(prev, new, tmp_path / "z")
    with pytest.raises(FileExistsError):
        write_delta(prev, new, tmp_path / "z")
    with pytest.raises(ValueError, match="consecutive"):
        write_version_delta(tmp_path, "pol", 1, 3, prev, new)


@pytest.mark.parametrize("held,latest,every,avail,want", [
    (4, 5, 0, True, "delta"),
    (4, 5, 10, True, "delta"),
    (9, 10, 10, True, "full"),     # periodic full resync
    (3, 5, 0, True, "full"),       # two versions behind
    (4, 5, 0, False, "full"),      # no delta on disk
    (None, 5, 0, True, "full"),    # a new reader
])
def test_choose_sync(held, latest, every, avail, want):
    assert choose_sync(held, latest, every, avail) == want


def test_choose_sync_rejects_nonsense():
    with pytest.raises(ValueError):
        choose_sync(5, 5, 0, True)
    with pytest.raises(ValueError):
        choose_sync(4, 5, -1, True)


# -- deltas under the weight store's retention -----------------------------------------------

def _publish_with_delta(store, v, prev_sd):
    """Publish version ``v`` and then, as the trainer's delta writer does, the delta ``v-1 -> v``
    from the committed shards. Returns ``v``'s state dict."""
    g = torch.Generator().manual_seed(v)
    sd = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(8, generator=g)}
    store.publish("p", v, sd, meta={"layout": "hf"})
    if prev_sd is not None:
        write_version_delta(store.root, "p", v - 1, v, prev_sd, store.load("p", v))
    return sd


def _deltas(store):
    root = paths.deltas_root(store.root, "p")
    return sorted((int(m.group(1)), int(m.group(2))) for n in os.listdir(root)
                  if (m := paths.DELTA_DIR_RE.match(n)))


def test_retention_deletes_the_deltas_no_reader_can_use(tmp_path):
    """A reader applies the delta ``v-1 -> v`` to the ``v-1`` it keeps in memory while it holds
    ``v``: a delta stays exactly while its ``to`` version is kept or held, even once the full
    shards of its ``from`` version are gone, and a reader that read that version still pulls
    the next one by delta."""
    store = WeightStore(tmp_path, keep_last=2)
    sds = [_publish_with_delta(store, 0, None)]
    for v in (1, 2):
        sds.append(_publish_with_delta(store, v, sds[-1]))
    reader = VersionReader(str(tmp_path), use_deltas=True, full_resync_every=0)
    with store.hold("p", 2):  # a reader still reading v2 keeps it and the delta to it
        for v in (3, 4, 5):
            sds.append(_publish_with_delta(store, v, sds[-1]))
            if v == 3:
                assert reader.read("p", 3)[1]["mode"] == "full"  # a new reader: full shards
        assert store.versions("p") == [2, 4, 5]
        assert _deltas(store) == [(1, 2), (3, 4), (4, 5)]
    assert store.apply_retention("p") == [2]
    assert _deltas(store) == [(3, 4), (4, 5)]
    # v3's full shards are gone; the reader holds v3 in memory and pulls v4 by its delta
    assert not paths.version_dir(store.root, "p", 3).exists()
    state, rec = reader.read("p", 4)
    assert rec["mode"] == "delta"
    assert all(torch.equal(state[k], sds[4][k].to(torch.bfloat16)) for k in sds[4])


def test_a_delta_written_after_its_version_was_retired_goes_at_the_next_retention(tmp_path):
    """The trainer writes the delta to ``v`` while the next step trains; with ``keep_last`` 1 the
    next commit may retire ``v`` first. Such a delta can never be read and is deleted then."""
    store = WeightStore(tmp_path, keep_last=1)
    sd0 = _publish_with_delta(store, 0, None)
    sd1 = _publish_with_delta(store, 1, None)
    _publish_with_delta(store, 2, None)  # retires v1 before its delta exists
    write_version_delta(tmp_path, "p", 0, 1, sd0, sd1)
    assert _deltas(store) == [(0, 1)]
    _publish_with_delta(store, 3, None)
    assert store.versions("p") == [3] and _deltas(store) == []


def test_unfinished_deltas_stay_for_a_live_writer_and_go_with_a_dead_one(tmp_path):
    """A delta directory without ``COMMITTED`` and a writer's temporary directory may belong to
    a writer still at work: retention leaves them. ``discard_uncommitted`` (no writer alive)
    removes them and keeps the committed deltas."""
    store = WeightStore(tmp_path, keep_last=3)
    sds = [_publish_with_delta(store, 0, None)]
    for v in (1, 2):
        sds.append(_publish_with_delta(store, v, sds[-1]))
    unmarked = paths.delta_dir(tmp_path, "p", 2, 3)
    shutil.copytree(paths.delta_dir(tmp_path, "p", 1, 2), unmarked)
    (unmarked / "COMMITTED").unlink()  # renamed into place, killed before its marker
    tmp = paths.tmp_sibling(paths.delta_dir(tmp_path, "p", 3, 4))
    tmp.mkdir()
    (tmp / DATA_FILE).write_bytes(b"partial")
    sds.append(_publish_with_delta(store, 3, None))
    assert store.versions("p") == [1, 2, 3]
    assert unmarked.is_dir() and tmp.is_dir()
    assert store.discard_uncommitted("p") == []
    assert _deltas(store) == [(0, 1), (1, 2)] and not tmp.exists()
    assert store.delta_from("p", 2) == 1
