"""What the ``astraflow`` command modules share: the bad-input error, click options made from
config fields (so the CLI and the config never disagree on choices, defaults and help), and
standard streams that are open whatever the command was started with."""

from __future__ import annotations

import codecs
import math
import os
import re
import shlex
import sys
from typing import Any, Literal, get_args, get_origin

import click
from pydantic import BaseModel


#: what a terminal would act on in text it prints (escape sequences, carriage returns, ...): all
#: control characters but newline and tab, C1 ones included
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` written by a model, a program or an environment, safe to print on a terminal: its
    control characters but newline and tab shown as ``\\xNN``, so it cannot move the cursor,
    rewrite what was printed above it or retitle the window."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def shell_arg(path: str | os.PathLike[str]) -> str:
    """``path`` as an argument of a command printed for the user to paste: quoted where a shell
    would split or expand it (a space, a quote), and after ``./`` where it starts with a dash, which
    the command would take for an option."""
    text = str(path)
    return shlex.quote(f"./{text}" if text.startswith("-") else text)


#: the error handler of a standard stream whose encoding is not UTF-8 (`_shown`)
_SHOWN = "astraflow-shown"


def open_standard_streams() -> None:
    """A command started with standard input, output or error closed (``<&-``, ``>&-``, a daemon's
    child) gets ``/dev/null`` there. Else the next pipe or file it opens takes that descriptor,
    where a child's standard stream is put (the sandbox's seccomp filter, handed to bubblewrap by
    descriptor, was overwritten by its stdin), and Python's ``sys.stdout`` is None. Output and
    error write what their encoding cannot (a model's text, under a Latin-1 or ASCII locale
    without Python's UTF-8 mode) as escapes (``\\xe9``, ``\\ufffd``) rather than failing."""
    codecs.register_error(_SHOWN, _shown)
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            got = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: 0 to fd - 1 are open
            assert got == fd, (got, fd)
        if getattr(sys, name) is None:
            stream = open(fd, "r" if fd == 0 else "w", closefd=False)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        stream = getattr(sys, name)
        encoding = (getattr(stream, "encoding", None) or "utf-8").lower().replace("-", "").replace("_", "")
        if fd and encoding != "utf8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=_SHOWN)


def _shown(err: UnicodeError) -> tuple[str | bytes, int]:
    """The ``_SHOWN`` error handler: a path's undecodable bytes (surrogates) written back as they
    were, anything else the encoding lacks as an escape (``\\xe9``, ``\\ufffd``)."""
    assert isinstance(err, UnicodeEncodeError), err
    text = err.object[err.start:err.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in text):
        return bytes(ord(c) - 0xDC00 for c in text), err.end
    return codecs.backslashreplace_errors(err)


class UserError(click.ClickException):
    """Bad input: exit code 2 and one message that names the fix, no traceback."""

    exit_code = 2


def field_option(model: type[BaseModel], name: str, **overrides: Any) -> dict[str, Any]:
    """``click.option`` keywords for config field ``model.name``: its choices (a ``Literal``),
    its default and its docstring as help; ``overrides`` replace any of them."""
    f = model.model_fields[name]
    kw: dict[str, Any] = {"default": f.default, "show_default": f.default is not None,
                          "help": " ".join((f.description or "").replace("``", "`").split())}
    if get_origin(f.annotation) is Literal:
        kw["type"] = click.Choice(get_args(f.annotation))
    kw.update(overrides)
    return kw


def choices(model: type[BaseModel], name: str) -> click.Choice:
    """The ``click.Choice`` of a ``Literal`` config field."""
    return click.Choice(get_args(model.model_fields[name].annotation))


class UserPath(click.Path):
    """``click.Path`` with ``~`` expanded: the shell leaves it alone in ``--run-dir=~/runs/a`` or
    when quoted, and a literal ``./~`` directory would be made instead. An empty path is refused:
    it is what an unset variable gives (``--run-dir "$RUN_DIR"``), and read as the working
    directory or as no option at all it would act on the wrong directory (a new run, not a resume).
    ``utf8``: a path whose name is not UTF-8 text (a Latin-1 byte) is refused, for a model
    directory that safetensors writes (it takes only UTF-8 paths)."""

    def __init__(self, *args: Any, utf8: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.utf8 = utf8

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            fix = ", or leave the option out" if isinstance(param, click.Option) else ""
            self.fail(f"the path is empty (an unset shell variable?): give a path{fix}", param, ctx)
        if self.utf8 and isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                self.fail(f"{value.encode('utf-8', 'backslashreplace').decode()}: the name is not UTF-8 text, "
                          "and the model's safetensors files take only UTF-8 paths: rename it, or give a "
                          "UTF-8 path", param, ctx)
        if isinstance(value, str):
            value = os.path.expanduser(value)
        return super().convert(value, param, ctx)


class Seconds(click.ParamType):
    """A duration in seconds: a finite number, 0 or more (``nan`` and ``inf`` would wait for ever)."""

    name = "seconds"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not (seconds >= 0 and math.isfinite(seconds)):
            self.fail(f"{value!r}: give a finite number of seconds, 0 or more", param, ctx)
        return seconds
