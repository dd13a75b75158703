"""The docs against the code they describe: every repository path the README and ``docs/`` name
exists, and every config key they name (``rollout.engine.max_batch``, ``policies[].trainer.lr``,
a ``--set`` example) is a field of the run config, and every option a quoted command gives
(``astraflow ...``, ``python benchmarks/...``) exists. A renamed module, field or option otherwise
leaves a doc that sends users to a file that is gone or a key or option the command refuses."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from astraflow.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPANS = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"(astraflow|storage|schedulers|examples|benchmarks|tests|jobs|docs)/[A-Za-z0-9_./*-]*")
SECTIONS = tuple(RunConfig.model_fields)
#: a file named in a span (`control/partitions.json`, `benchmarks/autoscale.py`), not a key
FILE_SUFFIXES = {"py", "yaml", "json", "jsonl", "md", "sh", "lock", "snapshot", "j2", "txt"}
#: paths the docs name outside this repository
ELSEWHERE = {"jobs/submitted.json",  # in a run directory
             "benchmarks/benchmark_throughput.py"}  # in vLLM's repository


def _models(annotation: typing.Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _keys(model: type[BaseModel], prefix: str, out: dict[str, bool]) -> dict[str, bool]:
    """Dotted keys of ``model`` (list elements collapsed), each True where any key may follow
    (a free mapping such as ``workload.params`` or a partition's ``rollout``)."""
    for name, field in model.model_fields.items():
        key, nested = prefix + name, _models(field.annotation)
        out[key] = not nested and "dict" in str(field.annotation).lower()
        for sub in nested:
            _keys(sub, key + ".", out)
    return out


KEYS = _keys(RunConfig, "", {})


def _known(key: str) -> bool:
    parts = key.split(".")
    if parts[0] in ("policies", "partitions") and len(parts) > 2 and f"{parts[0]}.{parts[1]}" not in KEYS:
        parts.pop(1)  # an element named in a --set example: policies.solver.trainer.lr
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in KEYS:
            return i == len(parts) or KEYS[head]
    return False


def _spans():
    for doc in DOCS:
        for m in SPANS.finditer(doc.read_text()):
            yield doc.relative_to(ROOT), m.group(1)


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for doc, span in _spans():
        for token in re.split(r"[\s,;()=]+", span):
            m = REPO_PATH.fullmatch(token.split(":")[0].strip("'\""))
            if m and m.group(0) not in ELSEWHERE and not list(ROOT.glob(m.group(0))):
                missing.append(f"{doc}: {m.group(0)}")
    assert not missing, missing


def test_every_config_key_the_docs_name_is_a_field():
    unknown = []
    for doc, span in _spans():
        for token in re.split(r"[\s,/=:]+", span):
            key = re.sub(r"\[[^\]]*\]", "", token.strip("()"))
            if (re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key) and key.split(".")[0] in SECTIONS
                    and key.rsplit(".", 1)[1] not in FILE_SUFFIXES and not _known(key)):
                unknown.append(f"{doc}: {key}")
    assert not unknown, unknown


def test_every_module_the_reading_order_names_exists():
    """docs/reading_order.md names modules by their file name within the package it is walking."""
    have = {p.name for d in ("astraflow", "storage", "schedulers") for p in (ROOT / d).rglob("*.py")}
    text = (ROOT / "docs" / "reading_order.md").read_text()
    named = [n for n in re.findall(r"`([A-Za-z0-9_./]+\.py)`", text) if not n.startswith(("tests/", "benchmarks/"))]
    missing = sorted({Path(n).name for n in named} - have)
    assert not missing, missing


def test_the_reading_order_names_every_module():
    """A module added to a package the reading order walks file by file is named there too; the
    packages it names as a whole (each with a docstring that walks it) are left to that docstring."""
    whole = ("astraflow/agents/", "astraflow/plan/", "astraflow/runtime/monitoring/",
             "astraflow/training/megatron/", "storage/trajectories/")
    text = (ROOT / "docs" / "reading_order.md").read_text()
    named = {Path(n).name for n in re.findall(r"`([A-Za-z0-9_./]+\.py)`", text)}
    unnamed = sorted(str(p.relative_to(ROOT)) for d in ("astraflow", "storage", "schedulers")
                     for p in (ROOT / d).rglob("*.py")
                     if p.name not in named and p.name not in ("__init__.py", "__main__.py")
                     and not str(p.relative_to(ROOT)).startswith(whole))
    assert not unnamed, f"add them to docs/reading_order.md: {unnamed}"


#: where commands are quoted for a user to copy: the docs, and the examples' comments and docstrings
COMMAND_SOURCES = [*DOCS, ROOT / "jobs" / "README.md", *sorted((ROOT / "examples").rglob("*.yaml")),
                   *sorted((ROOT / "examples").rglob("*.py"))]


def _command_lines():
    """(file, line) for each line the sources quote: code blocks (``\\`` continuations joined) and
    inline spans, cut at a ``#`` comment and at a run of spaces (the README's table of commands)."""
    for path in COMMAND_SOURCES:
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        spans = [m.group(1) for m in re.finditer(r"```[a-z]*\n(.*?)```", text, re.S)]
        spans += [m.group(1) for m in SPANS.finditer(re.sub(r"```.*?```", "", text, flags=re.S))]
        if path.suffix != ".md":
            spans = [text]
        for span in spans:
            for line in span.splitlines():
                line = re.sub(r"^\s*#\s*", "", line) if path.suffix != ".md" else line  # a comment's text
                for part in re.split(r"&&|;|\|\||\|", re.split(r"\s#\s|\s{3,}", line.strip())[0]):
                    yield path.relative_to(ROOT), part


def _flags(words: list[str]) -> list[str]:
    """The long options among ``words`` (``[--json]`` and ``--opt=VALUE`` included)."""
    return [w.lstrip("[").split("=")[0].rstrip("]") for w in words if w.lstrip("[").startswith("--")]


def test_every_option_the_docs_give_a_command_exists():
    """An ``astraflow ...`` command's options are those of its click command, a
    ``python benchmarks/NAME.py ...`` command's are in the script's argument parser: a renamed
    option otherwise leaves a doc whose command fails with 'no such option'."""
    import click

    from astraflow.cli import main

    wrong = []
    for doc, line in _command_lines():
        if m := re.search(r"(?:^|[\s/])astraflow\s+(.*)", line):
            words, cmd, named = m.group(1).split(), main, []
            while words and isinstance(cmd, click.Group) and words[0] in cmd.commands:
                named.append(words.pop(0))
                cmd = cmd.commands[named[-1]]
            if cmd is main:
                continue
            known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            wrong += [f"{doc}: astraflow {' '.join(named)} {f}" for f in _flags(words) if f not in known]
        for name, rest in re.findall(r"python benchmarks/(\w+)\.py((?:\s+\S+)*)", line):
            source = (ROOT / "benchmarks" / f"{name}.py").read_text()
            wrong += [f"{doc}: benchmarks/{name}.py {f}" for f in _flags(rest.split())
                      if f'"{f}"' not in source and f'"--{f.removeprefix("--no-")}"' not in source and f != "--help"]
    assert not wrong, wrong
