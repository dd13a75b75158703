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
from astraflow.rollout.vllm_setup import engine_environment, is_cpu_build  # noqa: E402

from .conftest import LOGPROB_ATOL, engine_options, reference_logprobs  # noqa: E402


def _workers(engine) -> list:
    workers = [p for p in psutil.Process(engine.pid).children(recursive=True) if "VLLM" in " ".join(p.cmdline())]
    assert workers, "no vLLM worker process under the engine core"
    return workers


def test_an_unbound_engine_runs_on_every_cpu_and_serves_the_trainers_logprobs(vllm_models, monkeypatch):
    """Its thread count is the engine's, not an ``OMP_NUM_THREADS`` the worker inherited."""
    if not is_cpu_build():
        pytest.skip("cpu_bind applies to vLLM's CPU build")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # tests/run_vllm.sh binds; restored after
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    model, tok = load_model(vllm_models["v0"])
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(cpu_bind="none"), max_batch_size=4,
                        seed=0, threads=1)
    try:
        # what the engine core was spawned with (its workers' /proc environ is their title now)
        env = engine_environment(engine.options, 1, 0, None)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
        assert all(set(w.cpu_affinity()) == os.sched_getaffinity(0) for w in _workers(engine))
        assert os.environ["OMP_NUM_THREADS"] == "7" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        prompt = tok.encode("12+34=")
        out = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=8, greedy=True)))
        np.testing.assert_allclose(out.logprobs, reference_logprobs(model, prompt, out.tokens), atol=LOGPROB_ATOL)
    finally:
        engine.close()


def _two_cpus_of_the_cpu_build(monkeypatch) -> list[int]:
    """This process's CPUs, skipping where ``cpu_bind`` does not apply (a GPU build) or there are
    fewer than two; vLLM's own bind variable unset, as a node's engine starts without it."""
    if not is_cpu_build():
        pytest.skip("cpu_bind applies to vLLM's CPU build")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    return cpus


def test_replicas_bind_their_threads_to_cpus_of_their_own(vllm_models, monkeypatch):
    """Two engines of one node (``EnginePool`` replicas), one thread each: the second binds
    to the node's second CPU, not to the first engine's."""
    cpus = _two_cpus_of_the_cpu_build(monkeypatch)
    engines = []
    try:
        for first in (0, 1):
            engines.append(VLLMEngine(str(vllm_models["v0"]), options=engine_options(), max_batch_size=4, seed=first,
                                      threads=1, first_cpu=first))
        for first, engine in enumerate(engines):
            assert all(set(w.cpu_affinity()) == {cpus[first]} for w in _workers(engine))
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    finally:
        for engine in engines:
            engine.close()


def test_a_tensor_parallel_engine_binds_each_worker_and_serves_the_trainers_logprobs(vllm_models, monkeypatch):
    """``cpu_bind: cores`` (the default) with ``tensor_parallel`` 2: vLLM's CPU build refuses to
    start on one CPU list for two workers; each gets its own."""
    cpus = _two_cpus_of_the_cpu_build(monkeypatch)
    model, tok = load_model(vllm_models["v0"])
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(), max_batch_size=4, seed=0, threads=1,
                        tensor_parallel=2)
    try:
        assert sorted(tuple(w.cpu_affinity()) for w in _workers(engine)) == [(cpus[0],), (cpus[1],)]
        prompt = tok.encode("12+34=")
        out = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=8, greedy=True)))
        np.testing.assert_allclose(out.logprobs, reference_logprobs(model, prompt, out.tokens), atol=LOGPROB_ATOL)
    finally:
        engine.close()
