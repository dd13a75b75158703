"""Runtime room: what ``astraflow run`` checks on a run directory before anything starts, so that a
resume it cannot do is refused with a ValueError naming the fix (exit 2), not found by the
workers after they started: the policies, their committed weights and model architecture, the
data layer's saved state and the trajectory store's layout."""

from __future__ import annotations

import json
from pathlib import Path

from astraflow.config import RunConfig
from storage.atomic import write_atomically
from storage.paths import RunPaths


def check_resumable(cfg: RunConfig, run_dir: Path) -> None:
    """Before anything starts on a run directory that has weights: each policy's newest committed
    version must be readable and its files whole (``DamagedVersion``, a ValueError naming the
    file and the fix) and within ``run.max_steps``, the policies those of the run directory (a renamed policy would
    start afresh beside the old one's weights), the trajectory store of a layout this code reads,
    and the data layer's snapshot readable (``UnusableSnapshot``) with its rows in the store."""
    from astraflow.dataflow import durable
    from astraflow.runtime.placement import store_url
    from storage.weights import WeightStore

    paths = RunPaths(run_dir)
    _check_same_policies(cfg, paths)
    if paths.weights.is_dir():
        store = WeightStore(paths.weights)
        for pol in cfg.policies:
            latest = store.latest(pol.name)
            if latest is not None and latest.version > cfg.run.max_steps:
                raise ValueError(f"run.max_steps {cfg.run.max_steps} is below v{latest.version}, which policy "
                                 f"{pol.name} of this run directory already committed: set run.max_steps to "
                                 f"{latest.version} or more (more trains further), or start a new run directory")
            if latest is not None:  # a shard cut short would fail every node and trainer that loads it
                _check_sizes(store, pol.name, latest.version)
    _check_store_layout(store_url(cfg, paths))
    saved = None
    if cfg.dataflow.durable:
        try:
            saved = durable.load(paths.dataflow_snapshot)
        except durable.UnusableSnapshot as err:
            raise durable.UnusableSnapshot(
                f"{err}: move control/dataflow.snapshot and its control/dataflow.changes.* aside to resume from "
                "control/dataflow_state.json alone (the tasks the run had in flight end as dropped and new ones "
                "are rolled out), or start a new run directory") from None
    if saved is None:  # the data layer resumes from this one
        from astraflow.dataflow import record

        record.load(paths.dataflow_state)
    else:
        _check_rows_present(saved, store_url(cfg, paths))


def _check_store_layout(url: str) -> None:
    """An existing trajectory store must be one this code can open (a newer AstraFlow may have
    written a layout it does not read): else a ValueError naming the fix. Opening it read-only
    reads its layout record alone; a store not there yet is created by the run."""
    from storage.trajectories import open_trajectory_store

    if url.startswith("memory://"):  # in-process: none survives from an earlier start
        return
    try:
        open_trajectory_store(url, "r")
    except OSError:  # none yet (the run creates it), or unreadable: the run's own opening says so
        return
    except ValueError as err:
        raise ValueError(f"storage.trajectories: {err}. To run this AstraFlow version, set storage.trajectories "
                         "to a new store directory or start a new run directory (--run-dir)") from None


def _check_rows_present(saved: dict, url: str) -> None:
    """The rows the saved data layer holds must still be in the trajectory store (segments
    deleted to free space would fail every batch that names them): else a ValueError naming
    them and the fix."""
    from astraflow.dataflow import durable
    from storage.trajectories import open_trajectory_store

    try:
        missing = durable.missing_rows(saved, open_trajectory_store(url, "r"))
    except FileNotFoundError:  # the whole store is gone
        missing = {"every segment": n} if (n := len(durable.held_refs(saved))) else {}
    if missing:
        named = ", ".join(f"{seg} ({n})" for seg, n in sorted(missing.items())[:5])
        more = f" and {len(missing) - 5} more segments" if len(missing) > 5 else ""
        raise ValueError(
            f"{sum(missing.values())} rows the saved data layer still holds are gone from the trajectory store "
            f"{url}: {named}{more}. Put the deleted segments back, or resume without the saved buffers: move "
            "control/dataflow.snapshot and its control/dataflow.changes.* aside (the trainers continue from their "
            "weights, the tasks the run had in flight end as dropped), or start a new run directory")


#: what of a model's config.json the committed weights depend on: a resume loads them into the model
SIGNATURE_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def model_signature(model_dir: Path) -> dict:
    """The shape-giving fields of ``model_dir``'s config.json (``SIGNATURE_KEYS`` it has)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: config[k] for k in SIGNATURE_KEYS if k in config}


def trained_signature(store, policy: str) -> dict:
    """The ``SIGNATURE_KEYS`` of the model config that ``policy``'s newest committed version
    records in its manifest (``meta.config`` in the HF layout, ``meta.hf_config`` in the
    Megatron one); ``{}`` when there is none (simulated weights, no version)."""
    latest = store.latest(policy)
    if latest is None:
        return {}
    meta = store.manifest(policy, latest.version).get("meta")
    meta = meta if isinstance(meta, dict) else {}
    config = meta.get("config") if isinstance(meta.get("config"), dict) else meta.get("hf_config")
    if not isinstance(config, dict):
        return {}
    return {k: config[k] for k in SIGNATURE_KEYS if config.get(k) is not None}


def check_same_models(cfg: RunConfig, run_dir: Path) -> None:
    """A resume loads each policy's newest committed weights into the policy's model, which must
    therefore be of the architecture the run started with (recorded in ``control/models.json``):
    else a ValueError naming what differs and the fix, before any worker starts. Records the
    signatures of policies without committed weights yet; for a policy with weights and no record
    (a run directory of an AstraFlow that kept none), the one its newest version's manifest says."""
    from storage.weights import WeightStore

    paths = RunPaths(run_dir)
    record = paths.models_record
    try:
        known = json.loads(record.read_text()) if record.is_file() else {}
    except (OSError, ValueError):
        known = {}  # an unreadable record: written anew from the models of this start
    known = known if isinstance(known, dict) else {}
    store = WeightStore(paths.weights) if paths.weights.is_dir() else None
    now, refusals = dict(known), []
    for pol in cfg.policies:
        if cfg.simulated(pol) or not (pol.model / "config.json").is_file():
            continue
        mine, before = model_signature(pol.model), known.get(pol.name)
        trained = store is not None and bool(store.versions(pol.name))
        if trained and not isinstance(before, dict):  # no record yet: the weights say what they were trained as
            before = trained_signature(store, pol.name)
            if before:
                now[pol.name] = before
        # a key one config leaves out (its default) is not a difference: a re-save may write it out
        differs = ", ".join(f"{k} {before[k]!r} -> {mine[k]!r}" for k in SIGNATURE_KEYS
                            if k in mine and k in (before or {}) and before[k] != mine[k])
        if trained and differs:
            refusals.append(f"policies[{pol.name}].model: {pol.model} is not the architecture this run directory's "
                            f"weights were trained as ({differs}; recorded in {record}): a resume loads the "
                            "committed weights into this model. Point the policy at the model the run started "
                            "with, or start a new run directory (--run-dir)")
        if not trained:  # what the first weights will be trained as
            now[pol.name] = mine
    if now != known:  # written before a refusal too: the next start checks against the record
        paths.control.mkdir(parents=True, exist_ok=True)
        write_atomically(record, json.dumps(now, indent=1, sort_keys=True))
    if refusals:
        raise ValueError(refusals[0])


def _check_same_policies(cfg: RunConfig, paths: RunPaths) -> None:
    """A resume trains the policies the run directory has weights of (a renamed policy would
    start afresh beside the old one's weights), in the order its saved config lists them (their
    roles). Other settings may change (hardware, partitions, ``run.max_steps``; a changed workload
    is handled by the data layer)."""
    from storage.weights import WeightStore

    store = WeightStore(paths.weights)
    before = sorted(p for p in store.policies() if store.versions(p))
    names = sorted(p.name for p in cfg.policies)
    if before and before != names:
        raise ValueError(f"this run directory trains the policies {before}, the config names {names}: a resume "
                         "cannot rename, add or remove policies. Use the same policy names to resume it, or start "
                         "a new run directory (--run-dir)")
    # the workflow gives policies their roles by their order: reordered, the trained solver would verify
    order = [p.name for p in cfg.policies]
    saved = _saved_order(paths.config)
    if before and saved is not None and sorted(saved) == names and saved != order:
        raise ValueError(f"policies: this run directory trained them in the order {saved} (the workflow's roles, "
                         f"in {paths.config}), the config lists {order}: a resume would give each the other's role. "
                         "List them in the run's order, or start a new run directory (--run-dir)")


def _saved_order(config: Path) -> list[str] | None:
    """The policy names in the order the run directory's saved config lists them; None when it
    cannot be read (a resume then goes on unchecked, as one of a directory without a config)."""
    import yaml

    try:
        saved = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return None
    pols = saved.get("policies") if isinstance(saved, dict) else None
    if not isinstance(pols, list) or not all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in pols):
        return None
    return [p["name"] for p in pols]


def _check_sizes(store, policy: str, version: int) -> None:
    """Every file of a committed version there at the size its manifest records: a stat each,
    nothing read; ``DamagedVersion`` naming the first file cut short or missing, and the fix."""
    from storage.paths import version_dir
    from storage.weights import DamagedVersion

    vdir = version_dir(store.root, policy, version)
    for rel, rec in store.manifest(policy, version)["files"].items():
        want = rec.get("bytes") if isinstance(rec, dict) else None
        try:
            size = (vdir / rel).stat().st_size
        except FileNotFoundError:
            size = None
        if size is None or (isinstance(want, int) and size != want):
            have = "missing" if size is None else f"{size} bytes, its manifest records {want}"
            raise DamagedVersion(f"{vdir / rel} is damaged ({have}): move {vdir} out of the run directory to "
                                 "go on from the version before it, or restore the file")
