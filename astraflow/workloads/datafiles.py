"""Reading a dataset from disk: JSONL, JSON, Parquet, CSV, or a directory saved with HF
``datasets`` (``save_to_disk``), each row with its location for error reports.

JSONL, JSON and CSV are parsed here, with Python's ``json`` and ``csv``, so every value keeps the
type and text the file gave it: CSV values are text (``007`` stays ``007``) and a JSON ``7`` stays
``7`` even when another row's answer is ``2.5`` (Arrow would read the whole column as floats).
JSON lines are read line by line, so that a malformed line becomes a bad row with its line
number instead of a failed read. Parquet and ``save_to_disk`` directories are read through the
``datasets`` library into memory, with its cache in a temporary directory that is removed
afterwards, so nothing is written next to the data or in the user's home.

A file that cannot be read at all (a truncated JSON list, a CSV that is not UTF-8, a compressed
or UTF-16 file, a JSON list under a ``.jsonl`` name, a directory of data files that is not a
``save_to_disk`` one) is a ``ValueError`` naming the file, where in it, and the fix.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

#: file formats by suffix; ``disk`` is a ``save_to_disk`` directory
FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

BOM = b"\xef\xbb\xbf"

#: byte-order marks of text that is not UTF-8, UTF-32's first (UTF-32 LE's starts with UTF-16 LE's)
WIDE_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
             (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))

#: compressed files: suffix, how they start, the command that decompresses one
COMPRESSED = ((".gz", b"\x1f\x8b", "gunzip -k"), (".xz", b"\xfd7zXZ\x00", "unxz -k"),
              (".zst", b"\x28\xb5\x2f\xfd", "unzstd"))


class DataFileError(ValueError):
    """A data file that cannot be read; the message names the file and the fix."""


@dataclass(frozen=True)
class Row:
    """One row of a dataset file: its fields (``None`` when the file could not parse it), where it
    is (``"train.jsonl line 17"``) and the split it came from when the source is split
    (a ``DatasetDict`` on disk)."""

    fields: dict[str, Any] | None
    location: str
    split: str | None = None
    error: str | None = None


class JsonNumber(float):
    """A JSON number with a fraction or an exponent: a float whose ``str`` is the text the file
    had, so an answer ``2.50`` stays ``"2.50"`` and ``1e3`` stays ``"1e3"``."""

    def __new__(cls, text: str) -> "JsonNumber":
        number = super().__new__(cls, text)
        number.text = str(text)
        return number

    def __str__(self) -> str:
        return self.text


def files_of(path: str, key: str = "path") -> list[Path]:
    """The files (or the one ``save_to_disk`` directory) that ``path`` names: a file, a directory,
    or a glob pattern; ``ValueError`` when it names nothing, naming ``workload.params.<key>``."""
    path = os.path.expanduser(path)
    if any(ch in path for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(path))
        if not found:
            raise ValueError(f"dataset: no file matches {path!r}; check workload.params.{key} (relative paths are "
                             "resolved against the directory the run starts in)")
        return found
    p = Path(path)
    if not p.exists():
        raise ValueError(f"dataset: {path} does not exist; write the data first or fix workload.params.{key}")
    return [p]


def format_of(path: Path, fmt: str) -> str:
    """The format to read ``path`` with: ``fmt`` unless it is ``auto`` (then by suffix; a
    directory is a ``save_to_disk`` dataset)."""
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "disk"
    for suffix, _, command in COMPRESSED:
        if path.suffix.lower() == suffix:
            raise DataFileError(_compressed(path, command))
    if path.suffix.lower() in FORMATS:
        return FORMATS[path.suffix.lower()]
    raise ValueError(f"dataset: cannot tell the format of {path} from its name; set workload.params.format "
                     f"to one of {sorted(set(FORMATS.values()) | {'disk'})}")


def read_rows(path: str, fmt: str = "auto", key: str = "path") -> list[Row]:
    """Every row of the files ``path`` (``workload.params.<key>``) names, in file order;
    ``ValueError`` when they hold none."""
    rows: list[Row] = []
    for file in files_of(path, key):
        try:
            rows.extend(_read_one(file, format_of(file, fmt)))
        except DataFileError as err:  # its fix names the setting that named the file
            if key == "path":
                raise
            raise DataFileError(str(err).replace("workload.params.path", f"workload.params.{key}")) from None
    if not rows:
        raise DataFileError(f"dataset: {path} holds no rows (an empty file, an empty JSON list, or a CSV with only "
                            f"its header); write the rows into it or fix workload.params.{key}")
    return rows


def _read_one(file: Path, fmt: str) -> list[Row]:
    """The rows of one file (or ``save_to_disk`` directory); any failure is a ``ValueError``
    naming the file."""
    if file.is_dir():
        _fail_if_data_files(file)
    if fmt == "disk":
        reader = _disk_rows
    elif not file.is_file():
        raise ValueError(f"dataset: {file} is a directory, not a {fmt} file; set workload.params.format: disk "
                         "for a directory written by datasets' save_to_disk")
    else:
        reader = {"jsonl": _jsonl_rows, "json": _json_rows, "csv": _csv_rows, "parquet": _parquet_rows}.get(fmt)
    if reader is None:
        raise ValueError(f"dataset: unknown format {fmt!r}; known: {sorted(set(FORMATS.values()) | {'disk'})}")
    try:
        return list(reader(file))
    except DataFileError:
        raise
    except Exception as err:  # the library's own message says what; this one says which file and what to do
        raise DataFileError(f"dataset: cannot read {file} as {fmt} ({type(err).__name__}: {err}); "
                            "check the file or set workload.params.format") from None


def _jsonl_rows(file: Path) -> list[Row]:
    """JSON lines: one object per non-blank line; a line that is not UTF-8, not JSON or not an
    object is a bad row with its line number. A file none of whose lines is a row but which is one
    JSON value (a list, an object over many lines) is an error saying so."""
    _json_start(file)
    rows = list(_json_lines(file))
    if rows and all(r.fields is None for r in rows):
        _fail_if_one_value(file)
    return rows


def _json_lines(file: Path) -> Iterator[Row]:
    """The rows of JSON lines ``file``, each line on its own."""
    with open(file, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n == 1 and raw.startswith(BOM):  # written by Windows tools
                raw = raw[len(BOM):]
            if not raw.strip():
                continue
            where = f"{file.name} line {n}"
            try:
                fields = json.loads(raw.decode("utf-8"), parse_float=JsonNumber)
            except UnicodeDecodeError:
                yield Row(None, where, error="not UTF-8")
                continue
            except json.JSONDecodeError as err:
                # json's messages end where its position would go ("Invalid control character at")
                yield Row(None, where, error=f"not JSON: {err.msg.removesuffix(' at')} at column {err.colno}")
                continue
            if not isinstance(fields, dict):
                yield Row(None, where, error=f"a JSON {type(fields).__name__}, not an object")
            else:
                yield Row(fields, where)


def _json_rows(file: Path) -> list[Row]:
    """A ``.json`` file: a list of objects, or JSON lines under a ``.json`` name (read as JSONL,
    bad lines skipped)."""
    if _json_start(file) != b"[":
        return _jsonl_rows(file)
    try:
        items = json.loads(_text(file), parse_float=JsonNumber)
    except json.JSONDecodeError as err:
        raise DataFileError(f"dataset: {file} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}; "
                            "fix the file there (is it complete?), or write it as JSON lines (one object per line, "
                            "where a bad line only skips its row)") from None
    return [Row(item, f"{file.name} row {i}") if isinstance(item, dict)
            else Row(None, f"{file.name} row {i}", error=f"a JSON {type(item).__name__}, not an object")
            for i, item in enumerate(items, 1)]


def _json_start(file: Path) -> bytes:
    """The first character of JSON ``file`` that is not whitespace (``b""`` when none), however
    much whitespace comes first; a compressed or UTF-16/UTF-32 file is an error."""
    with open(file, "rb") as f:
        chunk = f.read(1 << 16)
        _fail_if_not_text(file, chunk[:8], json_text=True)
        chunk = chunk.removeprefix(BOM)
        while chunk:
            rest = chunk.lstrip()
            if rest:
                return rest[:1]
            chunk = f.read(1 << 16)
    return b""


def _fail_if_one_value(file: Path) -> None:
    """Raise when ``file``, none of whose lines is a row, is one JSON value: a list (JSON read as
    JSON lines) or an object over many lines (``{"data": [...]}``), its rows somewhere inside."""
    try:
        whole = json.loads(_text(file))
    except json.JSONDecodeError:
        return
    if isinstance(whole, list):
        raise DataFileError(f"dataset: {file} is one JSON list, not JSON lines (one object per line); set "
                            "workload.params.format: json, or name the file .json")
    if isinstance(whole, dict):
        raise DataFileError(f"dataset: {file} holds one JSON object (keys {sorted(whole)[:5]}), not rows; write "
                            "the rows as a JSON list of objects or as JSON lines (one object per line)"
                            + "".join(f" ({hint})" for hint in [wrapped_rows_hint(whole)] if hint))


def wrapped_rows_hint(obj: dict[str, Any], field: str | None = None) -> str:
    """Where the rows of a file that wraps them in one object (``{"version": 1, "data": [...]}``)
    are, and how to take them out; ``""`` when no key of ``obj`` holds a list of objects (with
    ``field``: of objects that have it, so that a row's own list of chat messages is no match)."""
    keys = [k for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
            and (field is None or field in v[0])]
    if not keys:
        return ""
    key = f".{keys[0]}" if keys[0].isidentifier() else f'.["{keys[0]}"]'
    return (f"the rows are under key {keys[0]!r}" + (f" (lists of objects also under {keys[1:]})" if keys[1:] else "")
            + f"; take them out as JSON lines: jq -c '{key}[]' FILE > NEW_FILE.jsonl")


def _csv_rows(file: Path) -> Iterator[Row]:
    """A CSV file with a header: every value as text; a row's location is the line it starts on
    (a quoted field may span lines). Strict about quotes: an unclosed one would swallow the rest of
    the file into one field."""
    reader = csv.reader(io.StringIO(_text(file), newline=""), strict=True)
    start = 1
    try:
        header = next(reader, None)
        if header is None:
            return
        start = reader.line_num + 1
        for values in reader:
            line, start = start, reader.line_num + 1
            if not values:  # a blank line
                continue
            where = f"{file.name} line {line}"
            if len(values) > len(header):
                yield Row(None, where, error=f"{len(values)} fields under a header of {len(header)}")
            else:
                yield Row(dict(zip(header, values)), where)
    except csv.Error as err:
        raise DataFileError(f"dataset: {file} line {start} is not valid CSV ({err}); "
                            "fix the file there (a stray or unclosed quote?)") from None


def _text(file: Path) -> str:
    """The whole of ``file`` as text: UTF-8, with or without a byte-order mark."""
    data = file.read_bytes()
    _fail_if_not_text(file, data[:8])
    data = data.removeprefix(BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise DataFileError(f"dataset: {file} is not UTF-8 (byte 0x{data[err.start]:02x} on line {line}); "
                            + _to_utf8(file, "latin1")) from None


def _fail_if_not_text(file: Path, head: bytes, json_text: bool = False) -> None:
    """Raise when ``head``, the first bytes of ``file``, show it compressed or in UTF-16/UTF-32 (by
    a byte-order mark or, for JSON, which starts with ASCII, by the NUL bytes beside it): read as
    UTF-8, each of its rows would be a bad one and the reason lost among them."""
    for _, magic, command in COMPRESSED:
        if head.startswith(magic):
            raise DataFileError(_compressed(file, command))
    enc = json.detect_encoding(head) if json_text else next((e for bom, e in WIDE_BOMS if head.startswith(bom)),
                                                             "utf-8")
    if enc.startswith(("utf-16", "utf-32")):
        enc = enc.replace("-le", "le").replace("-be", "be")
        excel = " (Excel's 'Unicode Text')" if enc == "utf-16" and file.suffix.lower() == ".csv" else ""
        raise DataFileError(f"dataset: {file} is {enc.upper()}{excel}, not UTF-8; " + _to_utf8(file, enc))


def _to_utf8(file: Path, enc: str) -> str:
    """How to fix ``file``, text in encoding ``enc`` (the one it probably is)."""
    excel = " (Excel: Save As 'CSV UTF-8')" if file.suffix.lower() == ".csv" else ""
    return f"save it as UTF-8{excel} or convert it: iconv -f {enc} -t utf-8 FILE > NEW_FILE"


def _compressed(file: Path, command: str) -> str:
    return f"dataset: {file} is compressed; decompress it ({command} {file}) and point workload.params.path at that"


def _fail_if_data_files(folder: Path) -> None:
    """Raise, naming the glob to use, when ``folder`` is not a ``save_to_disk`` directory but holds
    data files (an HF hub download: ``main/train-00000-of-00001.parquet``): which files are the
    training rows and which the held-out ones is for the config to say."""
    if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
        return
    patterns: list[str] = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # a download's .cache
        for name in sorted(names):
            suffix = Path(name).suffix.lower()
            if suffix in FORMATS:
                shard = re.match(r"(.+?[-_])\d", name)  # train-00000-of-00002.parquet: every shard
                pattern = os.path.join(root, shard.group(1) + "*" + suffix if shard else name)
                if pattern not in patterns:
                    patterns.append(pattern)
    if not patterns:
        return

    def named(split: str) -> str | None:
        return next((p for p in patterns if split in re.split(r"[-_.*]+", os.path.basename(p))), None)

    train, test = named("train") or patterns[0], named("test")
    raise DataFileError(f"dataset: {folder} is a directory of data files, not one written by datasets' save_to_disk; "
                        f"point workload.params.path at the training files with a glob: path: {train}"
                        + (f" (and test_path: {test})" if test else "")
                        + (f"; the files there: {', '.join(patterns[:6])}{', ...' if len(patterns) > 6 else ''}"
                           if set(patterns) - {train, test} else ""))


def _parquet_rows(file: Path) -> Iterator[Row]:
    for i, fields in enumerate(_with_datasets(lambda ds, cache: ds.Dataset.from_parquet(
            str(file), cache_dir=cache, keep_in_memory=True)).to_list()):
        yield Row(fields, f"{file.name} row {i + 1}")


def _disk_rows(file: Path) -> Iterator[Row]:
    import datasets

    loaded = _with_datasets(lambda ds, cache: ds.load_from_disk(str(file), keep_in_memory=True))
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split, ds in parts:
        where = f"{file.name}[{split}]" if split else file.name
        for i, fields in enumerate(ds.to_list()):
            yield Row(fields, f"{where} row {i + 1}", split)


def _with_datasets(load):
    """``load(datasets, cache_dir)``, with the cache in a temporary directory removed afterwards."""
    import datasets

    datasets.disable_progress_bars()
    cache = tempfile.mkdtemp(prefix="astraflow-datasets-")
    try:
        return load(datasets, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def resolve_path(path: str, base: str | os.PathLike) -> str:
    """``path`` made absolute against ``base`` (``~`` expanded, ``.`` and ``..`` folded; a glob
    stays a glob)."""
    path = os.path.expanduser(path)
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(os.path.abspath(base), path))
