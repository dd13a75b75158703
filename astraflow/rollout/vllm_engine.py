"""``VLLMEngine``: vLLM's V1 engine (``AsyncLLM``) behind the ``InferenceEngine`` protocol.

vLLM batches continuously: each ``generate`` is one vLLM request that joins the running batch
at the next step and leaves it when it stops. Prompts go in as token ids (no re-tokenisation);
each sampled token comes back with its raw log-prob (temperature 1, before top-p: vLLM's
``logprobs_mode="raw_logprobs"``), the behaviour log-prob of the loss, and is tagged with the
weight version the engine held when the token was sampled.

vLLM runs its engine core (scheduler, workers, the model) in processes of its own; this object
lives in the node's process and drives ``AsyncLLM`` from an event loop on a thread of its own,
so the node's loop only hands requests over (one hop per request, not per token) and a weight
update never blocks it.

Asynchronous overlap "weight update vs in-flight generation" (``rollout/vllm_updates.py``):
``load_version`` may be called at any time. New requests wait at a gate while an update runs.
Requests in flight then either finish first (fewer than ``swap_min_remaining`` tokens left) or
are aborted and resumed from their generated prefix under the new weights (partial rollout).
Invariant, as with ``HFEngine``: a token's (version, log-prob) describe the weights that
sampled it.

Failure: if vLLM's engine core dies, every pending and later ``generate`` raises
``EngineProcessError`` and ``dead`` says why; the node ``restart()``s the engine (a new
``AsyncLLM`` on the model directory as version 0) and loads the newest version into it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from astraflow.agents.chat import turn_stop_ids
from astraflow.rollout.engine import SWAP_MIN_REMAINING, Generation, SamplingParams
from astraflow.rollout.process_engine import EngineProcessError

log = logging.getLogger("astraflow.rollout")

#: seconds an engine start (or re-creation) may take before it counts as failed
START_TIMEOUT_S = 600.0


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: set by an update that aborts the request: resume it from its prefix afterwards
    resume: bool = False
    rid: str = ""


class VLLMEngine:
    """``InferenceEngine`` on vLLM's ``AsyncLLM``. ``options`` is ``rollout.engine.vllm``
    (``VLLMConfig``); ``tensor_parallel`` shards the model over the worker's GPUs (a replica's
    ``visible_devices``, as ``engine_pool.plan_replicas`` gives them, when set); ``threads``
    are the CPU build's OpenMP threads, bound (``cpu_bind: cores``) from the worker's CPU
    ``first_cpu`` on, so that replicas take CPUs of their own. Raises ``ValueError`` with the
    install command when vLLM is not installed (``vllm_setup.require_vllm``)."""

    def __init__(self, model_path: str, *, options: Any, max_batch_size: int = 256, seed: int = 0,
                 version: int = 0, tensor_parallel: int = 1, dtype: str = "fp32", threads: int = 1,
                 swap_min_remaining: int = SWAP_MIN_REMAINING, visible_devices: str | None = None,
                 first_cpu: int = 0):
        from astraflow.models import check_model_dir, load_tokenizer
        from astraflow.rollout import vllm_setup
        from astraflow.rollout.vllm_updates import Updater

        vllm_setup.require_vllm()
        check_model_dir(model_path, tokenizer=False)
        self.model_path = str(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.options = options
        self.swap_min_remaining = swap_min_remaining
        self._engine_kwargs = dict(max_batch_size=max_batch_size, seed=seed, tensor_parallel=tensor_parallel,
                                   dtype=dtype, threads=threads, visible_devices=visible_devices, first_cpu=first_cpu)
        self._stop_ids = sorted(self._stops(Path(model_path)))
        #: whether vLLM labels tokens with versions itself (``vllm_setup.labels_versions``)
        self.labels_versions = vllm_setup.labels_versions()
        self._ids = itertools.count()
        self._running: dict[str, _Request] = {}
        #: every request's task (waiting at the gate or generating); failed by ``close``
        self._requests: set[asyncio.Task] = set()
        self._closing = False
        self._stats = dict(tokens=0, requests=0, batches=0, busy_seconds=0.0, weight_swaps=0, decode_steps=0,
                           reencoded_rows=0, recreations=0)
        #: the version asked for last (``load_version``); ``serving_version``: the one loaded
        self.version = version
        self.serving_version = version
        self.restarts = 0
        self._dead: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        self._gate: asyncio.Event = self._call(self._make_gate())
        self.llm = None
        try:
            self._call(self._start(self.model_path, version), timeout=START_TIMEOUT_S)
            self.updater = Updater(self)
        except BaseException:
            self._call(self._shutdown(), timeout=120)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            raise

    # -- protocol ------------------------------------------------------------------------
    async def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Generation:
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise ValueError("VLLMEngine.generate: prompt_tokens is empty")
        if params.max_new_tokens < 1:
            raise ValueError(f"VLLMEngine.generate: max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if not params.greedy and params.temperature <= 0:
            raise ValueError("VLLMEngine.generate: temperature must be > 0; use greedy=True for argmax")
        limit = self.max_model_len
        if limit and len(prompt) + params.max_new_tokens > limit:
            raise ValueError(f"VLLMEngine.generate: prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's {limit} tokens (rollout.engine.vllm.max_model_len); "
                             "shorten one of them")
        if self.dead:
            raise EngineProcessError(self.dead)
        fut = asyncio.run_coroutine_threadsafe(self._generate(_Request(prompt, params)), self._loop)
        return await asyncio.wrap_future(fut)  # cancelling the caller cancels (aborts) the request

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load HF-named tensors as ``version`` (blocking; unverified unless re-created: a state
        dict carries no probe). The node uses ``load_version`` instead."""
        self.updater.submit_state(state_dict, int(version)).result()

    def load_version(self, weights_root: str, policy: str, version: int, *, use_deltas: bool = False,
                     full_resync_every: int = 10) -> None:
        """Start loading committed ``version`` of ``policy`` from the weight store and return:
        requests submitted after this call are generated by it (or a newer one). If the load
        fails before touching the weights (e.g. the version is gone) the engine keeps them,
        ``version`` falls back to theirs and the failure is logged, so the node's next poll
        tries again; one that fails part-way leaves the engine ``dead`` (``vllm_updates``)."""
        self.version = int(version)
        self.updater.submit_store(str(weights_root), policy, int(version), use_deltas, full_resync_every)

    def take_load_records(self) -> list[dict[str, Any]]:
        return self.updater.take_records()

    def stats(self) -> dict[str, float]:
        """The HF engine's counters (``batches`` and ``decode_steps`` stay 0: vLLM schedules
        steps itself), ``reencoded_rows`` = requests resumed after an update, ``recreations``."""
        return {k: float(v) for k, v in self._stats.items()}

    def close(self) -> None:
        """Shut vLLM down (its engine core and worker processes are reaped) and stop the loop."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self._call(self._fail_requests(), timeout=30)
            except Exception as err:  # a request vLLM does not let go of: shut down all the same
                log.warning("vLLM engine: failing its requests on close: %s: %s", type(err).__name__, err)
            self._call(self._shutdown(), timeout=120)
            self.updater.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        self._loop.close()

    # -- capabilities ----------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The engine core process (vLLM's workers are its children)."""
        procs = self._core_processes()
        return procs[0].pid if procs else None

    @property
    def dead(self) -> str | None:
        if self._dead is None and self.llm is not None and self.llm.errored:
            procs = self._core_processes()
            end = time.monotonic() + 5.0  # a core whose worker died is still shutting down
            for proc in procs:
                proc.join(max(end - time.monotonic(), 0.0))
            how = ", ".join(map(_exit, procs)) or "no process"
            self._dead = f"the vLLM engine core died ({how}); see the worker log"
        return self._dead

    @property
    def restartable(self) -> bool:
        return True

    def restart(self) -> None:
        """A new ``AsyncLLM`` on the model directory as version 0 (blocking); the caller loads
        the newest committed version next."""
        if self.dead is None:
            raise RuntimeError("VLLMEngine.restart: the engine is still serving")
        try:
            self._call(self._shutdown(), timeout=120)
            self._call(self._start(self.model_path, 0), timeout=START_TIMEOUT_S)
        except (RuntimeError, TimeoutError, concurrent.futures.TimeoutError) as err:
            raise EngineProcessError(f"restarting the vLLM engine failed: {err}") from err
        self.version = self.serving_version = 0
        self.updater.forget_readers()
        self._dead = None
        self.restarts += 1

    @property
    def loads_versions_itself(self) -> bool:
        return True

    @property
    def confirmed_version(self) -> int:
        """The version loaded and serving (``serving_version``): what a pinned request waits for."""
        return self.serving_version

    @property
    def max_model_len(self) -> int | None:
        return self.llm.model_config.max_model_len if self.llm is not None else None

    # -- internals (all coroutines run on the engine's own loop) ----------------------------
    def _call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the engine's loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _make_gate(self) -> asyncio.Event:
        gate = asyncio.Event()
        gate.set()
        return gate

    def _stops(self, model_dir: Path) -> set[int]:
        """End-of-turn tokens: the tokenizer's eos and chat-template closer, the model's eos (a
        list for some models) from its generation config, from config.json where it has none
        (transformers' rule, so the HF engine stops on the same)."""
        tok = self.tokenizer
        stops = turn_stop_ids(tok)
        gen = model_dir / "generation_config.json"  # transformers reads config.json's only without one
        f = gen if gen.is_file() else model_dir / "config.json"
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        stops |= set(eos if isinstance(eos, list) else [eos])
        return {int(s) for s in stops if s is not None}

    async def _start(self, model_dir: str, version: int) -> None:
        """Create the ``AsyncLLM`` on ``model_dir`` holding ``version`` (blocks this loop while
        it loads); vLLM labels the tokens it generates with the version from then on. A start
        that fails (a re-creation for an update included) leaves the engine ``dead`` with the
        reason, so that requests fail with ``EngineProcessError`` and the node restarts it, and
        raises ``RuntimeError`` with vLLM's message (vLLM's traceback goes to the log): some of
        vLLM's errors (pydantic's ``ValidationError`` of its config) cannot be pickled, and Dask
        pickles an error with its cause and context, so a node's start that raised one, or one
        chained to it, would never report its failure to the scheduler."""
        from astraflow.rollout.vllm_setup import make_async_llm

        try:
            self.llm = make_async_llm(model_dir, self.options, **self._engine_kwargs)
            if self.labels_versions:
                await self.llm.update_weight_version(str(version))
            return
        except Exception as err:
            self._dead = f"starting the vLLM engine on {model_dir} failed: {type(err).__name__}: {err}"
            log.warning("vLLM engine: %s", self._dead, exc_info=err)
        except BaseException as err:
            self._dead = f"starting the vLLM engine on {model_dir} failed: {type(err).__name__}: {err}"
            raise
        raise RuntimeError(self._dead)  # outside the handler: no reference to vLLM's error

    async def _shutdown(self) -> None:
        """Shut the ``AsyncLLM`` down and reap its engine core (vLLM kills the workers under it)."""
        if self.llm is not None:
            procs = self._core_processes()
            llm, self.llm = self.llm, None
            llm.shutdown()
            for proc in procs:
                proc.join(30)

    def _core_processes(self) -> list:
        manager = getattr(getattr(getattr(self.llm, "engine_core", None), "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", []))

    def _sampling(self, req: _Request):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = req.params
        return VSamplingParams(
            temperature=0.0 if p.greedy else p.temperature, top_p=1.0 if p.greedy else p.top_p,
            max_tokens=p.max_new_tokens - len(req.tokens), logprobs=0, detokenize=False,
            stop_token_ids=sorted(set(self._stop_ids) | set(p.stop_token_ids)),
            output_kind=RequestOutputKind.FINAL_ONLY, skip_special_tokens=False)

    async def _fail_requests(self) -> None:
        """The engine closes: requests still waiting or running end with ``EngineProcessError``
        rather than waiting on a loop that stops."""
        self._closing = True
        tasks = list(self._requests)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, req: _Request) -> Generation:
        if self._closing:
            raise EngineProcessError("the vLLM engine is closed")
        task = asyncio.current_task()
        self._requests.add(task)
        try:
            return await self._run(req)
        except asyncio.CancelledError:
            if self._closing:
                raise EngineProcessError("the vLLM engine was closed while this request ran") from None
            raise
        finally:
            self._requests.discard(task)

    async def _run(self, req: _Request) -> Generation:
        """One request: run it, and again from its prefix each time an update aborts it."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        finish = "length"
        while True:
            await self._gate.wait()
            if self._closing:
                raise EngineProcessError("the vLLM engine was closed while this request waited")
            if not self._gate.is_set():  # an update closed the gate between the wake-up and now
                continue
            if self.dead:
                raise EngineProcessError(self.dead)
            req.rid, req.resume = f"r{next(self._ids)}", False
            version, start = self.serving_version, len(req.tokens)
            self._running[req.rid] = req
            finish, spans = None, None
            try:
                # one output per request (its end, or its abort with what it generated so far):
                # no per-token Python work in the node's process
                async for out in self.llm.generate(TokensPrompt(prompt_token_ids=req.prompt + req.tokens),
                                                   self._sampling(req), req.rid):
                    c = out.outputs[0]
                    req.tokens += c.token_ids
                    req.logprobs += [d[t].logprob for d, t in zip(c.logprobs or [], c.token_ids)]
                    finish = c.finish_reason or finish
                    if self.labels_versions:
                        spans = c.weight_versions or spans
            except EngineDeadError as err:
                raise EngineProcessError(self.dead or f"the vLLM engine core died: {err}") from None
            finally:
                self._running.pop(req.rid, None)
            req.versions += _versions(spans, len(req.tokens) - start, version)
            if not (req.resume and finish == "abort" and len(req.tokens) < req.params.max_new_tokens):
                break
            self._stats["reencoded_rows"] += 1
        assert len(req.tokens) == len(req.logprobs) == len(req.versions)
        self._stats["requests"] += 1
        self._stats["tokens"] += len(req.tokens)
        self._stats["busy_seconds"] += loop.time() - t0
        return Generation(tokens=np.asarray(req.tokens, dtype=np.int32),
                          logprobs=np.asarray(req.logprobs, dtype=np.float32),
                          versions=np.asarray(req.versions, dtype=np.int32),
                          finish_reason="stop" if finish == "stop" else ("abort" if finish == "abort" else "length"),
                          engine_seconds=loop.time() - t0)

    def steps_left(self) -> int:
        """Tokens the longest running request may still generate (0: none running)."""
        return max((r.params.max_new_tokens - len(r.tokens) - self._generated(r.rid) for r in self._running.values()),
                   default=0)

    def _generated(self, rid: str) -> int:
        """Tokens vLLM has generated so far for the running request ``rid`` (its output
        processor's count; 0 where this vLLM does not expose it: the request counts as just
        started, so an update aborts and resumes it)."""
        proc = getattr(self.llm, "output_processor", None)
        ids = getattr(proc, "external_req_ids", {}).get(rid, [])
        states = [getattr(proc, "request_states", {}).get(i) for i in ids]
        return max((s.detokenizer.num_output_tokens() for s in states if s is not None and s.detokenizer), default=0)


    async def reach_core(self, deadline_s: float = 5.0) -> None:
        """Until every running request has reached the engine core (is known to vLLM's output
        processor, which sends a request to the core as it registers it), so that a pause sent
        next aborts or drains all of them and none joins after it under the next weights. The
        gate is closed meanwhile, so no request joins; a request vLLM already finished leaves
        ``_running`` when its output is taken. Nothing to wait for where this vLLM does not
        expose its output processor's requests."""
        ids = getattr(getattr(self.llm, "output_processor", None), "external_req_ids", None)
        end = time.monotonic() + deadline_s
        while ids is not None and any(rid not in ids for rid in self._running) and time.monotonic() < end:
            await asyncio.sleep(0.001)


def _exit(proc) -> str:
    """How an engine core process ended, for the dead engine's reason."""
    code = proc.exitcode
    if code is None:
        return f"pid {proc.pid} still running: its engine or one of its workers failed"
    if code < 0:
        try:
            return f"pid {proc.pid} killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"pid {proc.pid} killed by signal {-code}"
    return f"pid {proc.pid} exited with code {code}"


def _versions(spans: list | None, n: int, fallback: int) -> list[int]:
    """Per-token versions of one request segment from vLLM's weight-version spans (the
    version the engine core held when it produced each token), ``fallback`` where absent."""
    out = [fallback] * n
    for span in spans or []:
        if span.version.lstrip("-").isdigit():
            lo, hi = min(span.start, n), min(span.end, n)
            out[lo:hi] = [int(span.version)] * (hi - lo)
    return out
