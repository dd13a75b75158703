"""Trainer partitions start one worker per policy at most: a lost trainer gets a new worker (no
spare is needed), so more nodes would only start workers that idle. Refused at load (exit 2)
naming the partition and the ``nodes`` that fits; the multi-policy examples stay valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_cli_errors import _config, _invoke

ROOT = Path(__file__).resolve().parents[1]


def test_more_trainer_nodes_than_policies_is_refused(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "partitions.trainer.nodes=3")
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "the trainer partitions have 3 node(s) in all ('trainer' (3)), and the run trains 1 policy" in text
    assert "set nodes: 1 on partition 'trainer'" in text


def test_the_count_is_over_all_trainer_partitions(tmp_path):
    parts = [{"name": "data", "role": "data"}, {"name": "t1", "role": "trainer"},
             {"name": "t2", "role": "trainer"}, {"name": "rollout", "role": "rollout"}]
    res = _invoke("check", str(_config(tmp_path, partitions=parts)))
    assert res.exit_code == 2, res.output
    assert "set nodes: 0 on partition 't2'" in " ".join(res.output.split())


@pytest.mark.parametrize("example", ["multi_policy/config.yaml", "multi_policy/config_selector.yaml",
                                     "code/config_testgen.yaml"])
def test_one_trainer_node_per_policy_is_valid(example):
    """The examples that give each of their two policies a trainer worker."""
    from astraflow.config import config_from_dict

    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    trainer = sum(p["nodes"] for p in data["partitions"] if p["role"] == "trainer")
    assert trainer == len(data["policies"]) == 2
    config_from_dict(data, base_dir=ROOT)
