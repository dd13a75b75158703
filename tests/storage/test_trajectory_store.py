"""Trajectory store: the conformance suite run against every backend, plus backend specifics."""

from __future__ import annotations

import json
import uuid

import pytest

from storage import paths
from storage.trajectories import LAYOUT_VERSION, open_trajectory_store
from storage_conformance import TrajectoryStoreConformance
from storage_workers import make_row


class TestDirectoryStore(TrajectoryStoreConformance):
    @pytest.fixture
    def store_url(self, tmp_path):
        return str(tmp_path / "store")


class TestFileUrlStore(TrajectoryStoreConformance):
    """The same directory backend reached through a ``file://`` URL (only the cheap checks)."""

    @pytest.fixture
    def store_url(self, tmp_path):
        return "file://" + str(tmp_path / "store")

    test_round_trip_exactly_as_written = None  # covered by TestDirectoryStore
    test_concurrent_writer_processes_lose_and_tear_nothing = None
    test_killed_writer_leaves_nothing_visible_and_segment_continues = None


class TestMemoryStore(TrajectoryStoreConformance):
    @pytest.fixture
    def store_url(self):
        return f"memory://test-{uuid.uuid4().hex}"

    def test_not_multiprocess(self, make_store):
        assert make_store().supports_multiprocess is False


# -- directory-only errors --------------------------------------------------------------------

def test_unwritable_dir_names_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="not writable.*mode='r'"):
        open_trajectory_store(str(blocker / "store"))


def test_read_only_dir_names_the_fix(tmp_path):
    from tests.conftest import read_only_dir

    d = tmp_path / "ro"
    d.mkdir()
    with read_only_dir(d), pytest.raises(ValueError, match=f"store directory {d} is not writable .*mode='r'"):
        open_trajectory_store(str(d))
    assert not list(d.iterdir())


def test_wrong_layout_version_names_the_fix(tmp_path):
    root = tmp_path / "store"
    open_trajectory_store(str(root)).writer("s").write([make_row(0, 0)])
    layout = paths.store_layout_file(root)
    rec = json.loads(layout.read_text())
    rec["layout_version"] = LAYOUT_VERSION + 1
    layout.write_text(json.dumps(rec))
    for mode in ("r", "a"):
        with pytest.raises(ValueError, match=f"layout version {LAYOUT_VERSION + 1}.*new store"):
            open_trajectory_store(str(root), mode)


def test_unknown_scheme_lists_known(tmp_path):
    with pytest.raises(ValueError, match="known are.*file://.*memory://"):
        open_trajectory_store("s3://bucket/store")


def test_file_urls_are_parsed_as_urls(tmp_path):
    from storage.trajectories.backends import open_backend

    spaced = tmp_path / "a store"
    for url in (f"file://localhost{tmp_path}/a%20store", f"file://{tmp_path}/a%20store"):
        assert open_backend(url, "a", durable=False).root == spaced
    with pytest.raises(ValueError, match="names host 'elsewhere'"):
        open_backend("file://elsewhere/tmp/store", "a", durable=False)


def test_layout_on_disk(tmp_path):
    """The commit log and arrays live where paths.py says; a killed writer's temp file in the
    commits directory (older code wrote markers through them) is ignored and cleaned up."""
    root = tmp_path / "store"
    store = open_trajectory_store(str(root))
    store.writer("seg", batch_size=2).write([make_row(0, i) for i in range(5)])
    assert sorted(p.name for p in paths.segment_commit_dir(root, "seg").iterdir()) == [
        paths.commit_log(root, "seg").name]
    assert (paths.segment_data_dir(root, "seg") / "data" / "zarr.json").exists()
    orphan = paths.tmp_sibling(paths.commit_marker(root, "seg", 3))
    orphan.write_text("{partial")
    assert open_trajectory_store(str(root), "r").count("seg") == 5
    assert open_trajectory_store(str(root), "r").batch_count("seg") == 3
    store.writer("seg")  # reopening cleans it up
    assert not orphan.exists()
