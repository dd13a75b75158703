"""Reading config text and explaining what is wrong with it: YAML that refuses a key given
twice, and pydantic's errors as one line each that names the key, the value given and the fix
(a text field given a YAML boolean or number is told to quote it; a boolean where a number is
wanted is refused rather than taken as 1 or 0)."""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice (YAML keeps the last silently)."""


def _without_sexagesimal(resolvers: dict[str, list]) -> dict[str, list]:
    """YAML 1.1's implicit resolvers with integers and floats that contain no ``:``: its base-60
    numbers (``12:00:00`` read as 43200) become text, as YAML 1.2 reads them; a walltime or a
    clock time is meant, never a number."""
    numbers = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    return {first: [(tag, re.compile(r"(?=[^:]*\Z)" + rx.pattern, rx.flags) if tag in numbers else rx)
                    for tag, rx in pairs] for first, pairs in resolvers.items()}


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: YAML itself keeps the
    last one, so a second ``run:`` block would silently discard the first. Unquoted base-60
    numbers (``walltime: 12:00:00``) stay text (this class only: ``yaml.safe_load`` is unchanged)."""

    yaml_implicit_resolvers = _without_sexagesimal(yaml.SafeLoader.yaml_implicit_resolvers)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = first.get(key)
                except TypeError:  # an unhashable key: SafeLoader names it
                    continue
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise DuplicateKey(f"duplicate key {key} at line {line} (first at line {seen}): YAML would keep "
                                       "only the last silently; write each key once (merge the two blocks)")
                first[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (`DuplicateKey`, a ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def model_of(annotation: Any, value: Any = None) -> type[BaseModel] | None:
    """The config model a field holds: the annotation itself, an optional one, the model of the
    elements of a list, or, of a union told apart by ``type`` (a dataflow rule), the member
    whose ``type`` is the one ``value`` gives."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is Annotated:
        return model_of(get_args(annotation)[0], value)
    if get_origin(annotation) in (Union, types.UnionType, list):
        models = [m for m in (model_of(arg, value) for arg in get_args(annotation)) if m is not None]
        tagged = value.get("type") if isinstance(value, dict) else None
        for m in models:
            field = m.model_fields.get("type")
            if tagged is not None and field is not None and field.default == tagged:
                return m
        return models[0] if models else None
    return None


def describe_error(e: dict[str, Any], set_hint: bool = True) -> str:
    """One pydantic error as ``loc: message``: the value given where it is a plain value, an
    unknown key as a likely misspelling, and a string field given a YAML boolean or number
    (``no``, ``2024``) told to quote it."""
    loc = ".".join(str(x) for x in e["loc"])
    if not loc:  # a check across fields, whose message names them itself
        return e["msg"].removeprefix("Value error, ")
    msg = e["msg"].removeprefix("Value error, ")
    if msg.startswith((f"{loc}:", f"{loc}.")):  # a section's check that names the field itself
        return msg
    given = e.get("input")
    if e["type"] == "extra_forbidden":
        return (f"{loc}: unknown key (check the spelling; docs/configuration.md lists the sections and where each "
                "field is documented)")
    if e["type"] == "string_type" and isinstance(given, (bool, int, float)):
        if isinstance(given, bool):
            got, why, text = f"the boolean {str(given).lower()}", "yes, no, on, off, true, false as booleans", "..."
        else:
            got, why, text = f"the number {given}", "digits as a number", str(given)
        return (f"{loc}: {msg}, got {got} (YAML reads unquoted {why}); quote the text: "
                f"{e['loc'][-1]}: \"{text}\" in the file"
                + (f", or --set {loc}='\"{text}\"'" if set_hint else ""))
    if e["type"] in OPTION_FIXES and isinstance(given, float) and given != given:  # nan fails any bound
        return f"{loc}: nan is not a number; use a finite one"
    if e["type"] not in ("value_error", "assertion_error") and isinstance(given, (str, int, float, bool)):
        return f"{loc}: {msg}, got {given!r}"
    return f"{loc}: {msg}"


def _numeric(annotation: Any) -> str | None:
    """``"an integer"`` / ``"a number"`` for an ``int`` / ``float`` field (optional or not)."""
    args = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) in (
        Union, types.UnionType) else [annotation]
    args = [get_args(a)[0] if get_origin(a) is Annotated else a for a in args]  # Optional[Annotated[int, ...]]
    if args and all(a is int for a in args):
        return "an integer"
    if args and all(a in (int, float) for a in args):
        return "a number"
    return None


def _element(annotation: Any, container: type) -> Any:
    """The value type of a ``dict[K, V]`` field or the element type of a ``list[E]`` one
    (``container``: dict or list; optional or not), None for any other field."""
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    for a in members:
        a = get_args(a)[0] if get_origin(a) is Annotated else a
        if get_origin(a) is container and get_args(a):
            return get_args(a)[-1]
    return None


def _bool_line(where: str, want: str, value: bool) -> str:
    return (f"{where}: Input should be {want}, got the boolean {str(value).lower()} (YAML reads true, false, yes, "
            "no, on, off as booleans); write a number")


def bool_problems(data: Any, model: type[BaseModel], loc: str = "") -> list[str]:
    """A boolean (YAML's ``true``, ``yes``, ``on``) where a field of ``model`` wants a number,
    also as a value of a ``dict[K, number]`` field or an element of a ``list[number]`` one:
    pydantic would take it as 1 or 0 silently. One line per value, its location dotted as
    pydantic's are."""
    if not isinstance(data, dict):
        return []
    out = []
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        where = f"{loc}.{key}" if loc else key
        want = _numeric(field.annotation)
        sub = model_of(field.annotation, value)
        if isinstance(value, bool) and want:
            out.append(_bool_line(where, want, value))
        elif sub is None and isinstance(value, (dict, list)):
            inner = _numeric(_element(field.annotation, dict if isinstance(value, dict) else list))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            out += [_bool_line(f"{where}.{k}", inner, v) for k, v in items if inner and isinstance(v, bool)]
        elif sub is not None and isinstance(value, list):
            out += [line for i, el in enumerate(value) for line in bool_problems(el, sub, f"{where}.{i}")]
        elif sub is not None:
            out += bool_problems(value, sub, where)
    return out


def format_validation(err: ValidationError | None, extra: list[str] = ()) -> str:
    """The errors of ``err`` (those of a field in ``extra``, the `bool_problems`, said once)."""
    said = {line.split(": ", 1)[0] for line in extra}
    lines = [line for e in (err.errors() if err is not None else []) if (line := describe_error(e)).split(": ", 1)[0]
             not in said]
    return "invalid config:\n  " + "\n  ".join([*extra, *lines])


#: what a pydantic constraint error on an option asks for, by error type (its ``ctx`` fills it in)
OPTION_FIXES = {
    "greater_than_equal": "use {ge} or more",
    "greater_than": "use a value above {gt}",
    "less_than_equal": "use {le} or less",
    "less_than": "use a value below {lt}",
    "finite_number": "use a finite number (not nan or inf)",
}


def option_errors(err: ValidationError) -> str:
    """A ``ValidationError`` of a config model built from options, one line per option, as
    ``--option VALUE: the fix``: the fields are named as the options that set them."""
    def plain(v: Any) -> Any:  # 0.0 -> 0, as a user would type it
        return int(v) if isinstance(v, float) and v.is_integer() else v

    lines = []
    for e in err.errors():
        option = "--" + "-".join(str(x) for x in e["loc"]).replace("_", "-")
        ctx = {k: plain(v) for k, v in (e.get("ctx") or {}).items()}
        fix = OPTION_FIXES.get(e["type"], "").format(**ctx) or e["msg"].removeprefix("Value error, ")
        lines.append(f"{option} {plain(e.get('input'))}: {fix}")
    return "\n".join(lines)


def partition_errors(err: ValidationError | None, extra: list[str] = ()) -> str:
    """The errors of a partition from options and --from-yaml, worded as a config file's are."""
    lines = [*extra, *(describe_error(e, set_hint=False) for e in (err.errors() if err else []))]
    return "invalid partition:\n  " + "\n  ".join(lines)
