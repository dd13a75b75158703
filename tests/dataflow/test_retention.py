"""Segment retention (``astraflow/dataflow/retention.py``): with ``storage.keep_trajectories:
false`` a segment goes once its node is done with it and no row of it is held; and a resume whose
held rows were deleted by hand is refused before it starts."""

from __future__ import annotations

import shutil

import pytest

from astraflow.dataflow import durable
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.workloads.config import EvalConfig, WorkloadConfig
from astraflow.runtime.resume_checks import _check_rows_present
from storage.trajectories import open_trajectory_store
from tests.dataflow.test_data_layer import MATH, Node, run


def _layer(tmp_path, keep: bool) -> DataLayer:
    workload = WorkloadConfig(name="math", params=MATH, group_size=4, eval=EvalConfig(every=0))
    return DataLayer(dataflow=DataflowConfig(batch_size=8), workload=workload, policies=["p"],
                     store_url=str(tmp_path / "t"), metrics_path=None, max_steps=5,
                     snapshot_path=str(tmp_path / "dataflow.snapshot"), journal_path=str(tmp_path / "ledger.jsonl"),
                     keep_trajectories=keep)


def _alternating(t) -> float:
    return float(int(t.task_id.split("/")[1]) % 2)


@pytest.mark.parametrize("keep", [True, False])
def test_a_done_segment_goes_once_no_held_row_is_in_it(tmp_path, keep):
    layer = _layer(tmp_path, keep)

    async def go():
        await Node(layer, "n0").roll(8, reward_of=_alternating)
        await Node(layer, "n1").roll(8, reward_of=_alternating)
        await layer.segments_done(["n0", "n1", "never-written"])
        await layer.published("p", 0, {})  # nothing consumed yet: every row of n0 and n1 is buffered
        assert layer.store.segments() == ["n0", "n1"]
        batch = await layer.next_batch("p", 0, timeout=5)
        assert {it.ref.segment for it in batch.items} == {"n0"}  # the oldest groups first
        layer.retention._last = 0.0  # the next sweep is not held back by the previous one
        await layer.published("p", 1, {"loss": 0.0})  # n0's rows consumed: nothing holds them
        assert (layer.retention._task is None) == keep  # the trainer's call did not wait for the deletion
        await layer.retention.wait()
        await layer.close()

    run(go())
    assert layer.store.segments() == (["n0", "n1"] if keep else ["n1"])
    assert layer.retention.deleted == (0 if keep else 1)
    if keep:
        return
    # a new incarnation: every stored segment is done (their nodes are gone); n1's rows are still buffered
    again = _layer(tmp_path, keep)
    assert again.retention.done == {"n1"}

    async def later():
        await again.next_batch("p", 1, timeout=5)
        await again.published("p", 2, {"loss": 0.0})
        await again.close()

    run(later())
    assert again.store.segments() == [] and (tmp_path / "t" / "segments").is_dir()
    assert not [p for p in (tmp_path / "t" / "segments").iterdir()]  # no half-deleted directory left behind


def test_a_resume_whose_buffered_rows_were_deleted_is_refused_naming_the_fix(tmp_path):
    """Segments deleted while the run was stopped (to free space): every batch naming their rows
    would fail, so the resume's check refuses first, naming the segments and how to go on."""
    from tests.dataflow.test_durable import Paths

    paths = Paths(tmp_path)
    paths.url = str(tmp_path / "trajectories")
    layer = paths.layer()

    async def go():
        await Node(layer, "n0").roll(8, reward_of=_alternating)
        await Node(layer, "n1").roll(8, reward_of=_alternating)
        await layer.next_batch("p", 0, timeout=5)  # served, never committed: its rows are held too
        await layer.close()

    run(go())
    saved = durable.load(paths.snapshot)
    store = open_trajectory_store(paths.url, "r")
    assert len(durable.held_refs(saved)) == 16 and durable.missing_rows(saved, store) == {}
    _check_rows_present(saved, paths.url)  # all there: no complaint

    shutil.rmtree(tmp_path / "trajectories" / "segments" / "n1")
    assert durable.missing_rows(saved, open_trajectory_store(paths.url, "r")) == {"n1": 8}
    with pytest.raises(ValueError, match=r"8 rows .* gone from the trajectory store .*: n1 \(8\)\. Put the deleted "
                                         r"segments back, or .* move control/dataflow.snapshot"):
        _check_rows_present(saved, paths.url)
    shutil.rmtree(tmp_path / "trajectories")
    with pytest.raises(ValueError, match=r"16 rows .*: every segment \(16\)"):
        _check_rows_present(saved, paths.url)


def test_retention_is_refused_for_a_store_other_runs_may_share(tmp_path):
    """A store outside the run directory may hold other runs' segments: deleting what this run
    did not write is never risked."""
    from pydantic import ValidationError

    from storage.config import StorageConfig

    with pytest.raises(ValidationError, match="keep_trajectories: false deletes the segments of the run's own store"):
        StorageConfig(trajectories=str(tmp_path / "shared"), keep_trajectories=False)
    assert not StorageConfig(keep_trajectories=False).keep_trajectories


def test_a_resume_check_reads_a_file_url_store(tmp_path):
    """``storage.trajectories: file:///...`` is a store like a directory for the resume's check."""
    from tests.dataflow.test_durable import Paths

    paths = Paths(tmp_path)
    paths.url = str(tmp_path / "trajectories")
    layer = paths.layer()

    async def go():
        await Node(layer, "n0").roll(8, reward_of=_alternating)
        await layer.close()

    run(go())
    saved = durable.load(paths.snapshot)
    assert len(durable.held_refs(saved)) == 8  # rows to look for: the check below is not vacuous
    _check_rows_present(saved, f"file://{tmp_path / 'trajectories'}")
    with pytest.raises(ValueError, match=r"8 rows .*: n0 \(8\)"):  # and it does look in that store
        shutil.rmtree(tmp_path / "trajectories" / "segments" / "n0")
        _check_rows_present(saved, f"file://{tmp_path / 'trajectories'}")
