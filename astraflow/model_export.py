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
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from storage.paths import RunPaths, tmp_sibling

#: the file the export writes next to the model, naming its origin (and marking OUT as an export)
PROVENANCE = "astraflow_export.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: nats, mean over the probe: the exported architecture with the published tensors must score the
#: probe this close to the trainer (summation order differs, a wrong config is off by far more)
ARCH_TOLERANCE = 0.01
#: config keys that describe the trainer's copy, not the model
_NOT_CONFIG = ("_name_or_path", "dtype", "torch_dtype", "transformers_version")


class ExportError(ValueError):
    """A run, version or output directory the export cannot use; the message names the fix."""


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
            rows.append({"version": v, "train_steps": meta.get("train_steps"), "dtype": meta.get("dtype", "fp32"),
                         "layout": meta.get("layout", "hf"), "committed_at": committed_at})
        out[policy] = rows
    return out


def export_version(run_dir: str | Path, out: str | Path, *, policy: str | None = None, version: int | None = None,
                   dtype: str = "auto", tokenizer: str | Path | None = None, force: bool = False,
                   max_shard_size: str = "5GB", say: Callable[[str], None] = print) -> dict[str, Any]:
    """Write ``policy``'s committed ``version`` (the newest by default) of the run in ``run_dir``
    as an HF model directory ``out``, checked by loading it back; returns the provenance record
    written with it. ``dtype`` ``auto`` keeps the dtype the trainer published. The tokenizer
    comes from the policy's model directory unless ``tokenizer`` names another."""
    store = _store(run_dir)
    policy = _policy(store, policy, run_dir)
    version = _version(store, policy, version)
    meta = store.manifest(policy, version).get("meta", {})
    published = meta.get("dtype", "fp32")
    if dtype != "auto" and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of auto, {', '.join(DTYPES)}")
    target = DTYPES[published if dtype == "auto" else dtype]
    source = Path(tokenizer) if tokenizer is not None else _model_dir(run_dir, policy)
    tok = _tokenizer(source, given=tokenizer is not None)
    out = Path(out)
    replacing = _check_out(out, force)

    say(f"reading {policy} v{version} ({meta.get('layout', 'hf')} layout, {published}) from {store.root}")
    state = _read(store, policy, version, say)
    model = _build(meta, state, source, target)
    n_params = sum(p.numel() for p in model.parameters())
    _check_space(out, model, target)
    tmp = tmp_sibling(out)
    try:
        say(f"writing {n_params / 1e6:.1f}M parameters as {_name(target)} to {out}")
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tok.save_pretrained(tmp)
        del model
        checked = _verify(tmp, meta, state, target)
        record = {"run_dir": str(Path(run_dir).resolve()), "policy": policy, "version": version,
                  "train_steps": meta.get("train_steps"), "committed_at": store.get(policy, version).committed_at,
                  "published_dtype": published, "dtype": _name(target), "source_model": str(source),
                  "parameters": n_params, **checked, "exported_at": time.time()}
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        _put_in_place(tmp, out, replacing)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"exported {policy} v{version} (train step {meta.get('train_steps', '?')}) to {out}: loaded back, every "
        f"tensor as written, the probe within {checked['probe_error_nats']:.2g} nats of the trained weights")
    return record


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
    if version not in versions:
        raise ExportError(f"--version {version}: {policy} has committed versions {_ranges(versions)}; the run keeps "
                          "only the newest storage.keep_versions of them (older ones are deleted as training goes)")
    return version


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
    ``--tokenizer``, a directory of tokenizer files alone (checked against the model on export)."""
    from astraflow.model_loading import load_tokenizer

    try:
        if given and not (source / "config.json").exists():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(source)
        return load_tokenizer(source)
    except (ValueError, OSError) as err:
        fix = "" if given else "; or pass --tokenizer DIR, a directory holding the policy's tokenizer files"
        raise ExportError(f"{err}{fix}") from None


def _check_out(out: Path, force: bool) -> bool:
    """Whether ``out`` holds an earlier export to replace; refuses a directory of other files."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file: name a directory for the model")
    if not out.exists() or not any(out.iterdir()):
        return out.exists()
    if not (out / PROVENANCE).exists():
        raise ExportError(f"{out} already holds files that are no export of this tool: name a new directory "
                          "(an export replaces only an earlier export, with --force)")
    if not force:
        raise ExportError(f"{out} holds an earlier export ({out / PROVENANCE}): pass --force to replace it, or "
                          "name a new directory")
    return True


def _read(store, policy: str, version: int, say: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """The version's tensors in HF names; without a hold where the store's readers directory
    cannot be written (a run directory of another user), checking every file's sha256 instead."""
    from astraflow.weightconv import to_hf_state_dict

    try:
        raw = store.load(policy, version)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        say(f"no read hold taken ({err.strerror}): reading {policy} v{version} checked against its checksums")
        raw = store.load(policy, version, verify=True, hold=False)
    meta = store.manifest(policy, version).get("meta", {})
    try:
        return to_hf_state_dict(raw, meta)
    except (KeyError, ValueError) as err:
        raise ExportError(f"{policy} v{version} cannot be mapped to HF names ({type(err).__name__}: {err}); its "
                          "manifest's meta names its layout and, for Megatron shards, the HF config") from None


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


def _build(meta: dict[str, Any], state: dict[str, torch.Tensor], source: Path, target: torch.dtype):
    """The model of the published config holding ``state`` (strictly: no tensor missing or
    extra, every shape right), cast to ``target``, with the source's generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _config(meta, source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ExportError(f"the weights do not fit the architecture of the config published with them "
                          f"({str(err).splitlines()[0]} ...): the version and its manifest do not belong "
                          "together") from None
    model.tie_weights()
    model.to(target)
    if target == torch.float16:
        too_big = [k for k, v in model.state_dict().items() if v.is_floating_point() and v.device.type != "meta"
                   and not torch.isfinite(v).all()]
        if too_big:
            raise ExportError(f"{len(too_big)} tensors (first {too_big[0]}) exceed fp16's range: export as bf16 "
                              "or fp32")
    if (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    return model


def _check_space(out: Path, model, target: torch.dtype) -> None:
    need = sum(p.numel() for p in model.parameters()) * torch.finfo(target).bits // 8
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(parent).free
    except OSError as err:
        raise ExportError(f"{parent}: cannot write the model there ({err.strerror or err}); name a directory "
                          "you can write to") from None
    if free < need * 1.05:
        raise ExportError(f"{parent} has {free / 2**30:.1f} GiB free and the model needs {need / 2**30:.1f} GiB: "
                          "free space there or name another directory (--dtype bf16 halves an fp32 model)")


def _verify(tmp: Path, meta: dict[str, Any], state: dict[str, torch.Tensor], target: torch.dtype) -> dict:
    """Load ``tmp`` as a user will and compare: every tensor equal to the intended one, and the
    architecture scoring the version's probe as the trainer did. Returns the probe's errors."""
    from astraflow.model_loading import load_model
    from astraflow.probe import probe_error, probe_tokens, teacher_forced_logprobs

    try:
        model, _ = load_model(tmp, dtype=torch.float32)
    except ValueError as err:
        raise ExportError(f"the written model does not load back: {err}") from None
    written = model.state_dict()
    for name, tensor in state.items():
        if name not in written or not torch.equal(written[name], tensor.to(target).float()):
            raise ExportError(f"the written model's {name} differs from the version's: nothing was exported")
    probe = meta.get("probe") or {}
    tokens = probe.get("tokens") or probe_tokens(int(model.config.vocab_size))
    served = teacher_forced_logprobs(model, tokens)
    if not probe.get("logprobs"):  # a version published without a probe: the tensors' check is all there is
        return {"probe_error_nats": 0.0, "probe_checked": False}
    arch = probe_error(probe["logprobs"], teacher_forced_logprobs(model, tokens, {k: v.float() for k, v in
                                                                                  state.items()}))
    if not arch <= ARCH_TOLERANCE:
        raise ExportError(f"the exported model scores the version's probe {arch:.3g} nats away from the trainer "
                          f"(tolerance {ARCH_TOLERANCE}): the published config does not describe the trained "
                          "model, nothing was exported")
    return {"probe_error_nats": probe_error(probe["logprobs"], served), "probe_checked": True}


def _put_in_place(tmp: Path, out: Path, replacing: bool) -> None:
    if replacing:  # an empty directory, or an earlier export with --force
        old = tmp_sibling(out)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)
