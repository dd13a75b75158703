"""The Megatron backend trains Qwen2 (q/k/v biases, Qwen2's rope base): real rank processes over
gloo, TP=1 with a separate output head and TP=2 with tied embeddings.

From an HF ``Qwen2ForCausalLM`` checkpoint whose biases and norms are random (HF would start
them at 0 and 1, where a wrong mapping would not show): the backend's log-probs are the HF
model's (HF -> Megatron, sharded), its gathered weights are the checkpoint's tensors exactly
(Megatron -> HF), two GRPO steps move the weights and the biases, the published version read
back through the weight store's reader is the trainer's (tensors and log-probs), and loaded
back into the ranks from the store it gives the published log-probs again.

Tolerance as the Llama parity tests: 1e-4 nats per token. A swap of the k and v biases fails
the same check by far more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from storage.weights import WeightStore  # noqa: E402
from tests.megatron.helpers import grpo_batch, hf_logprobs, loss_fn_name, prompts, save_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.megatron
TOL = 1e-4
QKV_BIAS = "decoder.layers.0.self_attention.linear_qkv.bias"


@pytest.fixture(scope="module", params=[(1, False), (2, True)], ids=["tp1-untied", "tp2-tied"])
def run(request, tmp_path_factory):
    from transformers import AutoConfig, Qwen2ForCausalLM

    from astraflow.rollout.weight_sync import VersionReader

    tp, tied = request.param
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} on a GPU host needs {tp} GPUs (NCCL, one per rank); CPU hosts run it over gloo")
    tmp = tmp_path_factory.mktemp(f"qwen2-tp{tp}")
    hf_dir = save_tiny_qwen2(tmp / "hf", tied)
    store = WeightStore(tmp / "weights")
    toks = prompts()
    out = {"tp": tp, "tied": tied, "toks": toks, "cfg": AutoConfig.from_pretrained(hf_dir),
           "hf_init": {k: v.detach() for k, v in Qwen2ForCausalLM.from_pretrained(hf_dir).state_dict().items()}}
    with MegatronBackend(MegatronBackendConfig(
        hf_checkpoint=str(hf_dir), tp_size=tp, lr=1e-3, loss_fn=loss_fn_name(),
        start_timeout_s=120, step_timeout_s=120,
    )) as be:
        out["params"] = be.param_shapes
        out["before"], out["init_state"] = be.logprobs(toks), be.state_dict()
        out["metrics"] = [be.train_step(grpo_batch(toks, be.logprobs(toks), seed=s)) for s in (2, 3)]
        out["after"], out["trained_state"] = be.logprobs(toks), be.state_dict()
        be.publish(store, "p", 1)
        be.train_step(grpo_batch(toks, out["after"], seed=4))  # move away from the published weights
        out["moved"] = be.logprobs(toks)
        be.load_state_dict(store.load("p", 1))
        out["reloaded"], out["reloaded_state"] = be.logprobs(toks), be.state_dict()
    out["served"], _ = VersionReader(str(tmp / "weights")).read("p", 1)  # what a RaaS node loads
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.timeout(150)
def test_the_megatron_model_has_qwen2s_layout(run):
    g, h, per = 2, 16, 2  # tiny_qwen2_config: 2 query groups of 2 heads, head_dim 16
    for rank in run["params"]:
        assert rank[QKV_BIAS] == [g * (per + 2) * h // run["tp"]]  # whole query groups per rank
        assert ("output_layer.weight" in rank) is (not run["tied"])
        assert not any(k.endswith(("linear_proj.bias", "linear_fc1.bias", "linear_fc2.bias")) for k in rank)
    assert float(run["hf_init"]["model.layers.0.self_attn.k_proj.bias"].abs().max()) > 0.1


@pytest.mark.timeout(150)
def test_hf_and_megatron_logprobs_match_and_the_weights_convert_back_exactly(run):
    err = np.abs(run["before"] - hf_logprobs(run["hf_init"], run["cfg"], run["toks"])).max()
    assert err < TOL, f"max |logprob diff| HF vs Megatron: {err}"
    # HF -> Megatron -> TP shards -> gathered -> HF: the checkpoint's tensors, biases included
    assert _max_diff(run["init_state"], run["hf_init"]) == 0.0


@pytest.mark.timeout(150)
def test_training_moves_the_biases_and_the_published_version_is_the_trainers(run):
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in run["metrics"])
    assert np.abs(run["after"] - run["before"]).max() > 100 * TOL
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert not torch.equal(run["trained_state"][bias], run["hf_init"][bias])
    assert _max_diff(run["served"], run["trained_state"]) == 0.0  # fp32 version: the exact weights
    err = np.abs(run["after"] - hf_logprobs(run["served"], run["cfg"], run["toks"])).max()
    assert err < TOL, f"max |logprob diff| published HF vs trainer: {err}"


@pytest.mark.timeout(150)
def test_the_published_version_loads_back_into_the_ranks(run):
    assert np.abs(run["moved"] - run["after"]).max() > 100 * TOL  # the extra step moved away from v1
    assert _max_diff(run["reloaded_state"], run["trained_state"]) == 0.0
    assert np.abs(run["reloaded"] - run["after"]).max() < TOL


@pytest.mark.timeout(150)
def test_swapped_k_and_v_biases_fail_the_parity_check(run):
    hf_sd = dict(run["served"])
    for layer in range(run["cfg"].num_hidden_layers):
        k, v = (f"model.layers.{layer}.self_attn.{p}_proj.bias" for p in "kv")
        hf_sd[k], hf_sd[v] = hf_sd[v], hf_sd[k]
    err = np.abs(run["after"] - hf_logprobs(hf_sd, run["cfg"], run["toks"])).max()
    assert err > 10 * TOL, f"swapping the k/v biases went unnoticed (max diff {err})"
