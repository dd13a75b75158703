"""What ``astraflow run`` says before it resumes a run directory: the version each policy goes
on from, and the settings changed since the directory's last start (its saved ``config.yaml``),
so that a resume with other settings is never silent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from astraflow.config import RunConfig
from storage.paths import RunPaths

#: changed settings named one by one; the rest are counted
MAX_NAMED = 8
#: characters of a value shown in the note
SHOWN_WIDTH = 40
#: settings whose change makes the previous run's open tasks mean something else (the data
#: layer drops them and rolls out afresh: ``dataflow.durable.fingerprint_of``, which also takes
#: the policies' names)
TASK_MEANING = ("workload.name", "workload.params", "workload.group_size", "workload.seed", "workload.workflow")


def resume_note(cfg: RunConfig, run_dir: Path) -> list[str]:
    """The lines to print before a resume; none for a directory without committed weights."""
    from storage.weights import WeightStore

    paths = RunPaths(run_dir)
    if not paths.weights.is_dir():
        return []
    store = WeightStore(paths.weights)
    at = {p.name: store.latest(p.name) for p in cfg.policies}
    if all(v is None for v in at.values()):
        return []
    going_on = ", ".join(f"{p} from v{v.version}" if v is not None else f"{p} from its initial model"
                         for p, v in at.items())
    lines = [f"resuming the run in {run_dir}: {going_on} (the newest committed weights)"]
    saved = _saved_config(paths.config)
    if saved is None:
        return lines
    now = cfg.model_dump(mode="json")
    defaults = _as_read_now(saved)
    changed = changed_settings(saved, now, defaults)
    if changed:
        given = _flat(cfg.model_dump(mode="json", exclude_unset=True))
        # a key the config leaves unset now runs at this version's default: the user changed
        # nothing there (a default an upgrade changed, or an override since dropped)
        mine = [c for c in changed if c[0] in given]
        dflt = [c for c in changed if c not in mine]
        if mine:
            lines.append(f"settings changed since its last start: {_named(mine)}")
        if dflt:
            lines.append("settings the config leaves unset, at this AstraFlow version's defaults, which differ from "
                         f"its last start (set them to keep the old values): {_named(dflt)}")
        names = [[p.get("name") for p in (c.get("policies") or []) if isinstance(p, dict)] for c in (saved, now)]
        if any(key.startswith(TASK_MEANING) for key, _, _ in changed) or names[0] != names[1]:
            lines.append("these change what the previous run's open tasks mean: they are dropped (config_changed) "
                         "and new ones rolled out; the ledger's counts and finished evaluations carry over")
    new = len(new_settings(saved, now, defaults))
    if new:
        some = f"{new} setting{'s' if new > 1 else ''}"
        at = "at their defaults" if new > 1 else "at its default"
        lines.append(f"{some} new in this AstraFlow version, {at}" if defaults is not None
                     else f"{some} not in the saved config (new in this AstraFlow version)")
    return lines


def changed_settings(before: dict[str, Any], after: dict[str, Any],
                     defaults: dict[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """(dotted key, before, after) for every setting that differs; a missing one is None. Keys
    in both configs come first, each group led by the models the policies load, then the workload
    (``_rank``). A key ``before`` lacks (new in this version) is a change only where ``after``
    differs from ``defaults``, ``before`` as this version reads it (``new_settings`` counts the
    others); without ``defaults``, never. Lists of named sections (policies, partitions) are
    compared by name."""
    old, new = _flat(before), _flat(after)
    fresh = set(new_settings(before, after, defaults))
    keys = [k for k in old.keys() | new.keys() if k not in fresh and old.get(k) != new.get(k)]
    keys.sort(key=lambda k: (k not in old or k not in new, _rank(k), k))
    return [(k, old.get(k), new.get(k)) for k in keys]


def new_settings(before: dict[str, Any], after: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """The dotted keys ``after`` has and ``before`` lacks that are at their defaults (the value
    ``defaults``, ``before`` as this version reads it, has): settings an older version did not
    write. Without ``defaults``, every key ``before`` lacks."""
    old, new = _flat(before), _flat(after)
    dflt = None if defaults is None else _flat(defaults)
    return sorted(k for k in new.keys() - old.keys() if dflt is None or (k in dflt and dflt[k] == new[k]))


def _rank(key: str) -> int:
    """0 for a policy's model (what the weights load into), 1 for the workload (what the tasks
    are), 2 for the rest: the changes a user most needs to see are named before the count."""
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "policies" and parts[2] == "model":
        return 0
    return 1 if parts[0] == "workload" else 2


def _as_read_now(saved: dict[str, Any]) -> dict[str, Any] | None:
    """The saved config as this version reads it (the settings it lacks at their defaults);
    None where it no longer validates (a moved model, say)."""
    from astraflow.config import config_from_dict

    try:
        return config_from_dict(saved).model_dump(mode="json")
    except Exception:  # whatever stops it, only the note is the poorer
        return None


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    if isinstance(value, list) and value and all(isinstance(x, dict) and "name" in x for x in value):
        out = {}
        for x in value:
            out.update(_flat({k: v for k, v in x.items() if k != "name"}, f"{prefix}.{x['name']}"))
        return out
    return {prefix: value}


def _saved_config(path: Path) -> dict[str, Any] | None:
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):  # nothing to compare with: the resume itself says the rest
        return None
    return saved if isinstance(saved, dict) else None


def _named(changed: list[tuple[str, Any, Any]]) -> str:
    """``changed`` one by one up to ``MAX_NAMED``, the rest counted."""
    named = "; ".join(_change(key, old, new) for key, old, new in changed[:MAX_NAMED])
    more = len(changed) - MAX_NAMED
    return named + (f"; and {more} more" if more > 0 else "")


def _change(key: str, old: Any, new: Any) -> str:
    """``key old -> new``; two lists too long to show whole say what the new one adds and drops."""
    scalars = isinstance(old, list) and isinstance(new, list) and all(
        isinstance(x, (str, int, float, bool)) for x in old + new)
    if scalars and max(len(json.dumps(old)), len(json.dumps(new))) > SHOWN_WIDTH:
        added, dropped = [x for x in new if x not in old], [x for x in old if x not in new]
        if added or dropped:
            parts = ([f"adds {_shown(added)}"] if added else []) + ([f"drops {_shown(dropped)}"] if dropped else [])
            return f"{key} {' and '.join(parts)}"
    return f"{key} {_shown(old)} -> {_shown(new)}"


def _shown(value: Any, width: int = SHOWN_WIDTH) -> str:
    text = "(unset)" if value is None else json.dumps(value, default=str)
    return text if len(text) <= width else text[:width - 3] + "..."
