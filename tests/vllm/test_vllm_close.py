"""Closing a vLLM engine fails the requests it still holds instead of leaving their callers
waiting on a stopped loop."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash tests/run_vllm.sh runs this tier)")

from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.process_engine import EngineProcessError
from astraflow.rollout.vllm_engine import VLLMEngine

from .conftest import engine_options


def test_close_fails_a_request_waiting_for_an_update(vllm_models):
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(), max_batch_size=4, seed=0, threads=2)
    engine._loop.call_soon_threadsafe(engine._gate.clear)  # as an update in progress holds it

    async def main():
        request = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8, greedy=True)))
        await asyncio.sleep(0.3)
        assert not request.done()  # waiting at the gate
        await asyncio.to_thread(engine.close)
        with pytest.raises(EngineProcessError, match="closed while this request ran"):
            await asyncio.wait_for(request, 30)

    asyncio.run(main())
