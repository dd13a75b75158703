"""The dataset workload's ``prompt_template``, compiled once: Jinja in a sandbox, undefined
fields an error; a template that only places ``{{ prompt }}`` in text renders by joining."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping


def compile_template(text: str):
    """The compiled ``prompt_template``: one that only places ``{{ prompt }}`` in text renders
    by joining (what Jinja gives it, without Jinja's per-row cost on large datasets)."""
    from jinja2 import StrictUndefined, TemplateSyntaxError
    from jinja2.sandbox import SandboxedEnvironment

    try:
        compiled = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"prompt_template does not compile: {err}") from None
    parts = re.split(r"\{\{\s*prompt\s*\}\}", text)
    if any(mark in part for part in parts for mark in ("{{", "{%", "{#", "}}", "%}", "#}")):
        return compiled
    return _PromptOnly([re.sub(r"\r\n?", "\n", part) for part in parts])


@dataclass(frozen=True)
class _PromptOnly:
    """A template that is text around ``{{ prompt }}`` (Jinja reads its newlines as ``\\n``)."""

    parts: list[str]

    def render(self, fields: Mapping[str, Any]) -> str:
        return str(fields["prompt"]).join(self.parts)
