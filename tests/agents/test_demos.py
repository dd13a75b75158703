"""Demonstrations, the agentic warm start and the agent workflow on a real engine."""

from __future__ import annotations

import asyncio

import numpy as np

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.demos import demonstrations, greedy_success
from astraflow.contracts import RolloutTask
from astraflow.models import load_model
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.workflows import make_workflow
from astraflow.training.agent_warmstart import agent_warm_start
from tests.agents.toy import TABLE, LookupWorkload


def test_demonstrations_train_only_the_expert_turns(tiny_model):
    _, tok = load_model(tiny_model)
    wl = LookupWorkload()
    logs = demonstrations(wl, ChatRenderer(tok), wl.tasks("train")[:3], wl.limits(64))
    assert len(logs) == 3 and all(log.success == 1.0 and log.tool_calls == 1 for log in logs)
    log = logs[0]
    trained = tok.decode([t for t, m in zip(log.tokens, log.loss_mask) if m])
    assert trained == '<tool_call>{"name":"lookup","arguments":{"key":"k0"}}</tool_call><|im_end|>v0<|im_end|>'


def test_warm_start_learns_the_expert(tiny_model, tmp_path):
    wl = LookupWorkload()
    res = agent_warm_start(tiny_model, tmp_path / "out", wl, max_new_tokens=64, steps=4, lr=1e-3,
                           batch_size=8, eval_every=0, eval_size=4, progress=False)
    assert res["steps"] == 4 and res["demos"] == 30 and 0.0 <= res["acc"] <= 1.0
    assert np.isfinite(res["loss"]) and (tmp_path / "out" / "model.safetensors").exists()
    model, tok = load_model(tmp_path / "out")
    assert 0.0 <= greedy_success(model, tok, wl, wl.tasks("eval")[:3], wl.limits(64)) <= 1.0


def test_agent_workflow_on_the_engine_stores_what_was_generated(tiny_model):
    engine = HFEngine(str(tiny_model), version=0, seed=1)
    wl = LookupWorkload()
    wf = make_workflow("agent", wl, SamplingParams(max_new_tokens=24), node="n0")
    task = RolloutTask(task_id="g/0", group_id="g", policies=("p",), workflow="agent", prompt={"key": "k31"})
    traj = asyncio.run(wf.run_episode({"p": engine}, task))
    engine.close()
    (seq,) = traj.sequences
    ep = traj.episode
    assert ep["task"] == {"key": "k31"} and ep["turns"][0]["kind"] == "observation"
    model_turns = [t for t in ep["turns"] if t["kind"] == "model"]
    assert 1 <= len(model_turns) <= 3 and traj.stats["turns"] == len(model_turns)
    # the trained tokens are exactly the model turns' spans; everything else is untrained
    span = np.zeros(len(seq.tokens), bool)
    for t in model_turns:
        span[t["start"]:t["end"]] = True
    assert np.array_equal(span, seq.loss_mask)
    assert np.all(seq.versions[seq.loss_mask] == 0) and np.all(seq.policy_ids[~seq.loss_mask] == -1)
    assert seq.reward == traj.score in (0.0, 1.0) and TABLE["k31"]


def test_a_bpe_tokenizer_for_an_agentic_workload_learns_its_episodes():
    """``tokenizer: bpe`` on an agentic workload trains on its expert's episodes: the same
    demonstrations take far fewer tokens and still decode to the same text."""
    from astraflow.models import build_tokenizer
    from astraflow.runtime.model_build import bpe_for
    from astraflow.workloads.base import make_workload
    from astraflow.workloads.config import WorkloadConfig

    cfg = WorkloadConfig(name="textworld", workflow="agent", params={"num_train": 200, "num_test": 20})
    bpe, byte = bpe_for(cfg, 400), build_tokenizer()
    wl = make_workload("textworld", dict(cfg.params), cfg.seed)
    tasks = wl.tasks("train")[:20]
    logs = {name: demonstrations(wl, ChatRenderer(tok), tasks, wl.limits(64))
            for name, tok in (("bpe", bpe), ("byte", byte))}
    assert len(logs["bpe"]) == len(logs["byte"]) == 20
    assert sum(len(x.tokens) for x in logs["bpe"]) < 0.5 * sum(len(x.tokens) for x in logs["byte"])
    assert [bpe.decode(x.tokens) for x in logs["bpe"]] == [byte.decode(x.tokens) for x in logs["byte"]]


def test_a_noisy_expert_detours_and_recovers_and_needs_explore_action():
    import pytest

    from astraflow.models import build_tokenizer
    from astraflow.workloads.base import make_workload

    tok = build_tokenizer()
    renderer = ChatRenderer(tok)
    wl = make_workload("textworld", {"num_train": 60, "max_turns": 12}, 0)
    tasks, limits = wl.tasks("train"), wl.limits(16)
    def model_turns(log):
        return sum(t["kind"] == "model" for t in log.turns)

    clean = demonstrations(wl, renderer, tasks, limits)
    noisy = demonstrations(wl, renderer, tasks, limits, noise=0.5, seed=1)
    # the clean expert takes exactly `difficulty` turns; detours make longer successful episodes
    assert len(clean) == 60 and all(model_turns(log) == t["difficulty"] for log, t in zip(clean, tasks))
    assert noisy and all(log.success == 1.0 for log in noisy)
    assert sum(map(model_turns, noisy)) > sum(map(model_turns, clean)) * len(noisy) / len(clean)
    assert demonstrations(wl, renderer, tasks, limits, noise=0.5, seed=1)[0].tokens == noisy[0].tokens  # seeded
    with pytest.raises(ValueError, match="explore_action"):
        demonstrations(LookupWorkload(), renderer, LookupWorkload().tasks("train")[:1], limits, noise=0.5)


def test_demo_noise_for_an_environment_without_explore_action_is_refused_by_check(tmp_path):
    """`astraflow check` refuses ``demo_noise`` where the environment cannot explore, naming the
    fix, instead of the run failing later while it builds the model."""
    import yaml
    from click.testing import CliRunner

    from astraflow.cli import main

    data = yaml.safe_load(open("examples/search/config.yaml"))
    data["policies"][0]["init"]["demo_noise"] = 0.3
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["check", str(path)])
    assert res.exit_code == 2, res.output
    assert "demo_noise" in res.output and "explore_action" in res.output and "demo_noise: 0" in res.output
    data["policies"][0]["init"]["demo_noise"] = 0.0
    path.write_text(yaml.safe_dump(data))
    assert CliRunner().invoke(main, ["check", str(path)]).exit_code == 0


class _Expert:
    """A model that answers as the expert does, ends its turn with the template's closing token
    and then keeps talking, as a language model does; ``generate`` as HF's (left-padded batch)."""

    training = False

    def __init__(self, tok, end_id: int):
        self.tok, self.end_id, self.pads = tok, end_id, []

    def eval(self):
        pass

    def train(self, mode=True):
        pass

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kw):
        import torch

        self.pads.append(pad_token_id)
        rows = []
        for row in input_ids.tolist():
            text = self.tok.decode(row, skip_special_tokens=False)
            key = text.split("value of ")[-1].split("?")[0]
            ans = (f'<tool_call>{{"name":"lookup","arguments":{{"key":"{key}"}}}}</tool_call>'
                   if text.count("<|im_start|>assistant") == 1 else TABLE[key])
            ids = self.tok.encode(ans, add_special_tokens=False) + [self.end_id]
            ids += self.tok.encode("\n<|im_start|>user\nmore", add_special_tokens=False)
            rows.append(row + (ids + [pad_token_id] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(rows)


def test_greedy_evaluation_stops_on_the_templates_end_of_turn_and_pads_without_a_pad_token():
    """A tokenizer whose eos is not the template's closing token (a base model's), and one with
    no pad token at all: the expert's greedy episodes still succeed."""
    from astraflow.models import build_tokenizer

    w = LookupWorkload()
    tasks = w.tasks("eval")[:4]
    tok = build_tokenizer()
    tok.eos_token = "<|endoftext|>"
    end = ChatRenderer(tok).end_id
    assert end != tok.eos_token_id
    assert greedy_success(_Expert(tok, end), tok, w, tasks, w.limits(48)) == 1.0
    tok.pad_token = None
    model = _Expert(tok, end)
    assert greedy_success(model, tok, w, tasks, w.limits(48)) == 1.0 and None not in model.pads
