"""The paths of a config made absolute before it is validated: a run's workers start in other
directories (Slurm jobs on other nodes, a resumed run from another shell), so a path the file
gives relative to where ``astraflow`` was started must reach them as the absolute path it meant.
URLs (``memory://``, ``file://``) are kept as written: a ``file://`` URL is absolute already."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astraflow.configerrors import ConfigError
from astraflow.workloads.datafiles import resolve_path


def working_dir() -> Path:
    """The directory relative paths of a config are read against; one removed since the shell
    entered it is a ``ConfigError`` saying so (its path is gone: nothing relative can be found)."""
    try:
        return Path.cwd()
    except FileNotFoundError:
        raise ConfigError("the working directory was removed (the config's relative paths are read against it): "
                          "cd to an existing directory and run the command again") from None


def resolve_paths(data: dict, base_dir: Path) -> None:
    """Make the relative paths of config dict ``data`` absolute against ``base_dir``, in place:
    the policies' models, the data files of ``dataset`` and ``code`` workloads, the trajectory
    store, the site's TLS files and the sandbox's scratch root (``~`` expanded in each). A value
    of the wrong type is left for validation to name."""
    policies = data.get("policies")
    for pol in policies if isinstance(policies, list) else []:
        if isinstance(pol, dict) and "model" in pol:
            model = Path(str(pol["model"])).expanduser()
            pol["model"] = str(model if model.is_absolute() else (base_dir / model).resolve())
    _resolve_data_paths(data.get("workload"), base_dir)
    for section, keys in (("storage", ("trajectories",)), ("sandbox", ("scratch_root",))):
        if isinstance(data.get(section), dict):
            data[section] = _absolute(data[section], keys, base_dir)
    cluster = data.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("tls"), dict):
        data["cluster"] = {**cluster, "tls": _absolute(cluster["tls"], ("ca_file", "cert_file", "key_file"), base_dir)}


def _absolute(section: dict, keys: tuple[str, ...], base_dir: Path) -> dict:
    """A copy of ``section`` whose text values at ``keys`` are absolute paths (URLs and empty text as given)."""
    out = dict(section)
    for key in keys:
        value = out.get(key)
        if isinstance(value, str) and value and "://" not in value:
            out[key] = resolve_path(value, base_dir)
    return out


def _resolve_data_paths(workload: Any, base_dir: Path) -> None:
    """Make the data paths of ``dataset`` and ``code`` workloads (also as sources of a ``mix``)
    absolute against ``base_dir``: workers on other nodes start in other directories."""
    if not isinstance(workload, dict) or not isinstance(workload.get("params"), dict):
        return
    params = workload["params"]
    keys = {"dataset": ("path", "test_path"), "code": ("train_file", "test_file")}.get(workload.get("name"), ())
    for key in keys:
        if isinstance(params.get(key), str):
            params[key] = resolve_path(params[key], base_dir)
    for source in (params.get("sources") or {}).values() if workload.get("name") == "mix" else []:
        if isinstance(source, dict):  # a source names its workload under ``workload``
            _resolve_data_paths({"name": source.get("workload"), "params": source.get("params")}, base_dir)
