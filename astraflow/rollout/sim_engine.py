"""``SimEngine`` (``rollout.engine.type: sim``): an ``InferenceEngine`` without a model.

It answers like a serving engine with continuous batching on the configured hardware would, in
time and in shape, and does no tensor work, so many nodes fit in one process:

* a request waits in a queue until one of ``max_batch`` slots is free, then ``ttft_s`` (the
  scheduling and first step's latency, taken side by side) before its prompt is processed:
  the engine prefills ``prefill_tokens_per_s`` prompt tokens a second, one prompt at a time in
  the order the requests were admitted, so a batch of long prompts reaches its first tokens
  one after another, not all at once; alone, a request's first token comes after
  ``ttft_s + prompt_tokens / prefill_tokens_per_s``;
* the requests decoding together share the engine's throughput: with ``b`` of them the
  aggregate rate is ``min(b * single_tokens_per_s, peak_tokens_per_s)``, each getting ``1/b``
  of it (one request alone decodes at the single rate; past the knee each slows down as the
  batch fills); a request still before its first token holds a slot but takes no share, and
  its first token is an event (the batch, so every rate, changes then);
* a prompt being prefilled and the decoding requests share the engine's time, half each (as a
  chunked prefill puts prompt chunks into the decoding steps): prefilling costs the decoders
  about the time it takes;
* its response length is drawn from a lognormal (``length_mean``, ``length_sigma``), capped at
  ``max_new_tokens`` (``finish_reason`` ``length``; else it ends with the eos token, ``stop``);
  token ids are drawn uniformly from the vocabulary, log-probs from a plausible range;
* every token carries the version the engine held when it was generated; ``load_version``
  reads only the version's manifest and takes ``load_seconds``.

Time goes through a ``Clock``: ``RealClock`` sleeps (scaled by ``time_scale``); a test passes
a ``VirtualClock`` and the engine's timeline runs without waiting. All randomness comes from
the engine's seed, drawn in the order requests arrive: under a ``VirtualClock`` a run repeats
exactly; under the real clock arrival order, and with it the draws, varies from run to run.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from astraflow.rollout.engine import Generation, SamplingParams
from astraflow.rollout.sim_config import SimEngineConfig
from astraflow.rollout.sim_clock import Clock, RealClock
from astraflow.rollout.sim_tokenizer import EOS_ID, FIRST_ORDINARY_ID, SimTokenizer


@dataclass
class _Request:
    prompt_len: int
    target: int  # tokens to generate
    stops: bool  # ends with eos (else cut by max_new_tokens)
    future: asyncio.Future
    submitted: float
    delay_left: float = 0.0  # simulated seconds of ``ttft_s`` left
    prompt_left: float = 0.0  # prompt tokens left to prefill
    made: float = 0.0  # tokens generated so far (fractional between events)
    versions: list[int] = field(default_factory=list)


class SimEngine:
    """A simulated engine of one replica (see the module docstring)."""

    def __init__(self, cfg: SimEngineConfig, *, seed: int = 0, version: int = 0, clock: Clock | None = None):
        self.cfg = cfg
        self.profile = cfg.profile()
        self.clock = clock or RealClock(cfg.time_scale)
        self.tokenizer = SimTokenizer(cfg.vocab_size)
        self.version = version
        #: when (simulated time) each version began to be served: tokens are tagged by it
        self._changes: list[tuple[float, int]] = [(-math.inf, version)]
        self._rng = np.random.default_rng(seed)
        self._queue: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._arrived: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stats = {"tokens": 0.0, "busy_s": 0.0, "requests": 0.0, "batches": 0.0}

    # ------------------------------------------------------------------ the protocol
    async def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Generation:
        if self._server is None or self._server.done():
            self._arrived = asyncio.Event()
            self._server = asyncio.get_running_loop().create_task(self._serve(), name="sim engine")
        target, stops = self.response_length(params.max_new_tokens)
        req = _Request(prompt_len=len(prompt_tokens), target=target, stops=stops,
                       future=asyncio.get_running_loop().create_future(), submitted=self.clock.now())
        # a request cancelled (its episode given up) frees its slot, and the prefill, at once
        req.future.add_done_callback(lambda _: self._arrived.set())
        self._queue.append(req)
        self._arrived.set()
        return await req.future

    def response_length(self, max_new_tokens: int) -> tuple[int, bool]:
        """A response length drawn from the configured lognormal, and whether it ends on eos
        (False: cut at ``max_new_tokens``)."""
        sigma = self.cfg.length_sigma
        mu = math.log(self.cfg.length_mean) - sigma * sigma / 2  # so that the mean is length_mean
        n = max(1, int(round(self._rng.lognormal(mu, sigma))))
        return (n, True) if n < max_new_tokens else (max_new_tokens, False)

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Take ``version`` (the tensors are ignored) after the configured load time."""
        self.clock.block(self.profile.load_seconds)
        self._serve_version(version)

    def _serve_version(self, version: int) -> None:
        """From now on generated tokens carry ``version`` (may be called from another thread)."""
        self._changes.append((self.clock.now(), int(version)))
        self.version = int(version)

    @property
    def loads_versions_itself(self) -> bool:
        return True

    def load_version(self, weights_root: str, policy: str, version: int, *, use_deltas: bool = False,
                     full_resync_every: int = 10) -> None:
        """Read only the manifest of committed ``version`` (it must be committed), wait the load
        time, serve it from then on."""
        from storage.weights import WeightStore

        t0 = time.time()
        manifest = WeightStore(weights_root).manifest(policy, version)
        self.clock.block(self.profile.load_seconds)
        self._serve_version(version)
        now = time.time()
        with self._lock:
            self._records.append({"policy": policy, "version": int(version), "mode": "sim", "load_s": now - t0,
                                  "commit_to_serving_s": now - float(manifest["committed_at"])})

    def take_load_records(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self._records = self._records, []
        return out

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def close(self) -> None:
        if self._server is not None and not self._server.done():
            try:
                self._server.get_loop().call_soon_threadsafe(self._server.cancel)
            except RuntimeError:  # its loop is already closed
                pass

    pid = None
    dead = None
    restartable = False

    def restart(self) -> None:
        raise RuntimeError("a sim engine lives in its node's process and cannot die alone")

    # ------------------------------------------------------------------ the timeline
    def _rate(self, batch: int) -> float:
        """Tokens per simulated second of each of ``batch`` requests decoding together."""
        p = self.profile
        return min(batch * p.single_tokens_per_s, p.peak_tokens_per_s) / batch

    async def _serve(self) -> None:
        """Advance the timeline from event to event: a request admitted, one finished, or one
        arriving (which may change the batch and so every request's rate)."""
        while True:
            # a request whose caller gave up (its episode was cancelled) is aborted
            self._active = [r for r in self._active if not r.future.done()]
            while self._queue and len(self._active) < self.profile.max_batch:
                req = self._queue.popleft()
                if req.future.done():
                    continue
                req.delay_left, req.prompt_left = self.profile.ttft_s, float(req.prompt_len)
                self._active.append(req)
                self._stats["batches"] += 1
            if not self._active:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            # only the requests past their first token share the decode rate, and only the first
            # admitted of those past ttft_s is prefilled; the next event is the first finish, end
            # of a ttft_s or end of the prompt being prefilled
            decoding = sum(1 for r in self._active if r.delay_left <= 0 and r.prompt_left <= 0)
            head = next((r for r in self._active if r.delay_left <= 0 < r.prompt_left), None)
            rate = self._rate(decoding) * (0.5 if head else 1.0) if decoding else 0.0
            prefill = self.profile.prefill_tokens_per_s * (0.5 if decoding else 1.0)
            dt = min(r.delay_left if r.delay_left > 0 else r.prompt_left / prefill if r is head
                     else math.inf if r.prompt_left > 0 else (r.target - r.made) / rate for r in self._active)
            self._arrived.clear()
            start = self.clock.now()
            elapsed = await self.clock.wait(self._arrived, dt)
            self._advance(start, elapsed, rate, head, prefill)

    def _advance(self, start: float, elapsed: float, rate: float, head: _Request | None = None,
                 prefill: float = 1.0) -> None:
        """Move every active request on by ``elapsed`` simulated seconds from ``start``: through
        its ``ttft_s``, its prompt (``head`` alone, at ``prefill`` tokens/s), else decoding at
        ``rate`` tokens/s (each request's share of the batch's rate); each new token is tagged
        with the version served when it was made."""
        self._stats["busy_s"] += elapsed
        changes = self._changes
        while len(changes) > 1 and changes[1][0] <= start:  # keep the version served at ``start``
            changes.pop(0)
        when = np.array([c[0] for c in changes])
        which = np.array([c[1] for c in changes], dtype=np.int32)
        # a request decodes at the next event's rate from then; a real clock's overshoot past its
        # prefill is decoded at this interval's rate (the single rate if none was decoding)
        rate = rate or self._rate(1)
        done = []
        for r in self._active:
            left, used = elapsed, 0.0
            if r.delay_left > 0:
                used = min(left, r.delay_left)
                r.delay_left -= used
                if r.delay_left < 1e-9:  # rounding must not leave an event a hair away
                    r.delay_left = 0.0
                left -= used  # > 0 only when a real clock overslept the delay's end
                if r.prompt_left > 0:
                    continue  # its prompt waits for the next event, behind the others admitted before
            if r.prompt_left > 0:
                if r is not head:
                    continue
                took = min(left, r.prompt_left / prefill)
                r.prompt_left -= took * prefill
                if r.prompt_left < 1e-6:
                    r.prompt_left = 0.0
                used += took
                left -= took  # > 0 only when a real clock overslept the prompt's end (see below)
                if r.prompt_left > 0:
                    continue
            made0 = r.made
            before = int(made0 + 1e-9)
            r.made = min(r.target, made0 + left * rate)
            if r.target - r.made < 1e-6:
                r.made = r.target
            whole = int(r.made + 1e-9)
            if whole > before:
                made_at = start + used + (np.arange(before, whole) + 1 - made0) / rate
                r.versions.extend(which[np.searchsorted(when, made_at - 1e-9, side="right") - 1].tolist())
            if whole >= r.target:
                done.append(r)
        for r in done:
            self._active.remove(r)
            self._finish(r)

    def _finish(self, r: _Request) -> None:
        n = r.target
        tokens = self._rng.integers(FIRST_ORDINARY_ID, self.cfg.vocab_size, size=n, dtype=np.int64).astype(np.int32)
        if r.stops:
            tokens[-1] = EOS_ID
        # sampled tokens under temperature 1 mostly have high probability: log-probs in (-3, 0]
        logprobs = -self._rng.exponential(0.4, size=n).clip(0, 3).astype(np.float32)
        self._stats["tokens"] += n
        self._stats["requests"] += 1
        if not r.future.done():
            r.future.set_result(Generation(
                tokens=tokens, logprobs=logprobs, versions=np.asarray(r.versions[:n], dtype=np.int32),
                finish_reason="stop" if r.stops else "length",
                engine_seconds=self.clock.now() - r.submitted))
