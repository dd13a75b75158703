"""Megatron trainer -> checkpoint shards -> the weight store's reader -> HF Llama: log-prob parity.

For TP=1 (untied embeddings) and TP=2 (tied, two rank processes over gloo): start the real
``MegatronBackend`` from an HF checkpoint, check its log-probs equal the HF model's (HF->Megatron
direction), take two GRPO steps (lr 1e-3, so the weights really move), publish through the
store API, then in this process (no Megatron process group) read the shards with plain DCP,
convert to HF and compare log-probs on fixed prompts with the trainer's own.

Tolerance: 1e-4 nats absolute per token (measured: < 1e-6 in fp32). The negative test swaps
one mapping (gate/up, then k/v) and shows the same check fails by far more than the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from astraflow.weightconv import megatron_to_hf  # noqa: E402
from storage import paths  # noqa: E402
from storage.checkpoint import read_checkpoint  # noqa: E402
from tests.megatron.helpers import (  # noqa: E402
    MiniStore, grpo_batch, hf_logprobs, loss_fn_name, prompts, save_tiny_llama, torch_probe,
)

pytestmark = pytest.mark.megatron
TOL = 1e-4


def _run(tmp: Path, tp: int, tied: bool) -> dict:
    from transformers import AutoConfig, LlamaForCausalLM

    hf_dir = save_tiny_llama(tmp / "hf", tied)
    cfg = AutoConfig.from_pretrained(hf_dir)
    toks = prompts()
    hf_init = {k: v.detach() for k, v in LlamaForCausalLM.from_pretrained(hf_dir).state_dict().items()}
    with MegatronBackend(MegatronBackendConfig(
        hf_checkpoint=str(hf_dir), tp_size=tp, lr=1e-3, loss_fn=loss_fn_name(),
        start_timeout_s=120, step_timeout_s=120,
    )) as be:
        before = be.logprobs(toks)
        metrics = [be.train_step(grpo_batch(toks, be.logprobs(toks), seed=s)) for s in (2, 3)]
        after = be.logprobs(toks)
        wv = be.publish(MiniStore(tmp / "weights"), "p", 1)
    return dict(cfg=cfg, toks=toks, hf_init=hf_init, before=before, after=after, metrics=metrics,
                version_dir=Path(wv.manifest_path).parent, root=tmp / "weights",
                meta=json.loads(Path(wv.manifest_path).read_text())["meta"])


@pytest.fixture(scope="module", params=[(1, False), (2, True)], ids=["tp1-untied", "tp2-tied"])
def trained(request, tmp_path_factory):
    tp, tied = request.param
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} on a GPU host needs {tp} GPUs (NCCL, one per rank); CPU hosts run it over gloo")
    return _run(tmp_path_factory.mktemp(f"tp{tp}"), tp, tied)


@pytest.mark.timeout(150)
def test_megatron_matches_hf_before_and_after_training(trained):
    t = trained
    # HF -> Megatron (with TP sharding) is exact: same log-probs as the HF checkpoint it started from
    assert np.abs(t["before"] - hf_logprobs(t["hf_init"], t["cfg"], t["toks"])).max() < TOL
    # training moved the weights (otherwise the parity below would prove nothing)
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in t["metrics"])
    assert np.abs(t["after"] - t["before"]).max() > 100 * TOL
    # published shards, read without Megatron, converted to HF: the trainer's log-probs
    assert paths.commit_file(t["root"], "p", 1).exists()
    hf_sd = megatron_to_hf(read_checkpoint(t["version_dir"]), t["cfg"])
    err = np.abs(t["after"] - hf_logprobs(hf_sd, t["cfg"], t["toks"])).max()
    assert err < TOL, f"max |logprob diff| {err}"


@pytest.mark.timeout(150)
def test_the_published_probe_is_the_torch_paths_on_the_version(trained):
    """The probe in the manifest (a forward of the ranks) is what the torch backend's
    ``make_probe`` computes on the published shards converted to HF: what an engine checks."""
    t = trained
    probe = t["meta"]["probe"]
    want = torch_probe(megatron_to_hf(read_checkpoint(t["version_dir"]), t["cfg"]), t["cfg"])
    assert probe["tokens"] == want["tokens"] and len(probe["logprobs"]) == len(probe["tokens"]) - 1
    err = np.abs(np.subtract(probe["logprobs"], want["logprobs"])).max()
    assert err < TOL, f"max |probe logprob diff| {err}"
    # of the trained weights, not the checkpoint the run started from
    start = torch_probe(t["hf_init"], t["cfg"])["logprobs"]
    assert np.abs(np.subtract(probe["logprobs"], start)).max() > 100 * TOL


@pytest.mark.timeout(150)
@pytest.mark.parametrize("swap", [("mlp.gate_proj", "mlp.up_proj"), ("self_attn.k_proj", "self_attn.v_proj")])
def test_a_wrong_mapping_fails_the_parity_check(trained, swap):
    t = trained
    hf_sd = dict(megatron_to_hf(read_checkpoint(t["version_dir"]), t["cfg"]))
    for layer in range(t["cfg"].num_hidden_layers):
        a, b = (f"model.layers.{layer}.{s}.weight" for s in swap)
        hf_sd[a], hf_sd[b] = hf_sd[b], hf_sd[a]
    err = np.abs(t["after"] - hf_logprobs(hf_sd, t["cfg"], t["toks"])).max()
    # the parity check (err < TOL) must fail, with a margin
    assert err > 10 * TOL, f"swapping {swap} went unnoticed (max diff {err})"
