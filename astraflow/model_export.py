"""``astraflow export``: a committed weight version of a run, written as an HF model directory.

A run's weights live in its weight store (``RUN_DIR/weights``) as DCP shards in the trainer's
layout: HF names from the torch backend, Megatron's from the Megatron backend. Users take the
trained model elsewhere (transformers, vLLM, the next run's ``policies[].model``) as an HF
directory: config.json, safetensors shards, the tokenizer. The export

1. reads the version under a reader's hold, so retention cannot delete it mid-read and a live
   run may go on publishing, and maps it to HF names (``weightconv.to_hf_state_dict``);
2. loads it strictly into the architecture of the config the trainer published with it (every
   tensor present, each of the right shape) and casts it to the dtype asked for;
3. writes model, tokenizer and generation config next to OUT, loads that directory back the way
   a user will (``model_loading.load_model``) and checks it: every tensor as intended, and the
   architecture scoring the version's probe (the log-probs the trainer published with the
   weights). A directory that fails is never renamed to OUT;
4. records where the model came from in ``OUT/astraflow_export.json``.

It holds about one copy of the model in the exported dtype at a time (a node that can hold the
model can export it): the version is read and cast tensor by tensor, the built model is freed once
written, the copy loaded back is checked against the sha256 of each cast tensor, and the probe
upcasts one decoder layer at a time.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import re
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import yaml

from astraflow.export_dir import (PROVENANCE, ExportError, check_out, check_same_vocabulary, check_space,
                                  copy_model_files, put_in_place, readable_as_umask_allows, resolve_out,
                                  staging_dir, with_older_readers_keys)
from storage.paths import RunPaths

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: nats, mean over the probe: the exported architecture with the published tensors must score the
#: probe this close to the trainer (summation order differs, a wrong config is off by far more)
ARCH_TOLERANCE = 0.01
#: nats: weights narrowed to a smaller dtype than the trainer published score the probe this close
#: (rounding moves it a little, a wrong config far more)
NARROWED_TOLERANCE = 0.1
#: config keys that describe the trainer's copy, not the model
_NOT_CONFIG = ("_name_or_path", "dtype", "torch_dtype", "transformers_version")
#: read errors of a damaged version (a truncated shard, a missing or damaged metadata file)
_DAMAGED = (EOFError, ValueError, KeyError, RuntimeError, OSError)


def committed_versions(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Per policy, its committed versions oldest first: ``version``, ``train_steps``, ``dtype``,
    ``layout`` and ``committed_at`` from each manifest."""
    store = _store(run_dir)
    out: dict[str, list[dict[str, Any]]] = {}
    for policy in store.policies():
        rows = []
        for v in store.versions(policy):
            try:
                meta = store.manifest(policy, v).get("meta", {})
                committed_at = store.get(policy, v).committed_at
            except KeyError:  # retired since the listing
                continue
            except ValueError as err:  # a damaged manifest: listed as such, the others still are
                rows.append({"version": v, "damaged": str(err)})
                continue
            rows.append({"version": v, "train_steps": meta.get("train_steps"), "dtype": meta.get("dtype", "fp32"),
                         "layout": meta.get("layout", "hf"), "committed_at": committed_at})
        out[policy] = rows
    return out


def export_version(run_dir: str | Path, out: str | Path, *, policy: str | None = None, version: int | None = None,
                   dtype: str = "auto", tokenizer: str | Path | None = None, force: bool = False,
                   max_shard_size: int | str = "5GB", say: Callable[[str], None] = print) -> dict[str, Any]:
    """Write ``policy``'s committed ``version`` (the newest by default) of the run in ``run_dir``
    as an HF model directory ``out``, checked by loading it back; returns the provenance record
    written with it. ``dtype`` ``auto`` keeps the dtype the trainer published. The tokenizer
    comes from the policy's model directory unless ``tokenizer`` names another."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of auto, {', '.join(DTYPES)}")
    store = _store(run_dir)
    policy = _policy(store, policy, run_dir)
    out = resolve_out(Path(out))
    replacing = check_out(out, force)
    try:
        with ExitStack() as stack:
            version, _ = _hold(stack, store, policy, version, say)
            meta = store.manifest(policy, version).get("meta", {})
            if meta.get("sim"):
                raise ExportError(f"{policy} v{version} was published by the sim trainer, which trains no model: "
                                  "there are no weights to export")
            committed_at = store.get(policy, version).committed_at
            published = meta.get("dtype", "fp32")
            target = DTYPES[published if dtype == "auto" else dtype]
            source = Path(tokenizer) if tokenizer is not None else _model_dir(run_dir, policy)
            tok = _tokenizer(source, given=tokenizer is not None)
            if tokenizer is not None:
                check_same_vocabulary(tok, source, lambda: _model_dir(run_dir, policy))
            staging = staging_dir(out, stack)  # before the read: a directory that cannot be written fails at once
            say(f"reading {policy} v{version} ({meta.get('layout', 'hf')} layout, {published}) from {store.root}")
            model, digests = _build(meta, _tensors(store, policy, version, meta, target), source, target)
            _check_tokenizer(tok, model, source, tokenizer is not None)
            n_params = sum(p.numel() for p in model.parameters())
            check_space(staging, n_params * torch.finfo(target).bits // 8)
            say(f"writing {n_params / 1e6:.1f}M parameters as {_name(target)} to {out}")
            try:
                model.save_pretrained(staging, max_shard_size=max_shard_size)
                del model  # before the copy is loaded back: one copy at a time
                _release_freed()
                with_older_readers_keys(staging / "config.json")
                copy_model_files(source, staging, tok)
            except OSError as err:
                raise ExportError(f"{out}: the model cannot be written there ({err.strerror or err}); free space there "
                                  "or name another directory") from None
            back = _load_back(staging, out, target)
            _compare(back, digests)
            checked = _probe_check(back, meta, narrowed=target != torch.float32 and _name(target) != published)
            del back
            record = {"run_dir": str(Path(run_dir).resolve()), "policy": policy, "version": version,
                      "train_steps": meta.get("train_steps"), "committed_at": committed_at,
                      "published_dtype": published, "dtype": _name(target), "source_model": str(source),
                      "parameters": n_params, **checked, "exported_at": time.time()}
            (staging / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
            readable_as_umask_allows(staging)
            put_in_place(staging, out, replacing)
    except (MemoryError, RuntimeError) as err:  # torch's allocator says so in a RuntimeError
        if not isinstance(err, MemoryError) and "allocate" not in str(err):
            raise
        raise ExportError(f"{out}: not enough memory to export the model (it holds one copy of it in the exported "
                          "dtype and a tensor or decoder layer more; a Megatron-layout version is read whole): "
                          "export on a node with more memory") from None
    step = f" (train step {meta['train_steps']})" if meta.get("train_steps") is not None else ""
    say(f"exported {policy} v{version}{step} to {out}: loaded back, every tensor as written, the probe within "
        f"{checked['probe_error_nats']:.2g} nats of the trained weights")
    return record


def parse_size(text: str) -> int:
    """A shard size as ``--max-shard-size`` takes it: bytes, or a number with KB/MB/GB/TB
    (powers of 1000, as transformers reads them); more than zero."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?B)?\s*", str(text), re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        raise ExportError(f"--max-shard-size {text!r}: give bytes (more than 0) or a size with KB, MB, GB or TB: 5GB")
    return int(m.group(1)) * 1000 ** "BKMGT".index((m.group(2) or "B")[0].upper())


def _store(run_dir: str | Path):
    from storage.weights import WeightStore

    paths = RunPaths(run_dir)
    if not paths.weights.is_dir() and not paths.config.is_file():
        raise ExportError(f"{run_dir} is no run directory (it has neither config.yaml nor weights/): pass the "
                          "directory `astraflow run` wrote, its --run-dir")
    return WeightStore(paths.weights)


def _policy(store, policy: str | None, run_dir: str | Path) -> str:
    names = [p for p in store.policies() if store.versions(p)]
    if policy is not None:
        if policy not in names:
            raise ExportError(f"--policy {policy}: {run_dir} has no committed weights of that policy; "
                              f"it has {', '.join(names) or 'none yet'}")
        return policy
    if not names:
        raise ExportError(f"{run_dir} has no committed weight version yet: wait for the trainer's first "
                          "published version (`astraflow status` shows each policy's version)")
    if len(names) > 1:
        raise ExportError(f"{run_dir} trains {len(names)} policies ({', '.join(names)}): pass --policy NAME")
    return names[0]


def _version(store, policy: str, version: int | None) -> int:
    versions = store.versions(policy)
    if version is None:
        return versions[-1]
    if version not in versions:  # one newer than the newest was never committed; an older one was deleted
        why = (f"v{version} is not committed yet" if version > versions[-1] else "the run keeps only the newest "
               "storage.keep_versions of them (older ones are deleted as training goes)")
        raise ExportError(f"--version {version}: {policy} has committed versions {_ranges(versions)}; {why}")
    return version


def _hold(stack: ExitStack, store, policy: str, version: int | None, say: Callable[[str], None]) -> tuple[int, bool]:
    """Hold the version against retention for the whole export (``stack`` releases it): the
    newest when none is asked for, taken again if retention removed it first. ``(version,
    held)``: not held where the store's readers directory cannot be written."""
    from storage.weights import DamagedVersion, VersionNotCommitted

    for _ in range(5):
        chosen = _version(store, policy, version)
        try:
            stack.enter_context(store.hold(policy, chosen))
            return chosen, True
        except DamagedVersion as err:
            raise ExportError(f"{policy} v{chosen} is damaged ({err}); export another version: --version N of "
                              "those `astraflow export RUN_DIR --list` shows") from None
        except VersionNotCommitted:
            if version is not None:  # retired between the listing and the hold
                raise ExportError(f"--version {version}: {policy} v{version} was deleted by the run's retention "
                                  f"just now; committed: {_ranges(store.versions(policy))}") from None
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            say(f"no read hold taken ({err.strerror}): reading {policy} v{chosen} checked against its checksums")
            return chosen, False
    raise ExportError(f"{policy}: each newest version was deleted by retention before it could be held; the run "
                      "publishes faster than it keeps versions: raise storage.keep_versions")


def _ranges(versions: list[int]) -> str:
    return ", ".join(f"v{v}" for v in versions) if len(versions) <= 6 else f"v{versions[0]} ... v{versions[-1]}"


def _model_dir(run_dir: str | Path, policy: str) -> Path:
    """The policy's model directory as the run's saved config names it (its tokenizer is there)."""
    cfg_file = RunPaths(run_dir).config
    try:
        saved = yaml.safe_load(cfg_file.read_text())
        model = next(p["model"] for p in saved["policies"] if p.get("name") == policy)
    except (OSError, yaml.YAMLError, KeyError, TypeError, StopIteration, AttributeError):
        raise ExportError(f"{cfg_file} does not name {policy}'s model directory (a run directory holds the "
                          "config it started with); pass --tokenizer DIR, a directory holding the policy's "
                          "tokenizer files") from None
    return Path(str(model)).expanduser()


def _tokenizer(source: Path, given: bool):
    """The tokenizer in ``source``: a model directory (checked as runs check it) or, given with
    ``--tokenizer``, a directory of tokenizer files alone (checked against the model on export;
    what transformers raises for it names neither the option nor the fix, so it is said here)."""
    from astraflow.model_loading import TOKENIZER_FILES, load_tokenizer

    if given and not (source / "config.json").exists():
        from transformers import AutoTokenizer

        fix = "pass the directory holding the policy's tokenizer files (save_pretrained's), or its model directory"
        if not any(any(source.glob(name)) for name in TOKENIZER_FILES):
            raise ExportError(f"--tokenizer {source} has no tokenizer files (none of tokenizer.json, tokenizer.model, "
                              f"vocab.json + merges.txt, vocab.txt): {fix}")
        try:
            return AutoTokenizer.from_pretrained(source)
        except Exception as err:
            raise ExportError(f"--tokenizer {source}: transformers cannot load a tokenizer there "
                              f"({type(err).__name__}: {err}); {fix}") from None
    try:
        return load_tokenizer(source)
    except (ValueError, OSError) as err:
        raise ExportError(f"{err}; or pass --tokenizer DIR, a directory holding the policy's tokenizer files"
                          if not given else str(err)) from None


def _tensors(store, policy: str, version: int, meta: dict[str, Any],
             target: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The version's tensors in HF names, floating ones cast to ``target``, every file checked
    against the manifest's sha256 first (a damaged shard is refused, not exported). Read one by one
    (``WeightStore.iter_tensors``): the published copy of one tensor is held at a time. A Megatron
    version is read whole: its fused tensors map to HF names only all together."""
    if meta.get("layout", "hf") != "hf":
        state = _read(store, policy, version)
        while state:
            name, tensor = state.popitem()
            yield name, tensor.to(target) if tensor.is_floating_point() else tensor
        return
    from torch.distributed.checkpoint.api import CheckpointException

    from storage.weights import ChecksumMismatch, DamagedVersion

    tensors = store.iter_tensors(policy, version)
    while True:
        try:
            name, tensor = next(tensors)
        except StopIteration:
            return
        except (ChecksumMismatch, DamagedVersion, CheckpointException, *_DAMAGED) as err:
            raise _damaged(err, policy, version) from None
        if tensor.is_floating_point() and tensor.dtype != target:
            tensor = tensor.to(target)
            _release_freed()  # the published copy and the read's buffers, before the next tensor is read
        yield name, tensor


def _read(store, policy: str, version: int) -> dict[str, torch.Tensor]:
    """The version's tensors in HF names, all at once, every file checked against the manifest's
    sha256 (a damaged shard is refused, not exported)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from astraflow.weightconv import to_hf_state_dict
    from storage.weights import ChecksumMismatch, DamagedVersion

    try:
        raw = store.load(policy, version, verify=True, hold=False)
    except (ChecksumMismatch, DamagedVersion, *_DAMAGED) as err:
        raise _damaged(err, policy, version) from None
    except CheckpointException as err:  # DCP's wrapper of what failed inside its read
        raise _damaged(err, policy, version) from None
    meta = store.manifest(policy, version).get("meta", {})
    try:
        return to_hf_state_dict(raw, meta)
    except (KeyError, ValueError) as err:
        raise ExportError(f"{policy} v{version} cannot be mapped to HF names ({type(err).__name__}: {err}); its "
                          "manifest's meta names its layout and, for Megatron shards, the HF config") from None


def _damaged(err: BaseException, policy: str, version: int) -> BaseException:
    """What a failed read of the version says: ``MemoryError`` when memory ran out (torch's
    allocator says so in a ``RuntimeError``; DCP wraps what failed in its read), else the version
    is damaged or cannot be read."""
    wrapped = [e for e, _ in getattr(err, "failures", {}).values()]
    if any(isinstance(e, MemoryError) or "allocate" in str(e) for e in [err, *wrapped]):
        return MemoryError(f"reading {policy} v{version}")
    if isinstance(err, OSError) and err.errno in (errno.ENOMEM, errno.EACCES):
        return ExportError(f"{policy} v{version} cannot be read ({err.strerror or err})")
    return ExportError(f"{policy} v{version} is damaged ({type(err).__name__}: {err}): export another version "
                       "(`astraflow export RUN_DIR --list`)")


def _config(meta: dict[str, Any], source: Path):
    from transformers import AutoConfig

    cfg = dict(meta.get("config") or meta.get("hf_config") or {})
    if not cfg:  # a version whose manifest carries no config: the policy's model directory has it
        try:
            return AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise ExportError(f"the version's manifest has no model config and {source} has no usable "
                              f"config.json ({err}); pass --tokenizer DIR, the policy's model directory") from None
    for key in _NOT_CONFIG:
        cfg.pop(key, None)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _build(meta: dict[str, Any], tensors: Iterator[tuple[str, torch.Tensor]], source: Path, target: torch.dtype):
    """``(model, digests)``: the model of the published config holding ``tensors`` (``_tensors``,
    cast to ``target``; strictly: no tensor missing or extra, every shape right), with the source's
    generation config; and each tensor's dtype and ``_digest``, what the written copy must load back to."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _config(meta, source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state, digests, too_big = {}, {}, []
    for name, tensor in tensors:
        if target == torch.float16 and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            too_big.append(name)
        digests[name] = (tensor.dtype, _digest(tensor))
        state[name] = tensor
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ExportError(f"the weights do not fit the architecture of the config published with them "
                          f"({str(err).splitlines()[0]} ...): the version and its manifest do not belong "
                          "together") from None
    del state
    model.tie_weights()
    model.to(target)  # the buffers the version does not hold (left on the meta device)
    if too_big:
        raise ExportError(f"{len(too_big)} tensors (first {too_big[0]}) exceed fp16's range: export as bf16 or fp32")
    if (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    return model, digests


def _release_freed() -> None:
    """Hand freed tensors' memory back to the system: glibc keeps blocks below its mmap threshold
    in the heap, where a copy mapped from files cannot reuse them. A no-op without ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """The C library's ``malloc_trim``, or None where it has none (not glibc)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal digests are equal tensors, bit for bit."""
    h = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _check_tokenizer(tok, model, source: Path, given: bool) -> None:
    """A tokenizer with ids past the model's vocabulary belongs to another model."""
    size = model.config.get_text_config().vocab_size
    if tok.vocab_size > size:
        where = f"--tokenizer {source}" if given else f"the tokenizer of {source}"
        raise ExportError(f"{where} has {tok.vocab_size} tokens, more than the model's vocabulary of {size}: it is "
                          "another model's; pass --tokenizer DIR with the policy's own tokenizer files")


def _load_back(staging: Path, out: Path, target: torch.dtype):
    """The written directory loaded as a user will (``astraflow run``'s loader), in its dtype."""
    from astraflow.model_loading import load_model

    try:
        return load_model(staging, dtype=target)[0]
    except ValueError as err:
        raise ExportError(f"the written model does not load back: {str(err).replace(str(staging), str(out))}"
                          ) from None


def _compare(model, digests: dict[str, tuple[torch.dtype, str]]) -> None:
    """Every tensor the model loaded equals the version's, cast as it was written: compared by
    ``_digest``, so the version's tensors need not be held next to the loaded copy. A tensor the
    architecture keeps wider than written (``_keep_in_fp32_modules``: loaded back upcast) is
    narrowed again first, which is exact for a value that was written narrow."""
    written = model.state_dict()
    for name, (dtype, digest) in digests.items():
        got = written.get(name)
        if got is not None and got.dtype != dtype and got.is_floating_point() and dtype.is_floating_point \
                and torch.finfo(got.dtype).bits > torch.finfo(dtype).bits:
            got = got.to(dtype)
        if got is None or _digest(got) != digest:
            raise ExportError(f"the written model's {name} differs from the version's: nothing was exported")


def _probe_check(model, meta: dict[str, Any], narrowed: bool) -> dict:
    """The loaded model, run in fp32 as the trainer scored it (``probe.compute_in_fp32``), against the version's
    probe: its published weights score it as the trainer did (a config that does not describe
    them is off by far more); weights narrowed to a smaller dtype within ``NARROWED_TOLERANCE``."""
    from astraflow.probe import compute_in_fp32, probe_error, teacher_forced_logprobs

    probe = meta.get("probe") or {}
    if not probe.get("logprobs"):  # a version published without a probe: the tensors' check is all there is
        return {"probe_error_nats": 0.0, "probe_checked": False}
    compute_in_fp32(model)
    err = probe_error(probe["logprobs"], teacher_forced_logprobs(model, probe["tokens"]))
    tolerance = NARROWED_TOLERANCE if narrowed else ARCH_TOLERANCE
    if not err <= tolerance:
        raise ExportError(f"the exported model scores the version's probe {err:.3g} nats away from the trainer "
                          f"(tolerance {tolerance}): the published config does not describe the trained model, "
                          "nothing was exported")
    return {"probe_error_nats": err, "probe_checked": True}


def _name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)
