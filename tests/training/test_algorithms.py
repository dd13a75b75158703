"""The RL algorithm a config chooses: the advantage estimators (each checked against its
formula on a hand-made batch), a researcher's own estimator and loss named ``module:function``
(trained with by the torch backend, and by a real run whose trainer imports them), and the
config's refusals, named with the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from astraflow.batches import BatchItem, group_stats
from astraflow.contracts import Sequence
from astraflow.training.algorithms import ADVANTAGES, advantages
from astraflow.training.config import TrainerConfig
from tests.training.test_torch_backend import _batch

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = '''
import torch

from astraflow.training.grpo import grpo_loss

calls = []


def half_advantage(items):
    return [0.5 * (it.sequence.reward - it.group_mean) for it in items]


def seq_mean_loss(new, old, adv, mask, clip_low, clip_high, *, num_tokens):
    calls.append(num_tokens)
    loss, stats = grpo_loss(new, old, adv, mask, clip_low, clip_high, num_tokens=num_tokens)
    return loss, {**stats, "plugin_called": 1.0}


def no_num_tokens(new, old, adv, mask, clip_low, clip_high):
    return new.sum()
'''


def _items(groups: list[list[float]]) -> list[BatchItem]:
    out = []
    for g, rewards in enumerate(groups):
        mean, std = group_stats(np.array(rewards))
        for i, r in enumerate(rewards):
            seq = Sequence.build(np.array([1, 2, 3]), np.array([False, True, True]), np.zeros(3), np.zeros(3, int),
                                 np.zeros(3, int), r)
            out.append(BatchItem(sequence=seq, loss_mask=seq.loss_mask, group_mean=mean, group_std=std,
                                 group_size=len(rewards), staleness=0, task_id=f"g{g}/{i}"))
    return out


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_algo.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_algo", None)
    yield tmp_path
    sys.modules.pop("my_algo", None)


def test_the_built_in_estimators_follow_their_formulas():
    items = _items([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    r = np.array([it.sequence.reward for it in items])
    mean = np.repeat([0.5, 0.75, 0.5], 4)
    std = np.repeat([0.5, np.std([1, 1, 1, 0]), 0.0], 4)
    got = {name: advantages(ADVANTAGES.get(name), items, name) for name in ("grpo", "dr_grpo", "rloo", "batch_norm")}
    np.testing.assert_allclose(got["grpo"], np.where(std > 0, (r - mean) / (std + 1e-6), 0), rtol=1e-5)
    np.testing.assert_allclose(got["grpo"], [it.advantage for it in items], rtol=1e-6)
    np.testing.assert_allclose(got["dr_grpo"], r - mean, atol=1e-7)
    others = (np.repeat([2.0, 3.0, 2.0], 4) - r) / 3  # the mean of the other three of each group
    np.testing.assert_allclose(got["rloo"], r - others, atol=1e-6)
    a = r - mean
    np.testing.assert_allclose(got["batch_norm"], (a - a.mean()) / (a.std() + 1e-6), rtol=1e-5)
    assert abs(got["batch_norm"].mean()) < 1e-6 and abs(got["batch_norm"].std() - 1) < 1e-4
    for name in ("grpo", "dr_grpo", "rloo"):  # a group scored alike has nothing to learn
        assert not got[name][8:].any(), name
    alike = _items([[1.0, 1.0], [0.0, 0.0]])
    assert not advantages(ADVANTAGES.get("batch_norm"), alike, "batch_norm").any()
    assert not advantages(ADVANTAGES.get("rloo"), _items([[1.0]]), "rloo").any()  # a group of one


def test_an_estimator_that_returns_the_wrong_count_or_nan_is_named():
    items = _items([[1.0, 0.0]])
    with pytest.raises(ValueError, match="mine: returned 1 advantages for 2 sequences"):
        advantages(lambda its: [0.0], items, "mine")
    with pytest.raises(ValueError, match="mine: returned an advantage that is not finite"):
        advantages(lambda its: [0.0, float("nan")], items, "mine")


def test_the_config_refuses_an_unknown_or_unfit_algorithm(plugin):
    with pytest.raises(ValidationError, match="unknown advantage estimator 'dr-grpo'; known: batch_norm, dr_grpo"):
        TrainerConfig(advantage="dr-grpo")
    with pytest.raises(ValidationError, match="my_algo:nope: 'my_algo' has no 'nope'"):
        TrainerConfig(loss_fn="my_algo:nope")
    with pytest.raises(ValidationError, match="no_num_tokens does not take num_tokens"):
        TrainerConfig(loss_fn="my_algo:no_num_tokens")
    with pytest.raises(ValidationError, match="off_policy 'tis' is a correction of the built-in loss"):
        TrainerConfig(loss_fn="my_algo:seq_mean_loss", off_policy="tis")
    with pytest.raises(ValidationError, match="clip_low"):
        TrainerConfig(clip_low=1.5)
    cfg = TrainerConfig(advantage="my_algo:half_advantage", loss_fn="my_algo:seq_mean_loss")
    assert (cfg.advantage, cfg.loss_fn) == ("my_algo:half_advantage", "my_algo:seq_mean_loss")


def test_the_torch_backend_trains_with_a_researchers_estimator_and_loss(tiny_model, plugin):
    import my_algo

    from astraflow.training.torch_backend import TorchBackend

    be = TorchBackend(tiny_model, lr=1e-3, advantage="my_algo:half_advantage", loss_fn="my_algo:seq_mean_loss")
    batch = _batch(be.model, be.tokenizer, rewards=(1.0, 0.0, 0.0, 1.0))
    out = be.train_step(batch)
    assert out["plugin_called"] == 1.0 and out["advantage_abs_mean"] == pytest.approx(0.25)
    assert my_algo.calls == [out["num_tokens"]] and abs(out["ratio_mean"] - 1) < 1e-4
    # a loss of one's own trains every row: a group scored alike is not skipped
    alike = _batch(be.model, be.tokenizer, rewards=(1.0, 1.0, 1.0, 1.0))
    assert be.train_step(alike)["trained_sequences"] == 4
    plain = TorchBackend(tiny_model, lr=1e-3, advantage="dr_grpo")
    assert plain.train_step(alike)["trained_sequences"] == 0
    assert plain.train_step(batch)["advantage_abs_mean"] == pytest.approx(0.5)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_trains_with_an_estimator_and_loss_from_the_users_directory(tiny_model, tmp_path):
    """The trainer runs in a worker process: it imports the user's module from the directory
    `astraflow run` was started in, as the rollout workers import a workload's."""
    (tmp_path / "my_algo.py").write_text(PLUGIN)
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init", None)
    data["policies"][0].setdefault("trainer", {}).update(advantage="rloo", loss_fn="my_algo:seq_mean_loss")
    data["run"]["max_steps"] = 2
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", "config.yaml", "--run-dir", "run", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in steps if "loss" in x]
    assert [x["step"] for x in trained] == [1, 2] and all(x.get("plugin_called") == 1.0 for x in trained)


def test_a_kl_penalty_keeps_the_policy_near_the_model_it_started_from(tiny_model):
    """``kl_coef``: GRPO's k3 penalty to a frozen copy of the starting model. It is 0 on the first
    step (the policy is that model), grows as the policy moves, and a large weight holds the
    policy near its start where none lets it drift; every sequence trains, also a group scored
    alike."""
    import torch

    from astraflow.training.grpo import collate, token_logprobs
    from astraflow.training.torch_backend import TorchBackend

    drift = {}
    for coef in (0.0, 10.0):
        be = TorchBackend(tiny_model, lr=3e-3, kl_coef=coef)
        batch = _batch(be.model, be.tokenizer)
        steps = [be.train_step(batch) for _ in range(6)]
        if coef:
            assert steps[0]["kl_ref"] == 0.0 and max(s["kl_ref"] for s in steps) > 0
            alike = _batch(be.model, be.tokenizer, rewards=(1.0, 1.0, 1.0, 1.0))
            assert be.train_step(alike)["trained_sequences"] == 4
        else:
            assert "kl_ref" not in steps[-1] and be.reference is None
        ref = TorchBackend(tiny_model, lr=1e-3, kl_coef=1.0)  # its reference: the starting model
        c = collate(batch, be.pad_id)
        with torch.no_grad():
            new = token_logprobs(be.model, c.tokens, c.attention_mask)
            drift[coef] = float(ref._kl_to_reference(new, c.tokens, c.attention_mask, c.loss_mask).sum())
    assert drift[10.0] < 0.5 * drift[0.0], drift
    with pytest.raises(ValidationError, match="kl_coef 0.1 is implemented by the torch backend only"):
        TrainerConfig(backend="megatron", kl_coef=0.1)


def test_the_kl_reference_runs_as_the_policy_does_in_bf16(tiny_model):
    """On a CPU a bf16 policy runs eager attention; its reference does too, so the penalty of
    the first step (the policy is its reference) is exactly 0 there as well."""
    from astraflow.training.torch_backend import TorchBackend

    be = TorchBackend(tiny_model, lr=1e-3, kl_coef=1.0, precision="bf16")
    assert be.reference.config._attn_implementation == be.model.config._attn_implementation
    assert be.train_step(_batch(be.model, be.tokenizer))["kl_ref"] == 0.0
