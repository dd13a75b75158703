"""A workload read from the user's own data: JSONL, JSON, Parquet, CSV or a ``save_to_disk``
directory, with a field mapping, a prompt template and a reward chosen by name.

``workload.name: dataset``, and ``workload.params`` (``DatasetParams``) say where the rows are,
which fields hold the prompt (text, or chat messages) and the reference answer, how the answer
is read from that field (``answer_format``), how the held-out split is made, and which reward
scores completions (``astraflow.workloads.rewards``). Presets give the public field layouts of
GSM8K (``question`` / ``answer`` ending in ``#### N``) and MATH (``problem`` / ``solution``
with ``\\boxed{}``); any field set explicitly overrides the preset.

Prompts are chat messages (an optional system prompt, then the user turn rendered from
``prompt_template``): the workflows render them with the tokenizer's chat template where the
model has one and as plain text otherwise. The reference solution is the demonstration a
supervised warm start trains on.

Bad rows (missing or empty fields, unparseable lines, an answer the reward cannot score, a
template that does not render) are skipped, counted by reason and reported with their
location (``report``), never a crash; a split left with no usable row is an error naming why.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Mapping

from pydantic import Field, field_validator, model_validator

from astraflow.configbase import Strict
from astraflow.workloads.base import WORKLOADS
from astraflow.workloads.datafiles import Row, read_rows, wrapped_rows_hint
from astraflow.workloads.rewards import answer_problem, boxed_answer, gsm8k_answer, resolve_reward
from astraflow.workloads.split import is_held_out
from astraflow.workloads.templates import compile_template

#: field layouts of public datasets, by preset name (fields a config sets win)
PRESETS: dict[str, dict[str, Any]] = {
    "gsm8k": dict(prompt_field="question", answer_field="answer", answer_format="gsm8k", reward="math_verify",
                  prompt_template='{{ prompt }}\nGive your reasoning, then the final answer after "####".'),
    "math": dict(prompt_field="problem", answer_field="solution", answer_format="boxed", reward="math_verify",
                 difficulty_field="level",
                 prompt_template="{{ prompt }}\nGive your reasoning, then the final answer in \\boxed{}."),
}

#: what an unset field means without a preset
DEFAULTS: dict[str, Any] = dict(prompt_field="prompt", answer_field="answer", answer_format="plain",
                                reward="exact", prompt_template="{{ prompt }}", difficulty_field=None)

#: how many bad rows a report lists by location (all are counted)
REPORT_EXAMPLES = 10
#: of them, rows skipped for one reason at most (the others' get room; one message stays short)
EXAMPLES_PER_REASON = 3

#: how many values of a split field, other than train_split / test_split, get a reason of their own
#: in the report (the rest share one: a split_field naming a per-row field gives a value per row)
REPORT_SPLIT_VALUES = 5


class DatasetParams(Strict):
    """The ``dataset`` workload's ``params``."""

    path: str
    """The data: a file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``), a glob of files, or a
    directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` gives its splits).
    Relative paths are resolved against the directory the run starts in."""
    test_path: str | None = None
    """A separate held-out file (then ``path`` is all training data)."""
    format: Literal["auto", "jsonl", "json", "parquet", "csv", "disk"] = "auto"
    """How to read the files; ``auto``: by suffix (a directory: ``disk``)."""
    preset: Literal["gsm8k", "math"] | None = None
    """A public field layout: ``gsm8k`` (question / answer ending in ``#### N``) or ``math``
    (problem / solution with ``\\boxed{}``, difficulty from ``level``)."""
    prompt_field: str | None = None
    """The field holding the prompt text (default ``prompt``, or the preset's)."""
    messages_field: str | None = None
    """The field holding the prompt as chat messages (``[{role, content}, ...]``, ending with a
    user turn) instead of ``prompt_field``."""
    answer_field: str | None = None
    """The field holding the reference answer or solution (default ``answer``). Every field
    setting may name a field inside nested objects by a dotted path (``solution.final``)."""
    answer_format: Literal["plain", "gsm8k", "boxed"] | None = None
    """How the reference answer is read from ``answer_field``: ``plain`` (the field as it is),
    ``gsm8k`` (the text after the last ``####``), ``boxed`` (the last ``\\boxed{}``)."""
    id_field: str | None = None
    """An optional unique id per row (default: the row's location)."""
    difficulty_field: str | None = None
    """An optional difficulty per row: held-out results are then also reported per difficulty."""
    split_field: str | None = None
    """A field naming each row's split (``train_split`` / ``test_split`` values); rows of other
    splits are skipped. Unset, and with no ``test_path`` or on-disk splits: a seeded fraction."""
    train_split: str = "train"
    """The value (or on-disk split name) of training rows."""
    test_split: str = "test"
    """The value (or on-disk split name) of held-out rows."""
    test_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Held-out fraction when the data has no split of its own (by a seeded hash of each row's
    prompt, so it does not depend on row order)."""
    num_train: int | None = Field(default=None, ge=1)
    """Use at most this many training rows (``None``: all)."""
    num_test: int | None = Field(default=None, ge=1)
    """Use at most this many held-out rows (``None``: all)."""
    system_prompt: str | None = None
    """A system message put before every prompt."""
    prompt_template: str | None = None
    """Jinja2 template of the user turn: ``{{ prompt }}`` is the prompt field; every field of
    the row is available by name (default ``{{ prompt }}``, or the preset's)."""
    reward: str | None = None
    """How completions are scored: ``exact``, ``numeric``, ``math_verify`` (HF ``math-verify``:
    LaTeX and equivalent forms), ``regex`` (the answer is a pattern), or a user's
    ``package.module:function`` taking ``(completion, answer, payload)`` (default ``exact``, or
    the preset's)."""
    seed: int = 0
    """Seed of the held-out split and of the order of the rows."""

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, v: str | None) -> str | None:
        if v is not None:
            resolve_reward(v)  # an unknown reward fails here, at its field, listing the known ones
        return v

    @field_validator("prompt_template")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            compile_template(v)  # a template that does not compile fails here, at its field
        return v

    @model_validator(mode="after")
    def _fill(self) -> "DatasetParams":
        preset = PRESETS.get(self.preset or "", {})
        for name, default in DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, preset.get(name, default))
        return self


@dataclass
class DataReport:
    """What reading a dataset found: rows read, rows used per split, rows skipped by reason (bad
    rows with the first few locations, and rows of neither split)."""

    source: str
    rows: int = 0
    used: dict[str, int] = field(default_factory=dict)
    bad: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    other_splits: Counter = field(default_factory=Counter)
    """Rows whose split is neither train_split nor test_split, by reason (not bad data)."""

    def skip(self, row: Row, kind: str, detail: str = "") -> None:
        """Count ``row`` as bad for reason ``kind`` (``detail``: what exactly, for the listing)."""
        self.bad[kind] += 1
        if len(self.examples) < REPORT_EXAMPLES and self.bad[kind] <= EXAMPLES_PER_REASON:
            self.examples.append(f"{row.location}: {kind}{f' ({detail})' if detail else ''}")

    def skip_split(self, kind: str) -> None:
        """Count a row of neither split for reason ``kind``; not listed by location, as a whole
        split is not one bad row."""
        self.other_splits[kind] += 1

    def summary(self) -> str:
        """One paragraph: counts, rows of other splits by reason, then the bad rows listed by location."""
        used = ", ".join(f"{n} {s}" for s, n in self.used.items())
        text = f"dataset {self.source}: {self.rows} rows read, used {used}"
        if self.other_splits:
            reasons = "; ".join(f"{n} {r}" for r, n in self.other_splits.most_common())
            text += f"; {sum(self.other_splits.values())} rows of other splits skipped ({reasons})"
        if self.bad:
            reasons = "; ".join(f"{n} {r}" for r, n in self.bad.most_common())
            text += f"; {sum(self.bad.values())} bad rows skipped ({reasons}): " + "; ".join(self.examples)
            if sum(self.bad.values()) > len(self.examples):
                text += "; ..."
        return text


@WORKLOADS.register("dataset")
class DatasetWorkload:
    """Prompts and reference answers read from files (``DatasetParams``), scored by a named reward."""

    Params = DatasetParams

    def __init__(self, seed: int = 0, **params: Any):
        self.cfg = type(self).Params.model_validate({"seed": seed, **params})  # a subclass's own Params too
        self._reward = resolve_reward(self.cfg.reward)
        self._template = compile_template(self.cfg.prompt_template)
        source = self.cfg.path if self.cfg.test_path is None else f"{self.cfg.path} + {self.cfg.test_path}"
        self.report = DataReport(source)

    # -- the workload interface ---------------------------------------------------------------
    def tasks(self, split: str) -> list[dict[str, Any]]:
        """The payloads of ``split`` (``train``, or ``eval``/``test`` for the held-out rows)."""
        if split not in ("train", "eval", "test"):
            raise ValueError(f"dataset workload: split must be train, eval or test, got {split!r}")
        return self._splits["train" if split == "train" else "test"]

    def render_messages(self, payload: Mapping[str, Any]) -> list[dict[str, str]]:
        """The prompt as chat messages, for tokenizers with a chat template."""
        return [dict(m) for m in payload["messages"]]

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        """The prompt as plain text (models without a chat template): the messages' contents, one
        per line, then a newline."""
        return "".join(m["content"] + "\n" for m in payload["messages"])

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        return float(self._reward(completion, payload["answer"], payload))

    def demonstration(self, payload: Mapping[str, Any]) -> str:
        """What a supervised warm start teaches for ``payload``: the reference solution."""
        return payload["solution"]

    def source_weights(self) -> dict[str, float]:
        return {"": 1.0}

    # -- reading -----------------------------------------------------------------------------------
    @cached_property
    def _splits(self) -> dict[str, list[dict[str, Any]]]:
        cfg = self.cfg
        self.report = DataReport(self.report.source)
        rows = read_rows(cfg.path, cfg.format)
        tests = read_rows(cfg.test_path, cfg.format, "test_path") if cfg.test_path else []
        self.report.rows = len(rows) + len(tests)
        splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
        usable = 0  # rows of ``path`` with a payload, whichever split they went to
        for row in rows:
            payload = self._payload(row)
            if payload is not None:
                usable += 1
                which = self._split_of(row, payload, bool(cfg.test_path))
                if which is not None:
                    splits[which].append(payload)
        for row in tests:
            payload = self._payload(row)
            if payload is not None:
                splits["test"].append(payload)
        limits = {"train": cfg.num_train, "test": cfg.num_test}
        for name, items in splits.items():
            random.Random(f"{cfg.seed}:{name}").shuffle(items)
            if limits[name] is not None:
                del items[limits[name]:]
            self.report.used[name] = len(items)
            if not items:
                source = tests if name == "test" and cfg.test_path else rows
                raise ValueError(f"dataset workload: no usable {name} rows. {self.report.summary()}. "
                                 f"{_fix_for(name, cfg, usable, {r.split for r in rows} - {None}, source)}")
        return splits

    def _split_of(self, row: Row, payload: Mapping[str, Any], all_train: bool) -> str | None:
        cfg = self.cfg
        if all_train:
            return "train"
        label = row.split if row.split is not None else (
            field_value(row.fields, cfg.split_field) if cfg.split_field else None)
        if row.split is not None or cfg.split_field:
            if label == cfg.train_split:
                return "train"
            if label == cfg.test_split:
                return "test"
            self.report.skip_split(self._other_split(row, label))
            return None
        # by the prompt, never the id: rows repeating a prompt under other ids stay in one split
        return "test" if is_held_out(payload["text"], cfg.seed, cfg.test_fraction) else "train"

    def _other_split(self, row: Row, label: Any) -> str:
        """The report's reason for a row whose split ``label`` is neither train_split nor
        test_split: the value, with a hint when it differs from one only in case or spaces; past
        ``REPORT_SPLIT_VALUES`` values, one reason for the rest."""
        cfg = self.cfg
        wanted = f"not train_split {cfg.train_split!r} / test_split {cfg.test_split!r}"
        if label is None or label == "":
            return f"no value in split field {cfg.split_field!r} ({wanted})"
        what = "split" if row.split is not None else "split value"
        hint = ""
        for key, value in (("train_split", cfg.train_split), ("test_split", cfg.test_split)):
            if isinstance(label, str) and label.strip().casefold() == value.strip().casefold():
                differs = "case" if label.casefold() == value.casefold() else "case or surrounding spaces"
                hint = f": it differs from {key} {value!r} only in {differs}, and values must match exactly"
                break
        reason = f"{what} {repr(label)[:40]} ({wanted}{hint})"
        seen = self.report.other_splits
        if not hint and reason not in seen and len(seen) >= REPORT_SPLIT_VALUES:
            return f"{what}s beyond the first {REPORT_SPLIT_VALUES} ({wanted})"
        return reason

    def _payload(self, row: Row) -> dict[str, Any] | None:
        """The task payload of ``row``, or ``None`` (counted in the report) when it is bad."""
        cfg = self.cfg
        if row.fields is None:
            self.report.skip(row, *(row.error or "unreadable").split(": ", 1))
            return None
        f = row.fields
        if not any(v not in (None, "") for v in f.values()):
            self.report.skip(row, "empty row")
            return None
        messages = self._messages(row)
        if messages is None:
            return None
        solution = field_value(f, cfg.answer_field)
        if isinstance(solution, list) and len(solution) == 1 and isinstance(solution[0], (str, int, float)):
            solution = solution[0]  # a list of accepted answers holding one (OlympiadBench's final_answer)
        if solution is None or str(solution).strip() == "":  # absent, or there and blank: the data to fix differs
            self.report.skip(row, f"{'missing' if solution is None else 'empty'} field {cfg.answer_field!r}")
            return None
        if isinstance(solution, (list, dict)):  # its Python repr would be the answer, and match nothing
            self.report.skip(row, f"field {cfg.answer_field!r} is a {type(solution).__name__}, not text or a number"
                             + _nested_hint("answer_field", cfg.answer_field, solution), repr(solution)[:40])
            return None
        if type(solution) is float and solution.is_integer():  # Arrow reads a column with one fraction as floats:
            solution = int(solution)  # a Parquet answer 7 came out "7.0", which `exact` never matched (JSON's stays)
        solution = str(solution)
        if cfg.answer_format == "gsm8k":
            if "####" not in solution and len(solution.split()) > 1:  # a worked solution with no final answer
                self.report.skip(row, "answer without ####", repr(solution[-40:]))
                return None
            answer = gsm8k_answer(solution)
            if not answer and "####" in solution:  # cut off right after its ####: the solution is no answer
                self.report.skip(row, "nothing after the final ####", repr(solution[-40:]))
                return None
        elif cfg.answer_format == "boxed":
            answer = boxed_answer(solution)
            if answer is None:
                self.report.skip(row, "answer without \\boxed{}", repr(solution[-40:]))
                return None
        else:
            answer = solution.strip()
        problem = answer_problem(cfg.reward, answer)
        if problem is not None:
            self.report.skip(row, f"answer the {cfg.reward} reward cannot score", problem)
            return None
        payload: dict[str, Any] = {"messages": messages, "answer": answer, "solution": solution,
                                   "text": messages[-1]["content"], "row": row.location}
        if cfg.id_field:
            if field_value(f, cfg.id_field) in (None, ""):
                self.report.skip(row, f"missing field {cfg.id_field!r}")
                return None
            payload["id"] = str(field_value(f, cfg.id_field))
        if cfg.difficulty_field and field_value(f, cfg.difficulty_field) not in (None, ""):
            payload["difficulty"] = str(field_value(f, cfg.difficulty_field))
        return payload

    def _messages(self, row: Row) -> list[dict[str, str]] | None:
        cfg, f = self.cfg, row.fields or {}
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        if cfg.messages_field:
            msgs = field_value(f, cfg.messages_field)
            ok = isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("content"), str)
                and m.get("role") in ("system", "user", "assistant") for m in msgs) and msgs[-1]["role"] == "user"
            if not ok:
                self.report.skip(row, f"field {cfg.messages_field!r} is not chat messages ending with a user turn")
                return None
            return system + [{"role": m["role"], "content": m["content"]} for m in msgs]
        prompt = field_value(f, cfg.prompt_field)
        if prompt is None or str(prompt).strip() == "":
            self.report.skip(row, f"{'missing' if prompt is None else 'empty'} field {cfg.prompt_field!r}")
            return None
        if isinstance(prompt, (list, dict)):  # chat messages (TRL's conversational layout) or a record
            hint = (f" (chat messages? set messages_field: {cfg.prompt_field})" if isinstance(prompt, list)
                    else _nested_hint("prompt_field", cfg.prompt_field, prompt))
            self.report.skip(row, f"field {cfg.prompt_field!r} is a {type(prompt).__name__}, not text{hint}")
            return None
        try:
            text = self._template.render({**f, "prompt": str(prompt)})
        except Exception as err:  # an undefined field in this row, a filter that fails on it
            self.report.skip(row, "prompt_template does not render", str(err))
            return None
        return system + [{"role": "user", "content": text}]


def field_value(fields: Mapping[str, Any], name: str) -> Any:
    """Field ``name`` of a row (``None`` when it has none): a key of the row, else a dotted path
    into its nested objects (``solution.final``: JSON objects, Parquet structs)."""
    if name in fields:
        return fields[name]
    value: Any = fields
    for key in name.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _nested_hint(setting: str, name: str, value: Any) -> str:
    """How to name a field inside the object ``value`` of field ``name``: a dotted path."""
    if not isinstance(value, dict) or not value:
        return ""
    keys = sorted(value, key=str)[:5]
    return f" (an object with keys {keys}: set {setting}: {name}.{keys[0]}, a dotted path, for one of them)"


def _fix_for(split: str, cfg: DatasetParams, usable: int, disk_splits: set[str], source: list[Row]) -> str:
    """What to change when ``split`` has no usable row, given ``usable`` good rows in ``path``, the
    splits of a ``DatasetDict`` on disk and the rows ``source`` the split was drawn from: how the
    file is read when no row of it parsed, the field names when the rows were bad, else the way
    the rows are split."""
    value = cfg.train_split if split == "train" else cfg.test_split
    if usable == 0 or cfg.test_path or value in disk_splits:
        return _unread_fix(cfg, source) or "Check the field names (prompt_field, answer_field, preset) against the file"
    if disk_splits:
        return (f"The saved DatasetDict has no split {value!r} (it has {sorted(disk_splits)}): "
                "set train_split / test_split, or test_path")
    if cfg.split_field:
        return f"Check that field {cfg.split_field!r} has rows with the value {value!r} (train_split / test_split)"
    if split == "test":
        return (f"The seeded test_fraction ({cfg.test_fraction}) held out none of the {usable} usable rows: "
                "set test_path to a held-out file, or a larger test_fraction")
    return (f"The seeded test_fraction ({cfg.test_fraction}) held out all {usable} usable rows: "
            "add rows, or set a smaller test_fraction")


def _unread_fix(cfg: DatasetParams, source: list[Row]) -> str | None:
    """The fix when the rows of ``source`` are not rows of the data at all, so that the field
    names are not what is wrong: none parsed (another format, a binary file), or each is one object
    wrapping the rows (``{"version": 1, "data": [...]}`` on one line)."""
    if source and all(r.fields is None for r in source):
        read_as = cfg.format if cfg.format != "auto" else "in the format its suffix names"
        return (f"No row parsed at all, so the file is not {read_as}: check that it is UTF-8 text in that format, "
                "or set workload.params.format (jsonl: one JSON object per line, json: a list of objects, csv, "
                "parquet, disk)")
    field = cfg.messages_field or cfg.prompt_field
    hints = [wrapped_rows_hint(r.fields, field) for r in source if r.fields is not None and field not in r.fields]
    if hints and len(hints) == len(source) and all(hints):
        return f"{source[0].location} is one JSON object, not a row: {hints[0]}"
    return None
