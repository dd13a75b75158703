"""The vLLM test tier: runs where vLLM is importable (``bash tests/run_vllm.sh`` builds such a
venv with the CPU build); each module skips itself everywhere else (``importorskip``), and this
conftest imports nothing of vLLM.

Versions are published the way a trainer publishes them: HF-named tensors in the weight store
with ``meta["probe"]`` computed by ``astraflow.probe.make_probe`` (what ``TorchBackend.publish``
calls). Their weights are rounded to bf16 values, so the full (fp32) and the delta (bf16-held)
paths load exactly the same numbers and one reference model serves both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import torch

from astraflow.models import init_model, load_model
from astraflow.probe import make_probe, teacher_forced_logprobs


def bf16_exact(model) -> dict[str, torch.Tensor]:
    """The model's weights rounded to bf16 values (kept fp32), loaded back into it."""
    sd = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    return sd


def publish(store, policy: str, version: int, model, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Publish ``model`` (bf16-exact weights, less the ``drop`` names) as ``version`` with its
    probe; returns the tensors."""
    sd = bf16_exact(model)
    meta = {"layout": "hf", "arch": model.config.model_type, "probe": make_probe(model)}
    store.publish(policy, version, {k: v for k, v in sd.items() if k not in drop}, meta=meta)
    return sd


#: how far the engine's log-probs may be from the CPU reference's (``reference_logprobs``), and a
#: probe's recorded error from zero: the CPU build runs the reference's fp32 arithmetic; a GPU's
#: kernels (TF32 products in attention, other reduction orders) differ by more, and both stay far
#: below what a wrong update gives (nats)
ON_GPU = torch.cuda.is_available()
LOGPROB_ATOL = 2e-2 if ON_GPU else 1e-4
PROBE_ATOL = 2e-2 if ON_GPU else 1e-3


def reference_logprobs(model, prompt: list[int], tokens) -> list[float]:
    """Teacher-forced log-probs of ``tokens`` after ``prompt`` (the trainer's computation)."""
    return teacher_forced_logprobs(model, list(prompt) + [int(t) for t in tokens])[len(prompt) - 1:]


def assert_greedy_agrees(model, prompt: list[int], got, want) -> None:
    """Two greedy completions of ``prompt`` (``GenerationOutput``s) agree: the same tokens and
    log-probs up to the first token where they differ, and there a near tie under ``model`` (both
    choices' log-probs within the arithmetic's error: either engine chose right); what follows a
    tie differs legitimately, so it is not compared."""
    got_t, want_t = [int(t) for t in got.tokens], [int(t) for t in want.tokens]
    same = next((i for i, (a, b) in enumerate(zip(got_t, want_t)) if a != b), min(len(got_t), len(want_t)))
    np.testing.assert_allclose(got.logprobs[:same], want.logprobs[:same], atol=LOGPROB_ATOL)
    if same == len(got_t) == len(want_t):
        assert got.finish_reason == want.finish_reason
        return
    assert same < len(got_t) and same < len(want_t), f"one completion is the other's prefix: {got_t} vs {want_t}"
    head = list(prompt) + got_t[:same]
    choices = [reference_logprobs(model, head, [t])[-1] for t in (got_t[same], want_t[same])]
    assert abs(choices[0] - choices[1]) <= 2 * LOGPROB_ATOL, (
        f"token {same} differs ({got_t[same]} vs {want_t[same]}) without a near tie: log-probs {choices}")


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> dict[str, Path]:
    """Three tiny Qwen2 models of one architecture and tokenizer, different weights."""
    out = {}
    for seed in (0, 1, 2):
        path = tmp_path_factory.mktemp("vllm-models") / f"tiny{seed}"
        init_model(path, preset="tiny", arch="qwen2", seed=seed)
        model, tok = load_model(path)
        bf16_exact(model)
        model.save_pretrained(path, safe_serialization=True)  # the directory holds bf16-exact weights too
        out[f"v{seed}"] = path
    return out


def close_engine(engine) -> None:
    """Close a ``VLLMEngine`` and check that vLLM's engine-core processes went with it."""
    procs = engine._core_processes()
    engine.close()
    assert not any(p.is_alive() for p in procs), "vLLM's engine core outlived close()"


def engine_options(**overrides):
    from astraflow.rollout.config import VLLMConfig

    # a tiny model: a fifth of a GPU leaves room for a second engine (a re-creation, a restart)
    overrides.setdefault("gpu_memory_utilization", 0.2)
    return VLLMConfig(max_model_len=1024, cpu_kvcache_gib=1, **overrides)
