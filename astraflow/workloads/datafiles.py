"""Reading a dataset from disk: JSONL, JSON, Parquet, CSV, or a directory saved with HF
``datasets`` (``save_to_disk``), each row with its location for error reports.

Files are read through the ``datasets`` library (Arrow underneath) into memory, with its cache in
a temporary directory that is removed afterwards, so nothing is written next to the data or in
the user's home. A JSONL file Arrow cannot parse (one malformed line) is read again line by
line, so that the bad lines become bad rows with their line numbers instead of a failed read.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

#: file formats by suffix; ``disk`` is a ``save_to_disk`` directory
FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Row:
    """One row of a dataset file: its fields (``None`` when the file could not parse it), where it
    is (``"train.jsonl line 17"``) and the split it came from when the source is split
    (a ``DatasetDict`` on disk)."""

    fields: dict[str, Any] | None
    location: str
    split: str | None = None
    error: str | None = None


def files_of(path: str) -> list[Path]:
    """The files (or the one ``save_to_disk`` directory) that ``path`` names: a file, a directory,
    or a glob pattern; ``ValueError`` when it names nothing."""
    if any(ch in path for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(path))
        if not found:
            raise ValueError(f"dataset: no file matches {path!r}; check the path (relative paths are "
                             "resolved against the directory the run starts in)")
        return found
    p = Path(path)
    if not p.exists():
        raise ValueError(f"dataset: {path} does not exist; write the data first or fix workload.params.path")
    return [p]


def format_of(path: Path, fmt: str) -> str:
    """The format to read ``path`` with: ``fmt`` unless it is ``auto`` (then by suffix; a
    directory is a ``save_to_disk`` dataset)."""
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "disk"
    if path.suffix.lower() in FORMATS:
        return FORMATS[path.suffix.lower()]
    raise ValueError(f"dataset: cannot tell the format of {path} from its name; set workload.params.format "
                     f"to one of {sorted(set(FORMATS.values()) | {'disk'})}")


def read_rows(path: str, fmt: str = "auto") -> list[Row]:
    """Every row of the files ``path`` names, in file order."""
    rows: list[Row] = []
    for file in files_of(path):
        rows.extend(_read_one(file, format_of(file, fmt)))
    return rows


def _read_one(file: Path, fmt: str) -> Iterator[Row]:
    import datasets

    datasets.disable_progress_bars()
    if fmt == "disk":
        loaded = datasets.load_from_disk(str(file), keep_in_memory=True)
        parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
        for split, ds in parts:
            where = f"{file.name}[{split}]" if split else file.name
            for i, fields in enumerate(ds.to_list()):
                yield Row(fields, f"{where} row {i + 1}", split)
        return
    if not file.is_file():
        raise ValueError(f"dataset: {file} is a directory, not a {fmt} file; set workload.params.format: disk "
                         "for a directory written by datasets' save_to_disk")
    cache = tempfile.mkdtemp(prefix="astraflow-datasets-")
    try:
        if fmt == "csv":  # every column as text: "007" stays "007", answers are not turned into floats
            with open(file, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
            text = datasets.Features({name: datasets.Value("string") for name in header})
            ds = datasets.Dataset.from_csv(str(file), cache_dir=cache, keep_in_memory=True, features=text)
        elif fmt == "parquet":
            ds = datasets.Dataset.from_parquet(str(file), cache_dir=cache, keep_in_memory=True)
        elif fmt == "json":
            ds = _from_json(file, cache)
        elif fmt == "jsonl":
            try:
                with _quiet("datasets"):  # a failed Arrow parse is handled here, not logged
                    ds = datasets.Dataset.from_json(str(file), cache_dir=cache, keep_in_memory=True)
            except Exception:  # a malformed line: read it line by line and report the bad ones
                yield from _jsonl_by_line(file)
                return
            lines = _data_lines(file)
            for i, fields in enumerate(ds.to_list()):
                line = lines[i] if i < len(lines) else i + 1
                yield Row(fields, f"{file.name} line {line}")
            return
        else:
            raise ValueError(f"dataset: unknown format {fmt!r}; known: {sorted(set(FORMATS.values()) | {'disk'})}")
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"dataset: cannot read {file} as {fmt} ({type(err).__name__}: {err}); "
                         "check the file or set workload.params.format") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    unit = "line" if fmt == "csv" else "row"
    for i, fields in enumerate(ds.to_list()):
        yield Row(fields, f"{file.name} {unit} {i + 2 if fmt == 'csv' else i + 1}")


def _from_json(file: Path, cache: str):
    """A ``.json`` file: a list of objects, or JSON lines under a ``.json`` name."""
    import datasets

    with open(file, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):
        return datasets.Dataset.from_list(json.loads(file.read_text(encoding="utf-8")))
    return datasets.Dataset.from_json(str(file), cache_dir=cache, keep_in_memory=True)


def _data_lines(file: Path) -> list[int]:
    """Line numbers (1-based) of the non-blank lines of a JSONL file: row ``i`` is on line
    ``_data_lines(f)[i]`` (Arrow skips blank lines)."""
    with open(file, "rb") as f:
        return [n for n, line in enumerate(f, 1) if line.strip()]


def _jsonl_by_line(file: Path) -> Iterator[Row]:
    with open(file, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{file.name} line {n}"
            try:
                fields = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield Row(None, where, error="not UTF-8")
                continue
            except json.JSONDecodeError as err:
                yield Row(None, where, error=f"not JSON: {err.msg}")
                continue
            if not isinstance(fields, dict):
                yield Row(None, where, error=f"a JSON {type(fields).__name__}, not an object")
            else:
                yield Row(fields, where)


@contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level, log.level = log.level, logging.CRITICAL + 1
    try:
        yield
    finally:
        log.setLevel(level)


def resolve_path(path: str, base: str | os.PathLike) -> str:
    """``path`` made absolute against ``base`` (a glob stays a glob)."""
    return path if os.path.isabs(path) else os.path.join(os.path.abspath(base), path)
