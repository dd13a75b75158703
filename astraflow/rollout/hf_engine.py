"""``HFEngine``: the inference engine of a RaaS node (plain ``transformers`` model, CPU or one GPU).

Many asyncio episodes on a node call ``await engine.generate(...)`` one request at a time; the
engine gathers every request pending at that moment and decodes them as one left-padded
batch with its own decode loop over the model's KV cache. Owning the loop (instead of calling
``model.generate``) gives two things the trainer needs:

* exact behaviour log-probs: the log-softmax of the fp32 logits at temperature 1 of every
  sampled token, equal to a teacher-forced forward of the same weights on the same tokens
  (``dtype="bf16"`` computes in bf16, as GPU engines do: the trainer's fp32 log-probs then
  differ a little from these, and the loss's importance ratio accounts for it);
* weight swaps between two decoding steps (partial rollout).

Asynchronous overlap "weight swap vs in-flight generation": ``load_weights`` may be called at
any time, from any thread. When no batch is decoding the weights are replaced at once. While a
batch is decoding the new weights are held as *pending* and applied between two steps; the
engine then re-encodes the batch's tokens so far with the new weights (the KV cache of the old
weights is dropped), so every token after the swap is sampled from, and carries the version
and exact log-prob of, the new weights; tokens before it keep the old version. Invariant: a
token's (version, log-prob) always describe the weights that produced its distribution.

A swap lands mid-batch only while at least ``swap_min_remaining`` decoding steps are left
(default 16); closer to the batch's end the batch finishes on its weights and the swap
follows it. Re-encoding costs a prefill of every row, which for short generations costs more
than the few fresher tokens are worth (a sequence's staleness is set by its oldest token
anyway).

Requests that arrive while a batch is decoding wait for the next batch. A batch's prefill
forwards each distinct prompt once (a group's samples share theirs) and copies its KV cache to
the rows that have it; each row samples from a stream of its own (``seeds``), so neither the
sharing nor the batch's other rows change a request's tokens.

The forward passes run on the event loop's own thread, one step at a time, yielding to the
loop between steps (finished episodes, lease replies and new requests are handled there).
Handing each step to a worker thread instead would cost two GIL hand-offs per decoded token,
which a busy RaaS node process pays in tokens/s (``benchmarks/rollout_overhead.py``); torch
releases the GIL inside its kernels, so the node's threads (the segment writer's commits, the
weight poll's reads) still run during a step; its coroutines wait for the step to end.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from astraflow.agents.chat import turn_stop_ids
from astraflow.rollout.engine import SWAP_MIN_REMAINING, Generation, SamplingParams
from astraflow.rollout.hf_checks import check_cached_decoding, row_indexable
from astraflow.rollout.seeds import seeded, uniforms

log = logging.getLogger("astraflow.rollout")

#: ``HFEngine(dtype=...)``: the engine's weights and compute
DTYPES = ("fp32", "bf16")


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    #: the seed of the request's sampling stream (``seeds.uniforms``)
    seed: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class HFEngine:
    """transformers engine implementing ``astraflow.rollout.engine.InferenceEngine``.

    ``model`` is a path to an HF causal-LM directory or an already loaded ``(model, tokenizer)``
    pair. ``max_batch_size`` caps the sequences decoded together; ``swap_min_remaining``: a
    weight swap lands mid-batch only with at least this many decoding steps left (0: always at
    the next step; see the module docstring); ``seed`` seeds the requests that come without
    a seed of their own (each request samples from its own stream: ``seeds``);
    ``device`` is ``auto`` (a GPU when torch sees one), ``cpu`` or ``cuda[:N]``: the model,
    the KV cache and sampling live there, finished tokens come back to the host once per step.
    ``dtype`` is ``fp32`` or ``bf16``: the weights and the forward passes (the logits are cast
    to fp32 for sampling and log-probs). Published weights of either dtype are cast to the
    engine's on load: bf16 ones go into a bf16 engine as they are and into an fp32 engine
    upcast, both exact; fp32 ones into a bf16 engine are rounded. bf16 decodes
    faster where the hardware has it (GPUs; CPUs with AVX512-BF16/AMX;
    ``benchmarks/engine_dtype.py``); on GPUs bf16 is the usual engine dtype.
    """

    def __init__(
        self,
        model: str | Any,
        *,
        tokenizer: Any = None,
        version: int = -1,
        max_batch_size: int = 256,
        swap_min_remaining: int = SWAP_MIN_REMAINING,
        seed: int = 0,
        device: str = "auto",
        dtype: str = "fp32",
    ) -> None:
        from astraflow.models import load_model, resolve_device, warn_if_bf16_is_emulated

        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            self.model, self.tokenizer = load_model(model)
        else:
            if tokenizer is None:
                raise ValueError("HFEngine(model_object) needs tokenizer=...; or pass a model directory")
            self.model, self.tokenizer = model, tokenizer
        self.device = resolve_device(device)
        if dtype not in DTYPES:
            raise ValueError(f"HFEngine: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.model.to(self.device)
        self._vocab = self.model.get_input_embeddings().num_embeddings
        # transformers >= 5.2x calls the KV cache ``cache``; earlier 5.x (the vLLM extra pins
        # < 5.20) ``past_key_values``: pass it under whichever name this model's forward takes
        fwd = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in fwd else "past_key_values"
        from astraflow.models import pad_id

        # the pad token, else eos, else 0: padded positions are masked out whatever they hold
        self._pad_id = pad_id(self.tokenizer)
        #: a decoding step passes the mask of its new tokens only, not the whole row's: for
        #: architectures whose cached step reads the mask as covering its inputs (state-space models)
        self._step_mask_only = False
        if not 0 <= self._pad_id < self._vocab:
            raise ValueError(f"HFEngine: the tokenizer's pad/eos id {self._pad_id} lies outside the model's "
                             f"{self._vocab} embeddings: the tokenizer belongs to another model")
        #: the prefill forwards each distinct prompt of a batch once (``_prefill``); turned off
        #: where the model's KV cache cannot be indexed by row
        self.share_prefill = True
        self.model.eval()  # no dropout: the check compares two forwards
        # before a cast: the architecture's own behaviour, not bf16 rounding
        check_cached_decoding(self, both_masks=True)
        if dtype == "bf16":
            for p in self.model.parameters():  # the weights only: float buffers (RoPE's inverse
                p.data = p.data.to(torch.bfloat16)  # frequencies) stay fp32, or long positions drift
            warn_if_bf16_is_emulated(self.device, "rollout.engine.dtype")
            check_cached_decoding(self, both_masks=False)  # and in bf16
        if max_batch_size < 1:
            raise ValueError(f"HFEngine: max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        if swap_min_remaining < 0:
            raise ValueError(f"HFEngine: swap_min_remaining must be >= 0, got {swap_min_remaining}")
        self.swap_min_remaining = swap_min_remaining
        self.version = version
        stops = turn_stop_ids(self.tokenizer)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        stops |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])  # a model's list of ends
        self._stop_ids = frozenset(s for s in stops if s is not None)
        self._max_positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        #: seeds of requests that come without one (outside an episode's ``episode_seeds``)
        self._seeds = np.random.default_rng(seed)
        self._pending: list[_Request] = []
        self._lock = threading.Lock()
        self._pending_weights: tuple[dict[str, torch.Tensor], int] | None = None
        self._decoding = False
        self._loop_task: asyncio.Task | None = None
        self._stats = dict(tokens=0, requests=0, batches=0, busy_seconds=0.0, weight_swaps=0,
                           decode_steps=0, reencoded_rows=0, prefill_rows=0)

    # -- protocol ------------------------------------------------------------------------
    async def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Generation:
        params = seeded(params)
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise ValueError("HFEngine.generate: prompt_tokens is empty")
        if min(prompt) < 0 or max(prompt) >= self._vocab:  # would fail the whole batch it joins
            bad = next(t for t in prompt if not 0 <= t < self._vocab)
            raise ValueError(f"HFEngine.generate: token id {bad} is outside the model's vocabulary of {self._vocab}: "
                             "the tokenizer does not belong to the model (check the model directory's files)")
        if params.max_new_tokens < 1:
            raise ValueError(f"HFEngine.generate: max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if not params.greedy:  # a bad value would fail every request of the batch this one joins
            if not (math.isfinite(params.temperature) and params.temperature > 0):
                raise ValueError(f"HFEngine.generate: temperature must be a finite number > 0, got "
                                 f"{params.temperature}; use greedy=True for argmax")
            if not 0 < params.top_p <= 1:
                raise ValueError(f"HFEngine.generate: top_p must be in (0, 1], got {params.top_p}")
        if self._max_positions and len(prompt) + params.max_new_tokens > self._max_positions:
            raise ValueError(
                f"HFEngine.generate: prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the model's {self._max_positions} positions; shorten one of them"
            )
        loop = asyncio.get_running_loop()
        if params.seed is not None and not isinstance(params.seed, numbers.Integral):
            raise ValueError(f"HFEngine.generate: seed must be an integer, got {params.seed!r}")
        # any integer names a stream (a workflow's hash() may be negative): the engine takes it mod 2**64
        seed = int(params.seed) % 2**64 if params.seed is not None else int(self._seeds.integers(2**63))
        req = _Request(prompt, params, loop.create_future(), seed=seed)
        self._pending.append(req)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._serve())
        return await req.future

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Replace the weights (HF names; cast to the engine's dtype). Applied now if idle,
        else between two steps."""
        self._check_fits(state_dict)  # now, decoding or not: a swap held for later cannot fail then
        with self._lock:
            if not self._decoding:
                self._apply(state_dict, version)
                return
            owned = {k: torch.as_tensor(v).detach().clone() for k, v in state_dict.items()}
            self._pending_weights = (owned, version)

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._stats.items()}

    def close(self) -> None:
        """Nothing to release (kept for the engine protocol)."""

    # -- capabilities: an engine in the caller's process ---------------------------------
    @property
    def pid(self) -> int | None:
        return None

    @property
    def dead(self) -> str | None:
        return None  # if it dies, the node's process dies with it

    @property
    def restartable(self) -> bool:
        return False

    def restart(self) -> None:
        raise RuntimeError("HFEngine runs in the node's process and cannot be restarted; "
                           "set rollout.engine.process: true for a restartable engine process")

    @property
    def loads_versions_itself(self) -> bool:
        return False

    def load_version(self, weights_root: str, policy: str, version: int, *, use_deltas: bool = False,
                     full_resync_every: int = 10) -> None:
        raise RuntimeError("HFEngine does not read the weight store itself: read the version with "
                           "weight_sync.VersionReader and pass it to load_weights")

    def take_load_records(self) -> list[dict[str, Any]]:
        return []  # the node's own reader records what it loads

    # -- internals -----------------------------------------------------------------------
    def _check_fits(self, state_dict: Mapping[str, Any]) -> None:
        """``ValueError`` unless ``state_dict`` has every weight of the model (a tied head may be
        absent), nothing else, and each with the model's shape."""
        own = self.model.state_dict()
        tied = "lm_head.weight" if self.model.config.tie_word_embeddings else None
        missing = [k for k in own if k not in state_dict and k != tied]
        unexpected = [k for k in state_dict if k not in own]
        shapes = [f"{k} {tuple(torch.as_tensor(v).shape)} != {tuple(own[k].shape)}" for k, v in state_dict.items()
                  if k in own and tuple(torch.as_tensor(v).shape) != tuple(own[k].shape)]
        if missing or unexpected or shapes:
            raise ValueError(f"HFEngine.load_weights: state dict does not match the model (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, shapes {shapes[:3]}); publish weights with HF parameter "
                             "names of this model")

    def _apply(self, state_dict: Mapping[str, Any], version: int) -> None:
        sd = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        missing, unexpected = self.model.load_state_dict(sd, strict=False)  # copy_ casts each tensor
        # tied heads may be absent from a publisher's state dict; anything else is an error
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(
                f"HFEngine.load_weights: state dict does not match the model (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}); publish weights with HF parameter names"
            )
        self.version = int(version)
        self._stats["weight_swaps"] += 1

    def _take_pending_weights(self) -> bool:
        with self._lock:
            if self._pending_weights is None:
                return False
            sd, version = self._pending_weights
            self._pending_weights = None
            self._apply(sd, version)
            return True

    async def _serve(self) -> None:
        while self._pending:
            batch = self._pending[: self.max_batch_size]
            del self._pending[: len(batch)]
            batch = [r for r in batch if not r.future.done()]  # requests of cancelled episodes: not decoded
            if not batch:
                continue
            with self._lock:
                self._decoding = True
            t0 = time.perf_counter()
            try:
                await self._decode(batch)
            except Exception as exc:  # the failure belongs to the batch's episodes: hand it to them
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            finally:
                with self._lock:
                    self._decoding = False
                try:
                    self._take_pending_weights()
                except Exception:  # checked when handed over: the batch's answers must still go out
                    log.exception("HFEngine: applying held weights failed; keeping v%d", self.version)
            dt = time.perf_counter() - t0
            self._stats["busy_seconds"] += dt
            self._stats["batches"] += 1
            for r in batch:
                self._stats["requests"] += 1
                self._stats["tokens"] += len(r.tokens)
                if r.future.done():  # its episode was cancelled (its deadline) while it decoded
                    continue
                r.future.set_result(
                    Generation(
                        tokens=np.asarray(r.tokens, dtype=np.int32),
                        logprobs=np.asarray(r.logprobs, dtype=np.float32),
                        versions=np.asarray(r.versions, dtype=np.int32),
                        finish_reason=r.finish_reason or "length",
                        engine_seconds=dt,
                    )
                )

    async def _decode(self, batch: list[_Request]) -> None:
        n = len(batch)
        plen = max(len(r.prompt) for r in batch)
        ids = torch.full((n, plen), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, plen), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, plen - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, plen - len(r.prompt):] = 1
        max_new = max(r.params.max_new_tokens for r in batch)
        dev = self.device
        ids, mask = ids.to(dev), mask.to(dev)
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in batch], device=dev)
        greedy = torch.tensor([r.params.greedy for r in batch], device=dev)
        top_p = torch.tensor([1.0 if r.params.greedy else r.params.top_p for r in batch], device=dev)
        stops = [self._stop_ids | set(r.params.stop_token_ids) for r in batch]
        seeds = np.array([r.seed for r in batch], dtype=np.uint64)
        active = [True] * n

        logits, cache = self._prefill(batch, ids, mask)
        for _step in range(max_new):
            draws = np.array([len(r.tokens) for r in batch], dtype=np.uint64)
            tok, lp = self._sample(logits, temps, greedy, top_p, uniforms(seeds, draws))
            tok_host, lp_host = tok.tolist(), lp.tolist()  # one device -> host copy per step
            for i, r in enumerate(batch):
                if not active[i]:
                    continue
                if r.future.done():  # its episode was cancelled: the row stops, the batch may end sooner
                    r.finish_reason, active[i] = "cancelled", False
                    continue
                t = tok_host[i]
                r.tokens.append(t)
                r.logprobs.append(lp_host[i])
                r.versions.append(self.version)
                if t in stops[i]:
                    r.finish_reason, active[i] = "stop", False
                elif len(r.tokens) >= r.params.max_new_tokens:
                    r.finish_reason, active[i] = "length", False
            if not any(active):
                break
            # finished rows keep decoding a pad token (ignored) so the batch stays rectangular
            nxt = torch.where(torch.tensor(active, device=dev), tok, torch.full_like(tok, self._pad_id))
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=dev)], dim=1)
            self._stats["decode_steps"] += 1
            await asyncio.sleep(0)  # let the loop run between two steps
            if self._pending_weights is not None and self._steps_left(batch, active) >= self.swap_min_remaining \
                    and self._take_pending_weights():
                # new weights: re-encode everything so far, the old KV cache is stale
                self._stats["reencoded_rows"] += n
                logits, cache = self._forward(ids, mask, None)
            else:
                logits, cache = self._forward(ids[:, -1:], mask, cache)

    def _prefill(self, batch: list[_Request], ids: torch.Tensor, mask: torch.Tensor):
        """The batch's first forward. Where rows repeat a prompt (a group's samples share theirs),
        each distinct prompt is forwarded once and its logits and KV cache copied to the rows that
        have it: the same numbers for a fraction of the work. A cache that cannot be indexed by row
        turns this off for good (the full forward then runs, as for a batch of distinct prompts)."""
        slot: dict[tuple[int, ...], int] = {}
        heads, rows = [], []
        for i, r in enumerate(batch):
            key = tuple(r.prompt)
            if key not in slot:
                slot[key] = len(heads)
                heads.append(i)
            rows.append(slot[key])
        if not self.share_prefill or len(heads) == len(batch):
            self._stats["prefill_rows"] += len(batch)
            return self._forward(ids, mask, None)
        first = torch.tensor(heads, device=ids.device)
        logits, cache = self._forward(ids[first], mask[first], None)
        if not row_indexable(cache):
            self.share_prefill = False
            return self._prefill(batch, ids, mask)
        index = torch.tensor(rows, device=ids.device)
        cache.batch_select_indices(index)
        self._stats["prefill_rows"] += len(heads)
        return logits[index], cache

    @staticmethod
    def _steps_left(batch: list[_Request], active: list[bool]) -> int:
        """Decoding steps the batch still needs (its longest unfinished request)."""
        return max(r.params.max_new_tokens - len(r.tokens) for r, a in zip(batch, active) if a)

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache):
        """One forward; ``ids`` is the whole (left-padded) batch when ``cache`` is None, else
        the last column. Returns fp32 logits of the last position and the new cache."""
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        pos = pos[:, -ids.shape[1]:]
        if cache is not None and self._step_mask_only:
            mask = mask[:, -ids.shape[1]:]
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1, :].float(), getattr(out, self._cache_kw)

    def _sample(self, logits, temps, greedy, top_p, u: np.ndarray):
        """Each row's token: argmax where greedy, else the inverse of the (top-p) distribution's
        CDF at the row's own uniform ``u`` (``seeds``), so no row's draw depends on another's."""
        logp = torch.log_softmax(logits, dim=-1)  # temperature 1: the behaviour log-probs
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if bool((top_p < 1.0).any()):
            sp, si = probs.sort(dim=-1, descending=True)
            keep = (sp.cumsum(-1) - sp) < top_p[:, None]
            sp = sp * keep
            probs = torch.zeros_like(probs).scatter(-1, si, sp)
        # float64: a token of the distribution's tail still adds to the sum it follows
        cum = probs.double().cumsum(-1)
        if not bool(torch.isfinite(cum[:, -1]).all()):
            raise ValueError("HFEngine: the model's logits are not finite (an overflow in its forward, e.g. in "
                             "bf16): nothing can be sampled from them")
        target = torch.from_numpy(u).to(cum.device) * cum[:, -1]
        sampled = torch.searchsorted(cum, target[:, None], right=True)[:, 0].clamp(max=cum.shape[-1] - 1)
        best = logits.argmax(-1)
        # a token the distribution excludes can come out only where rounding put the target at the CDF's end
        sampled = torch.where(probs.gather(-1, sampled[:, None])[:, 0] > 0, sampled, best)
        tok = torch.where(greedy, best, sampled)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
