"""Weight updates of a ``VLLMEngine``, each checked against the version's probe.

How a version gets into vLLM (``rollout.engine.vllm.weight_update``):

* ``in_place``: vLLM's weight-transfer protocol for RL (pause, start update, update, finish,
  resume) with our ``astraflow_store`` backend (``vllm_worker``): each worker reads the version
  from the weight store itself (full shards or held version + delta, Megatron layouts
  converted) and loads it through vLLM's layerwise reload. Only the version number crosses.
* ``reload`` / ``recreate``: vLLM's older ``reload_weights`` RPC (wrong log-probs on the CPU
  build), or a new ``AsyncLLM`` (always right, an engine start), on an HF directory written
  from the version before generation stops. ``auto``: ``in_place`` where the protocol exists.

A silent wrong update is the failure guarded against: after every update the engine scores
the version's probe sequence (``astraflow.probe``, published by the trainer in the manifest)
and compares with the trainer's log-probs, and with those of the version it held before: two
versions a training step apart are often closer than ``probe_tolerance``, so an engine left on
the old weights would pass a check against the new version alone (``check_probe``). An
in-place update off by more than ``probe_tolerance``, or nearer the held version than the new
one, is redone by re-creating the engine. If the fresh engine is right, the in-place path
served wrong weights on this build: a warning names the build and that engine re-creates for
every later update. If the fresh engine is as far off, the gap is the engine's numerics (a
bf16 engine against the trainer's fp32 probe): the tolerance rises to twice it, up to a ceiling
past which the version itself is broken. A version without a probe is loaded unverified
(logged once), as is one whose check fails after its weights are in. The update holds its version
against retention from before it stops generation: a version retired meanwhile is refused
with the engine's weights and requests untouched. An in-place load that fails part-way leaves
the engine ``dead`` (its tensors may mix two versions): its node restarts it and loads the
newest version. One that fails before touching the weights keeps the old ones.

Asynchronous overlap "weight update vs in-flight generation": an update closes the engine's
gate (new requests and resumptions wait), then either aborts the running requests, which
resume from their generated prefix once the update is done, or (fewer than
``swap_min_remaining`` tokens left) lets them finish first; requests vLLM still holds in its
queue behind a full batch are then taken back the same way. The probe runs before the gate
reopens, so no request sees weights that failed their check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from astraflow.rollout.vllm_probe import NUMERICS_CEILING, ProbeCheck, check_probe, judge
from astraflow.rollout.weight_sync import VersionReader
from storage.weights import DamagedVersion, VersionNotCommitted, WeightStore

if TYPE_CHECKING:
    from astraflow.rollout.vllm_engine import VLLMEngine

log = logging.getLogger("astraflow.rollout")

#: files of a model directory that are weights (not copied into a re-created engine's directory)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")


class Updater:
    """Serialises a ``VLLMEngine``'s weight updates on its event loop and records each."""

    def __init__(self, engine: "VLLMEngine", build: str | None = None, native: bool | None = None):
        """``build`` and ``native`` (whether the weight-transfer protocol exists) are read from
        the installed vLLM unless given."""
        from astraflow.rollout import vllm_setup

        self.engine = engine
        self.build = vllm_setup.build_name() if build is None else build
        wanted = engine.options.weight_update
        native = vllm_setup.has_weight_transfer() if native is None else native
        if wanted == "in_place" and not native:
            raise ValueError(f"rollout.engine.vllm.weight_update: in_place needs vLLM's weight-transfer protocol, "
                             f"which {self.build} lacks; use auto or recreate")
        self.mode = ("in_place" if native else "recreate") if wanted == "auto" else wanted
        if wanted != "auto":
            why = "rollout.engine.vllm.weight_update asks for it"
        else:
            why = f"auto: the build {'has' if native else 'lacks'} vLLM's weight-transfer protocol"
        log.info("vLLM engine: weight updates %s on %s (%s)", self.mode, self.build, why)
        self.tolerance = engine.options.probe_tolerance
        self._lock: asyncio.Lock | None = None
        self._queued = 0  # updates scheduled and not yet done: the gate stays closed
        self._readers: dict[tuple, VersionReader] = {}
        self._records: list[dict[str, Any]] = []
        self._newest_asked = -1
        self._scratch = Path(tempfile.mkdtemp(prefix="astraflow-vllm-"))
        self._warned_unverified = False
        self._touching = False  # an in-place load is changing the engine's weights
        self._changed = False  # this update has changed the engine's weights (its check may still fail)
        self._paused = False  # this update has paused generation (to resume if it fails)
        #: (probe, noise, version) of the version the engine holds, verified: ``noise`` is how far
        #: off its probe the engine scored it (``check_probe``); None where unverified
        self._held: tuple[Mapping[str, Any], float, int] | None = None
        self.last_read: dict[str, Any] = {}

    # -- called from any thread --------------------------------------------------------------
    def submit_store(self, root: str, policy: str, version: int, use_deltas: bool, every: int):
        """Schedule loading a committed version; returns a ``concurrent.futures.Future``."""
        self._newest_asked = max(self._newest_asked, version)
        fut = asyncio.run_coroutine_threadsafe(
            self._update(version, store=(root, policy, use_deltas, every)), self.engine._loop)
        fut.add_done_callback(self._report)
        return fut

    def submit_state(self, state: Mapping[str, Any], version: int):
        """Schedule loading HF-named tensors: they go into a private weight store first, so
        the same paths as for a committed version load them."""
        root = self._scratch / "store"
        WeightStore(root, keep_last=2).publish("engine", version, dict(state), meta={"layout": "hf"})
        return self.submit_store(str(root), "engine", version, False, 1)

    def take_records(self) -> list[dict[str, Any]]:
        out, self._records = self._records, []
        return out

    def forget_readers(self) -> None:
        """A restarted engine holds the model directory again: deltas start from full shards,
        and the next check has no verified version to compare with."""
        self._readers.clear()
        self._held = None

    def _report(self, fut: concurrent.futures.Future) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        eng = self.engine
        if eng._dead:
            log.warning("vLLM engine: %s", eng._dead)
        else:
            log.warning("vLLM engine could not load weights (%s: %s); it keeps v%d",
                        type(fut.exception()).__name__, fut.exception(), eng.serving_version)
        if eng.version > eng.serving_version and self._newest_asked <= eng.version:
            eng.version = eng.serving_version

    # -- on the engine's loop -------------------------------------------------------------------
    async def _update(self, version: int, store: tuple[str, str, bool, int]) -> None:
        eng = self.engine
        eng._gate.clear()  # first, before any await: requests submitted after this wait for it
        self._queued += 1
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:
                if version < self._newest_asked or version <= eng.serving_version:
                    return  # superseded by a newer version asked for meanwhile
                try:
                    await self._apply(version, *store)
                except BaseException as err:
                    if self._touching:  # some tensors may hold the new version and some the old
                        eng._dead = (f"loading v{version} into the vLLM engine in place failed part-way "
                                     f"({type(err).__name__}: {err}); its weights may be half-updated, so it "
                                     "serves nothing until it is restarted")
                    elif self._paused and eng.llm is not None and not eng.llm.errored:
                        await eng.llm.resume_generation()  # nothing changed: keep serving the weights it has
                    raise
                finally:
                    self._touching = False
        finally:
            self._queued -= 1
            if not self._queued:
                eng._gate.set()

    async def _apply(self, version: int, root: str, policy: str, use_deltas: bool, every: int) -> None:
        eng = self.engine
        t0 = time.time()
        self._changed = self._paused = False
        store = WeightStore(root)
        # held from before generation stops: a version retired meanwhile is refused here, with the
        # engine's weights and running requests untouched, and none is retired while it is read
        with store.hold(policy, version):
            probe = store.manifest(policy, version).get("meta", {}).get("probe")
            if self._held is None and probe is not None and self.mode != "recreate":
                await self._verify_held(store, policy)
            prepared = None
            if self.mode != "in_place":  # read and written while the running requests still generate
                prepared = await asyncio.to_thread(self._write_model_dir, root, policy, version, use_deltas, every)
            aborted = await self._quiesce()
            record: dict[str, Any] = {"policy": policy, "version": version, "mode": self.mode, "engine": "vllm",
                                      "resumed_requests": aborted}
            try:
                await self._load_and_check(version, root, policy, use_deltas, every, probe, record, prepared)
            except Exception as err:
                if self._touching or not self._changed or eng.dead:
                    raise
                if record.get("probe_error", 0.0) > self.tolerance or record.get("stale"):
                    # measured wrong, and redoing it failed
                    eng._dead = (f"{policy} v{version} was loaded wrong (its probe {record['probe_error']:.3f} "
                                 f"nats off) and re-creating the engine on it failed ({type(err).__name__}: {err}), "
                                 "so it serves nothing until it is restarted")
                    raise
                # the version's weights are in; only their check failed: serve them under their own
                # version (the label must name the weights that sample), unverified and said so
                record["unverified"] = f"{type(err).__name__}: {err}"
                log.warning("vLLM engine: %s v%d is loaded but checking it failed (%s); it is served unverified",
                            policy, version, record["unverified"])
                await eng.llm.resume_generation()
        eng.serving_version = version
        eng._stats["weight_swaps"] += 1
        record["load_s"] = time.time() - t0
        self._records.append(record)

    async def _load_and_check(self, version: int, root: str, policy: str, use_deltas: bool, every: int,
                              probe: Mapping[str, Any] | None, record: dict[str, Any],
                              prepared: Path | None = None) -> None:
        """Load ``version`` the current way (``prepared``: its model directory, written before
        generation stopped), resume the engine's scheduler, check the probe against the
        version's and the held version's (re-creating on a wrong or stale in-place update);
        fills ``record``."""
        eng = self.engine
        held_probe, noise, held_version = self._held or (None, 0.0, None)
        if self.mode == "in_place":
            record["read"] = await self._in_place(root, policy, version, use_deltas, every)
        elif self.mode == "reload":
            await self._reload(prepared or self._write_model_dir(root, policy, version, use_deltas, every), version)
        else:
            await self._recreate(prepared or self._write_model_dir(root, policy, version, use_deltas, every), version)
        self._held = None  # the weights changed: nothing verified until the check below passes
        if self.mode != "in_place":
            record["read"] = self.last_read
        await eng.llm.resume_generation()
        if probe is None:
            if not self._warned_unverified:
                self._warned_unverified = True
                log.warning("vLLM engine: %s v%d carries no probe (meta.probe) and is loaded unverified",
                            policy, version)
            return
        # a re-created engine is right by construction: only the tolerance can fault it
        check = check_probe(probe, await self._score(probe), held_probe if self.mode != "recreate" else None, noise)
        record["probe_error"] = check.err
        if check.err_held is not None:
            record.update(probe_held_version=held_version, probe_error_held=check.err_held, probe_apart=check.apart)
        if check.stale:
            record["stale"] = True
        if not check.passed(self.tolerance) and self.mode != "recreate":
            await self._recreate(self._write_model_dir(root, policy, version, use_deltas, every), version)
            await eng.llm.resume_generation()
            fresh = check_probe(probe, await self._score(probe), held_probe, noise)
            record["probe_error_after_fallback"] = fresh.err
            record["fallback"] = "recreate"
            self._judge(check, fresh, policy, version, held_version)
            check = fresh
        elif check.err > self.tolerance:
            log.warning("vLLM engine: %s v%d's probe log-probs are %.3f nats off the trainer's on a freshly "
                        "created engine (tolerance %.3f)", policy, version, check.err, self.tolerance)
        if math.isfinite(check.err):
            self._held = (probe, check.err, version)

    def _judge(self, check: ProbeCheck, fresh_check: ProbeCheck, policy: str, version: int,
               held_version: int | None) -> None:
        """After an in-place update whose probe ``check`` failed and a re-created engine's
        ``fresh_check`` on the same version: a fresh engine is right by construction, so if it
        is about as far off, the gap is this engine's numerics (its dtype), not the update: the
        tolerance rises to twice it and updates stay in place; if it is as near the held
        version, the two versions cannot be told apart on this engine. Otherwise the in-place
        path served wrong (or the held version's) weights on this build: every later update
        re-creates."""
        err, fresh = check.err, fresh_check.err
        tolerance, wrong = judge(err, fresh, self.tolerance, check.stale, fresh_check.stale)
        if not math.isfinite(fresh):
            log.warning("vLLM engine: a freshly created engine scores %s v%d's probe with non-finite log-probs: "
                        "the version (its weights or its probe) is broken, not the update", policy, version)
        elif fresh > max(NUMERICS_CEILING, self.tolerance):
            log.warning("vLLM engine: a freshly created engine scores %s v%d's probe %.3f nats off the trainer's, "
                        "more than an engine's dtype explains (%.2f): the version (its weights, their conversion "
                        "or its probe) is broken, not the update; the probe tolerance stays %.3f (raise "
                        "rollout.engine.vllm.probe_tolerance if this engine's numerics are that far off)",
                        policy, version, fresh, NUMERICS_CEILING, self.tolerance)
        if tolerance != self.tolerance:
            self.tolerance = tolerance
            log.warning("vLLM engine: a freshly created engine scores %s v%d's probe %.3f nats off the trainer's "
                        "(the engine's dtype, rollout.engine.dtype, against the trainer's fp32 probe): the probe "
                        "tolerance of this engine is now %.3f nats", policy, version, fresh, self.tolerance)
        if wrong and err <= tolerance:  # near the new version, but nearer the held one
            log.warning("vLLM engine: after the %r update to %s v%d its log-probs of the version's probe were "
                        "%.3f nats off the trainer's and %.3f off those of v%s, the version it held (a re-created "
                        "engine: %.3f and %.3f): %s served the held version's weights after a %r update; the engine "
                        "was re-created on the version, as it will be for every later update", self.mode, policy,
                        version, err, check.err_held, held_version, fresh, fresh_check.err_held, self.build,
                        self.mode)
        elif wrong:
            log.warning("vLLM engine: after the %r update to %s v%d its log-probs of the version's probe were "
                        "%.3f nats off the trainer's (a re-created engine: %.3f): %s served wrong weights after "
                        "a %r update; the engine was re-created on the version, as it will be for every later update",
                        self.mode, policy, version, err, fresh, self.build, self.mode)
        if wrong:
            self.mode = "recreate"

    async def _quiesce(self) -> int:
        """Stop generation for an update: abort the running requests (they resume from their
        prefix afterwards) when enough tokens are left, else let them finish. Returns how
        many were aborted."""
        eng = self.engine
        await eng.reach_core()
        running = list(eng._running.values())
        if running and eng.steps_left() >= eng.swap_min_remaining:
            for r in running:
                r.resume = True
            self._paused = True
            await eng.llm.pause_generation(mode="abort", clear_cache=True)
            return len(running)
        self._paused = True
        await eng.llm.pause_generation(mode="wait", clear_cache=True)
        return await self._take_back()

    async def _take_back(self) -> int:
        """Abort the requests still in flight, to resume from their prefix after the update.
        After a drain these are the requests vLLM had queued behind its full batch: a paused
        scheduler keeps them and would start them on the next weights before their check, or
        shut them down inside an engine being re-created. Returns how many."""
        eng = self.engine
        left = list(eng._running.values())
        for r in left:
            r.resume = True
        if left and eng.llm is not None:
            await eng.llm.abort([r.rid for r in left])
        return len(left)

    async def _in_place(self, root: str, policy: str, version: int, use_deltas: bool, every: int) -> dict:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        llm = self.engine.llm
        self._touching = True
        await llm.start_weight_update()
        await llm.update_weights(WeightTransferUpdateRequest(update_info={
            "weights_root": root, "policy": policy, "version": version, "use_deltas": use_deltas,
            "full_resync_every": every}))
        if self.engine.labels_versions:
            await llm.finish_weight_update(weight_version=str(version))
        else:
            await llm.finish_weight_update()
        self._touching, self._changed = False, True
        return (await llm.collective_rpc("astraflow_last_read"))[0]  # rank 0's read: full or delta

    async def _reload(self, model_dir: Path, version: int) -> None:
        self._touching = True
        await self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        self._touching, self._changed = False, True
        if self.engine.labels_versions:
            try:
                await self.engine.llm.update_weight_version(str(version))
            except Exception as err:  # vLLM would go on naming the old version for the new weights
                self.engine.labels_versions = False
                log.warning("vLLM engine: relabelling its tokens with v%d failed (%s: %s); the engine labels them "
                            "itself from now on", version, type(err).__name__, err)

    async def _recreate(self, model_dir: Path, version: int) -> None:
        eng = self.engine
        await self._take_back()  # none after a pause: a request left inside would never end
        await eng._shutdown()
        await eng._start(str(model_dir), version)
        self._changed = True
        eng._stats["recreations"] += 1
        for old in self._scratch.glob("v*"):
            if old != model_dir:
                shutil.rmtree(old, ignore_errors=True)

    def _write_model_dir(self, root: str, policy: str, version: int, use_deltas: bool, every: int) -> Path:
        """An HF model directory holding ``version``: the engine's model directory's config and
        tokenizer files, the version's tensors as ``model.safetensors``."""
        from safetensors.torch import save_file

        key = (root, use_deltas, every)
        if key not in self._readers:
            self._readers[key] = VersionReader(*key)
        state, self.last_read = self._readers[key].read(policy, version)
        out = self._scratch / f"v{version}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in Path(self.engine.model_path).iterdir():
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(f, out / f.name)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
        return out

    async def _verify_held(self, store: WeightStore, policy: str) -> None:
        """Score the version the engine serves against that version's own probe, while it still
        generates, so that this update's check can tell the new version from it (``check_probe``'s
        ``held``): an engine starts, and restarts, on weights no update has verified, and the first
        versions of a run are often closer than the tolerance. Nothing is learnt where that version
        is gone from the store, has no probe, or scores off it."""
        held = self.engine.serving_version
        try:
            probe = store.manifest(policy, held).get("meta", {}).get("probe")
        except (VersionNotCommitted, DamagedVersion, OSError):
            return
        if probe is not None and (check := check_probe(probe, await self._score(probe))).passed(self.tolerance):
            self._held = (probe, check.err, held)

    async def _score(self, probe: Mapping[str, Any]) -> list[float]:
        """The engine's prompt log-probs of the probe's tokens (``log p(tokens[i] | tokens[:i])``
        for ``i >= 1``, as the trainer's ``probe["logprobs"]``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tokens = [int(t) for t in probe["tokens"]]
        final = None
        async for out in self.engine.llm.generate(TokensPrompt(prompt_token_ids=tokens),
                                                  SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                                  f"probe-{time.monotonic_ns()}"):
            final = out
        return [d[t].logprob for d, t in zip(final.prompt_logprobs[1:], tokens[1:])]

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)
