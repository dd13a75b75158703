"""``rollout.engine.vllm.cpu_bind: none`` on the CPU build: vLLM's worker runs unbound (the
operating system may place it on any CPU the node may use) and serves the trainer's log-probs."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash tests/run_vllm.sh runs this tier)")
psutil = pytest.importorskip("psutil")

from astraflow.models import load_model  # noqa: E402
from astraflow.rollout.engine import SamplingParams  # noqa: E402
from astraflow.rollout.vllm_engine import VLLMEngine  # noqa: E402
from astraflow.rollout.vllm_setup import is_cpu_build  # noqa: E402

from .conftest import engine_options, reference_logprobs  # noqa: E402


def test_an_unbound_engine_runs_on_every_cpu_and_serves_the_trainers_logprobs(vllm_models, monkeypatch):
    if not is_cpu_build():
        pytest.skip("cpu_bind applies to vLLM's CPU build")
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):  # tests/run_vllm.sh binds; restored after
        monkeypatch.delenv(key, raising=False)
    model, tok = load_model(vllm_models["v0"])
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(cpu_bind="none"), max_batch_size=4,
                        seed=0, threads=1)
    try:
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and os.environ["OMP_NUM_THREADS"] == "1"
        workers = [p for p in psutil.Process(engine.pid).children(recursive=True) if "VLLM" in " ".join(p.cmdline())]
        assert workers, "no vLLM worker process under the engine core"
        assert all(set(w.cpu_affinity()) == os.sched_getaffinity(0) for w in workers)
        prompt = tok.encode("12+34=")
        out = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=8, greedy=True)))
        np.testing.assert_allclose(out.logprobs, reference_logprobs(model, prompt, out.tokens), atol=1e-4)
    finally:
        engine.close()
