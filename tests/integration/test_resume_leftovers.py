"""A whole run killed while a trainer was publishing or retention was deleting, or a RaaS node
was pulling, then resumed on the same run directory: the resume starts cleanly, serves and
continues from the newest committed version, and leaves none of the killed run's leftovers in
the weight store (they would stay on disk for good)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from astraflow.config import _set_path, config_from_dict
from astraflow.runtime.orchestrator import Orchestrator
from storage import paths
from storage.weights import WeightStore

ROOT = Path(__file__).resolve().parents[2]


def _sim_config(max_steps: int):
    """The simulated example (no model): the control plane and the weight store run for real."""
    data = yaml.safe_load((ROOT / "examples" / "sim" / "config.yaml").read_text())
    for key, value in {"run.max_steps": max_steps, "run.timeout_s": 200, "storage.keep_versions": 2,
                       "workload.eval.every": 0, "policies.solver.trainer.sim_step_seconds": 0.0}.items():
        _set_path(data, key, value)
    return config_from_dict(data)


def _leave_what_a_killed_publisher_leaves(store: WeightStore, policy: str) -> None:
    """Each of these is what a publisher killed at some moment leaves behind (v2 and v3 are
    committed): ranks writing v4 (staging), a commit of v4 that died between its rename and its
    marker, retention killed after retiring v1's marker, and retention killed half-way through
    deleting v0 (its marker already gone)."""
    garbage = {"sim.steps": torch.tensor([99], dtype=torch.int64)}
    dcp.save(garbage, checkpoint_id=store.staging(policy, 4), no_dist=True)
    shutil.copytree(paths.staging_dir(store.root, policy, 4), paths.version_dir(store.root, policy, 4))
    (store.staging(policy, 4) / ".metadata").unlink()  # a rank still writing
    for v in (1, 0):
        shutil.copytree(paths.version_dir(store.root, policy, 2), paths.version_dir(store.root, policy, v))
    marker = paths.commit_file(store.root, policy, 1)
    marker.rename(marker.with_name("COMMITTED.retiring"))
    paths.commit_file(store.root, policy, 0).unlink()
    paths.manifest_file(store.root, policy, 0).unlink()
    assert store.versions(policy) == [2, 3]


def _leave_a_hold_of_a_killed_reader(store: WeightStore, policy: str, version: int) -> Path:
    """A RaaS node on another host killed while it pulled ``version``: its hold stays, and a
    hold from another host counts until its owner removes it."""
    hold = paths.hold_file(store.root, policy, version, "4242-killed")
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text(json.dumps({"pid": 4242, "host": "rollout-host-of-the-killed-run", "since": time.time()}))
    assert version in store.held_versions(policy)
    return hold


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.timeout(400)
def test_a_resumed_run_removes_what_the_killed_run_left_and_goes_on_from_the_newest_version(tmp_path):
    run_dir = tmp_path / "run"
    Orchestrator(_sim_config(3), run_dir).run()
    store = WeightStore(run_dir / "weights", keep_last=2)
    assert store.versions("solver") == [2, 3]
    _leave_what_a_killed_publisher_leaves(store, "solver")
    hold = _leave_a_hold_of_a_killed_reader(store, "solver", 2)

    result = Orchestrator(_sim_config(4), run_dir).run()  # what `astraflow run` on the directory does

    assert result.steps == {"solver": 4}
    assert store.versions("solver") == [3, 4] and store.latest("solver").version == 4
    # v4 is the resumed trainer's: one step on top of v3, not the dead publisher's files
    assert int(store.load("solver", 4)["sim.steps"][0]) == 4
    policy_dir = paths.policy_dir(store.root, "solver")
    left = sorted(d.name for d in policy_dir.iterdir() if paths.VERSION_DIR_RE.match(d.name))
    assert left == ["v00000003", "v00000004"], left
    assert all(paths.commit_file(store.root, "solver", v).exists() for v in (3, 4))
    staged = paths.staging_root(store.root, "solver")
    assert not staged.exists() or not any(staged.iterdir())
    assert not hold.exists()  # and v2 was retired: nobody reads it any more
    assert "removed versions v[0, 1, 4]" in (run_dir / "logs" / "orchestrator.log").read_text()
