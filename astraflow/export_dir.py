"""Where ``astraflow export`` writes: the output directory OUT, checked before the model is read
and filled only once the model is checked; and what it writes there besides the weights.

A new OUT is written beside it under a temporary name and renamed to it. An existing OUT (an
empty directory made for the group, a mount point, an earlier export replaced with ``--force``)
is written into in place, in a hidden staging directory whose files are then moved up, so its
owner and mode stay. A killed export's staging directories are recognised by the dead pid in
their names and removed by the next export into the same OUT.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from astraflow.models import INIT_RECORD
from storage.holds import pid_alive
from storage.paths import tmp_sibling

#: the file the export writes next to the model, naming its origin (and marking OUT as an export)
PROVENANCE = "astraflow_export.json"
#: files of a model directory that are its weights or config: the rest (tokenizer, chat template,
#: generation config, license, README) is copied into the export as the run used it
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".index.json")
#: files of the base model directory not copied: the export writes its own config and provenance,
#: and how the base was built (``INIT_RECORD``) does not describe the trained model
_OWN_FILES = ("config.json", PROVENANCE, INIT_RECORD)


class ExportError(ValueError):
    """A run, version or output directory the export cannot use; the message names the fix."""


def resolve_out(out: Path) -> Path:
    """OUT with a symlink followed (the model goes where it points)."""
    if out.is_symlink():
        if not out.exists():
            raise ExportError(f"{out} is a symlink to {os.readlink(out)}, which does not exist: make that directory "
                              "or name another")
        return out.resolve()
    return out.absolute()


def check_out(out: Path, force: bool) -> bool:
    """Whether ``out`` exists (empty, or an earlier export to replace); refuses a directory of
    other files. Removes what killed exports into ``out`` left."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file: name a directory for the model")
    _remove_stale(out)
    if not out.exists():
        return False
    if not any(p.name != "lost+found" for p in out.iterdir()):  # empty, or a file system's root
        return True
    if not (out / PROVENANCE).exists():
        raise ExportError(f"{out} already holds files that are no export of this tool: name a new directory "
                          "(an export replaces only an earlier export, with --force)")
    if not force:
        raise ExportError(f"{out} holds an earlier export ({out / PROVENANCE}): pass --force to replace it, or "
                          "name a new directory")
    return True


def _stale_names(out: Path) -> list[Path]:
    """Staging directories of exports into ``out`` whose process is gone (killed midway)."""
    found = []
    for d, name in ((out.parent, out.name), (out, _STAGE)):
        pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]{{12}}\.tmp")
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            m = pattern.fullmatch(n)
            if m and not pid_alive(int(m.group(1))):
                found.append(d / n)
    return found


def _remove_stale(out: Path) -> None:
    for p in _stale_names(out):
        shutil.rmtree(p, ignore_errors=True)


#: the staging directory's name inside an existing OUT
_STAGE = "astraflow-export"


def staging_dir(out: Path, stack: ExitStack) -> Path:
    """Where the model is written before it is checked: beside a new OUT (then renamed to it), or
    inside an existing one (a mount point, a directory made for the group), whose files are then
    moved up. Removed again unless the export completes."""
    staging = out / f".{_STAGE}.{os.getpid()}.{os.urandom(6).hex()}.tmp" if out.exists() else tmp_sibling(out)
    try:
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as err:
        raise ExportError(f"{staging.parent}: cannot write the model there ({err.strerror or err}); name a "
                          "directory you can write to") from None
    stack.callback(shutil.rmtree, staging, ignore_errors=True)
    return staging


def put_in_place(staging: Path, out: Path, existing: bool) -> None:
    """A new OUT: the staging directory renamed to it. An existing OUT: the new files moved in,
    the earlier export's other files removed, the provenance file last (what marks OUT an export)."""
    try:
        if not existing:
            os.rename(staging, out)
            return
        new = {p.name for p in staging.iterdir()}
        for name in sorted(new - {PROVENANCE}):
            os.replace(staging / name, out / name)
        for old in out.iterdir():
            if old.name not in new and old != staging and old.name != "lost+found":
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        os.replace(staging / PROVENANCE, out / PROVENANCE)
    except OSError as err:
        raise ExportError(f"{out}: the checked model could not be put there ({err.strerror or err}); another export "
                          "into it at the same time writes it too: export once, or name another directory") from None


def readable_as_umask_allows(root: Path) -> None:
    """Files and directories with the permissions the user's umask gives new ones (some writers
    make their files owner-only, which a group or a serving account could then not read)."""
    mask = os.umask(0)
    os.umask(mask)
    for d, dirs, files in os.walk(root):
        os.chmod(d, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(d, f), 0o666 & ~mask)


def check_space(staging: Path, need: int) -> None:
    """Room in ``staging`` for ``need`` bytes of weights."""
    free = shutil.disk_usage(staging).free
    if free < need * 1.05:
        raise ExportError(f"{staging.parent} has {_size(free)} free and the model needs {_size(need)}: free space "
                          "there or name another directory (--dtype bf16 halves an fp32 model)")


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def copy_model_files(source: Path, staging: Path, tok) -> None:
    """The tokenizer files, chat template and generation config as the run used them: copied
    from the source directory (a re-save would rewrite them in the installed transformers'
    format, which older readers misread); re-saved only where the source holds none."""
    if source.is_dir():
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in _OWN_FILES and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(f, staging / f.name)
    if not any((staging / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")):
        tok.save_pretrained(staging)


def with_older_readers_keys(config_file: Path) -> None:
    """Add to ``config.json`` the keys transformers 4 and engines built on it read where the
    installed transformers writes newer ones (``rope_parameters``, ``dtype``): ``rope_theta``,
    ``rope_scaling`` and ``torch_dtype``. Left out, an older reader falls back to its defaults
    without a word (a different rope base)."""
    cfg = json.loads(config_file.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_same_vocabulary(tok, given: Path, run_model_dir: Callable[[], Path]) -> None:
    """A ``--tokenizer`` directory whose vocabulary differs from that of the run's model directory
    (``run_model_dir()``, an ``ExportError`` where the run's config names none), where that still
    exists: the weights were trained on the run's token ids, so the export would pair them with
    other text, and loading it back checks nothing of that."""
    from astraflow.model_loading import TOKENIZER_FILES

    try:
        run_model = run_model_dir()
    except ExportError:
        return
    if given.resolve() == run_model.resolve() or not any(any(run_model.glob(n)) for n in TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    try:
        ran = AutoTokenizer.from_pretrained(run_model)
    except Exception:  # the run's tokenizer cannot be read here: nothing to compare with
        return
    if ran.get_vocab() != tok.get_vocab():
        raise ExportError(f"--tokenizer {given} has another vocabulary than the tokenizer the run trained with, in "
                          f"{run_model} ({len(tok)} tokens, there {len(ran)}): the model would read and write other "
                          "text; leave --tokenizer out (the run's is taken), or pass a copy of the run's tokenizer")
