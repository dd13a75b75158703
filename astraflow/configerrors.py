"""Reading config text and explaining what is wrong with it: YAML that refuses a key given
twice, and pydantic's errors as one line each that names the key (as a path a user can write or
``--set``: never a union's tag), the value given and the fix (a text field given a YAML boolean
or number is told to quote it; a boolean where a number is wanted is refused rather than taken as
1 or 0; a value where a section is wanted names the section's keys)."""

from __future__ import annotations

import difflib
import re
import types
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Tag, ValidationError
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the fix."""


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice (YAML keeps the last silently)."""


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_DIGITS = r"[0-9](?:_?[0-9])*"  # digits, an underscore between two of them allowed (10_000)
#: YAML 1.2 core integers: decimal (a leading zero is no octal: 010 is 10), 0o octal, 0x hex
_INT = re.compile(rf"(?:[-+]?{_DIGITS}|0o[0-7]+|0x[0-9a-fA-F]+)\Z")
#: YAML 1.2 core floats: a point or an exponent (1e-1, 1e3, .5, 2.), and the infinities and nan
_FLOAT = re.compile(rf"(?:[-+]?(?:\.{_DIGITS}|{_DIGITS}\.(?:{_DIGITS})?|{_DIGITS}(?=[eE]))(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z")


def _core_numbers(resolvers: dict[str, list]) -> dict[str, list]:
    """YAML 1.1's implicit resolvers with its integers and floats replaced by YAML 1.2's core
    schema: ``010`` is 10 (1.1: octal 8), ``1e-1`` and ``1e3`` are floats (1.1: text), and
    base-60 numbers (``12:00:00``, 1.1: 43200) stay text; a walltime or a clock time is meant,
    never a number. Booleans, nulls and timestamps are 1.1's."""
    out = {first: [(tag, rx) for tag, rx in pairs if tag not in (_INT_TAG, _FLOAT_TAG)]
           for first, pairs in resolvers.items()}
    for first in "+-.0123456789":  # integers first, as YAML 1.2 resolves them (no text matches both)
        out[first] = [*([(_INT_TAG, _INT)] if first != "." else []), (_FLOAT_TAG, _FLOAT), *out.get(first, [])]
    return {first: pairs for first, pairs in out.items() if pairs}


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An integer as YAML 1.2 reads it (``_INT``): decimal whatever its leading zeros, ``0o``
    octal, ``0x`` hex (``yaml.SafeLoader`` reads ``010`` as octal and ``0o17`` not at all)."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
    try:
        return sign * int(digits[2:] if base != 10 else digits, base)
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer", node.start_mark) from None


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: YAML itself keeps the
    last one, so a second ``run:`` block would silently discard the first. Numbers are YAML
    1.2's (``_core_numbers``): ``010`` is 10, ``1e-1`` a float, ``walltime: 12:00:00`` text
    (this class only: ``yaml.safe_load`` is unchanged)."""

    yaml_implicit_resolvers = _core_numbers(yaml.SafeLoader.yaml_implicit_resolvers)

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


UniqueKeyLoader.add_constructor(_INT_TAG, _construct_int)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (`DuplicateKey`, a ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def yaml_problem(err: BaseException) -> str:
    """A YAML error in one line, where in the file and what (``line 3, column 1: expected the node
    content, but found '<stream end>' (while parsing a flow node)``), not PyYAML's several lines
    naming ``<unicode string>``."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return " ".join(str(err).split())
    context = getattr(err, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def dotted_key(key: str) -> str:
    """A ``--set`` key with list elements written as the errors write them (``policies[solver].trainer.lr``)
    in the dotted form (``policies.solver.trainer.lr``): a path copied from a message can be set."""
    return re.sub(r"\[([^\[\].]+)\]", r".\1", key)


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


def _members(annotation: Any) -> list[Any]:
    """The types a value of ``annotation`` may be: a union's members (an optional's None left
    out, each member's ``Annotated`` kept for its ``Tag``), else ``annotation`` alone."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _labels(member: Any) -> set[str]:
    """The names pydantic gives union member ``member`` in an error's location: its ``Tag``, its
    class name, the ``type`` a rule model is told apart by."""
    bare = get_args(member)[0] if get_origin(member) is Annotated else member
    names = {str(m.tag) for m in getattr(member, "__metadata__", ()) if isinstance(m, Tag)}
    names.add(getattr(bare, "__name__", repr(bare)))
    if isinstance(bare, type) and issubclass(bare, BaseModel) and "type" in bare.model_fields:
        names.add(str(bare.model_fields["type"].default))
    return names


def config_loc(model: Any, loc: tuple) -> tuple[tuple, Any]:
    """The location ``loc`` of an error of ``model`` as a config path, and the annotation found
    there (None where unknown). Where a value is one of a union's members pydantic puts the
    member's tag in the location (``dataflow.curator.filter_solved.params``): no key a user can
    write or ``--set``, so it is left out."""
    path: list = []
    ann = model
    for item in loc:
        members = _members(ann) if ann is not None else []
        if len(members) > 1:  # ``item`` is the tag of the member that failed
            ann = next((m for m in members if str(item) in _labels(m)), None)
            continue
        ann = members[0] if members else None
        path.append(item)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(item) if isinstance(item, str) else None
            ann = field.annotation if field is not None else None
        elif ann is not None:
            ann = _element(ann, list) or _element(ann, dict)
    return tuple(path), ann


def _section_line(loc: str, section: type[BaseModel], given: Any) -> str:
    """A value given where ``section`` is wanted: set its switch (an ``enabled`` field) or its keys."""
    got = "null" if given is None else str(given).lower() if isinstance(given, bool) else repr(given)
    keys = list(section.model_fields)
    if "enabled" in keys:
        switch = str(given).lower() if isinstance(given, bool) else "false"
        return f"{loc}: is a section, not a value (got {got}); set e.g. {loc}.enabled={switch}"
    if not keys:
        return f"{loc}: is a section that takes no keys, not a value (got {got}); leave it out or write {{}}"
    return f"{loc}: is a section, not a value (got {got}); set its keys ({', '.join(keys)}), e.g. {loc}.{keys[0]}=..."


def _unknown_key(loc: str, key: Any, model: Any, parent: tuple) -> str:
    """An unknown key as a likely misspelling: the nearest key of its section and the section's
    keys, as an unknown workload param is told (the section unknown: where fields are documented)."""
    section = model_of(config_loc(model, parent)[1]) if model is not None else None
    if section is None:
        return (f"{loc}: unknown key (check the spelling; docs/configuration.md lists the sections and where each "
                "field is documented)")
    keys = list(section.model_fields)
    if not keys:
        return f"{loc}: unknown key; this section takes no keys (leave it out or write {{}})"
    close = difflib.get_close_matches(str(key), keys, n=1)
    return f"{loc}: unknown key{f'; did you mean {close[0]}?' if close else ''} (its keys: {', '.join(keys)})"


#: error types whose message is the whole explanation (the value given is not added)
OWN_WORDS = frozenset({"value_error", "assertion_error", "bool_number", "unknown_param"})


#: a list element's name usable in a location (and in ``--set``); any other is named by its index
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def dotted(path: tuple, data: Any = None) -> str:
    """``path`` dotted, an element of a list of named sections written as the checks across fields
    write it (``policies[solver].trainer.lr``, which ``--set`` takes too), found in the config
    ``data``; any other element by its index."""
    out: list[str] = []
    node = data
    for x in path:
        if isinstance(x, int) and isinstance(node, list) and out:
            node = node[x] if -len(node) <= x < len(node) else None
            name = node.get("name") if isinstance(node, dict) else None
            if isinstance(name, str) and _LABEL.fullmatch(name):
                out[-1] += f"[{name}]"
                continue
        else:
            node = node.get(x) if isinstance(node, dict) else None
        out.append(str(x))
    return ".".join(out)


def describe_error(e: dict[str, Any], set_hint: bool = True, model: type[BaseModel] | None = None,
                   data: Any = None) -> str:
    """One pydantic error as ``loc: message``: the value given where it is a plain value, an
    unknown key as a likely misspelling, a string field given a YAML boolean or number (``no``,
    ``2024``) told to quote it, a value where a section is wanted told the section's keys.
    ``model``: the config type validated, whose union tags are left out of ``loc``; ``data``:
    what was validated, whose named list elements are named in ``loc`` (`dotted`)."""
    path, ann = config_loc(model, tuple(e["loc"])) if model is not None else (tuple(e["loc"]), None)
    loc = dotted(path, data)
    if not loc:  # a check across fields, whose message names them itself
        return e["msg"].removeprefix("Value error, ")
    msg = e["msg"].removeprefix("Value error, ")
    if msg.startswith((f"{loc}:", f"{loc}.")):  # a section's check that names the field itself
        return msg
    given = e.get("input")
    if e["type"] == "extra_forbidden":
        return _unknown_key(loc, path[-1], model, tuple(e["loc"])[:-1])
    section = model_of(ann) if ann is not None else None
    if e["type"] in ("model_type", "model_attributes_type") and section is not None and not isinstance(given, dict):
        return _section_line(loc, section, given)
    if e["type"] == "string_type" and isinstance(given, (bool, int, float)):
        if isinstance(given, bool):
            got, why, text = f"the boolean {str(given).lower()}", "yes, no, on, off, true, false as booleans", "..."
        else:
            got, why, text = f"the number {given}", "digits as a number", str(given)
        return (f"{loc}: {msg}, got {got} (YAML reads unquoted {why}); quote the text: "
                f"{path[-1]}: \"{text}\" in the file"
                + (f", or --set {loc}='\"{text}\"'" if set_hint else ""))
    if e["type"] in OPTION_FIXES and isinstance(given, float) and given != given:  # nan fails any bound
        return f"{loc}: nan is not a number; use a finite one"
    if e["type"] not in OWN_WORDS and isinstance(given, (str, int, float, bool)):
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


#: what a boolean where a number is wanted is told (``want``: "an integer" or "a number")
BOOL_WORDS = ("Input should be {want}, got the boolean {value} (YAML reads true, false, yes, no, on, off as "
              "booleans); write a number")


def _bools(annotation: Any, value: Any, loc: tuple, stop: type | None) -> list[tuple[tuple, str, bool]]:
    """``(location, want, boolean)`` of each boolean in ``value`` where ``annotation`` wants a
    number: the value itself, a value of a ``dict[K, number]`` or an element of a
    ``list[number]``, or in a section (a model: not one of ``stop``'s, which check themselves)."""
    want = _numeric(annotation)
    if isinstance(value, bool):
        return [(loc, want, value)] if want else []
    sub = model_of(annotation, value)
    if sub is None and isinstance(value, (dict, list)):
        inner = _numeric(_element(annotation, dict if isinstance(value, dict) else list))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return [((*loc, k), inner, v) for k, v in items if inner and isinstance(v, bool)]
    if sub is None or (stop is not None and issubclass(sub, stop)):
        return []
    if isinstance(value, list):
        return [found for i, el in enumerate(value) for found in _bools(sub, el, (*loc, i), stop)]
    if not isinstance(value, dict):
        return []
    return [found for key, v in value.items() if isinstance(key, str) and key in sub.model_fields
            for found in _bools(sub.model_fields[key].annotation, v, (*loc, key), stop)]


def bool_problems(data: Any, model: type[BaseModel], loc: str = "") -> list[str]:
    """A boolean (YAML's ``true``, ``yes``, ``on``) where a field of ``model`` wants a number,
    also as a value of a ``dict[K, number]`` field or an element of a ``list[number]`` one:
    pydantic would take it as 1 or 0 silently. One line per value, its location dotted as
    pydantic's are."""
    if not isinstance(data, dict):
        return []
    return [f"{'.'.join(((loc,) if loc else ()) + (dotted(where, data),))}: "
            + BOOL_WORDS.format(want=want, value=str(value).lower())
            for where, want, value in _bools(model, data, (), None)]


def refuse_bools(value: Any, annotation: Any, stop: type | None = None) -> None:
    """Raise a ``ValidationError`` with one error (type ``bool_number``) per boolean in ``value``
    where ``annotation`` wants a number (`bool_problems`), located from ``value``: raised in a
    validator, the field fails, so no check across fields reads the boolean as 1 or 0."""
    found = _bools(annotation, value, (), stop)
    if found:
        raise ValidationError.from_exception_data("config", [
            {"type": PydanticCustomError("bool_number", BOOL_WORDS, {"want": want, "value": str(v).lower()}),
             "loc": where, "input": v} for where, want, v in found])


def format_validation(err: ValidationError | None, extra: list[str] = (), model: type[BaseModel] | None = None,
                      data: Any = None) -> str:
    """The errors of ``err``, an error of ``model`` validating ``data`` (those of a field in
    ``extra``, the `bool_problems`, said once; so is a line two union members both gave)."""
    said = {line.split(": ", 1)[0] for line in extra}
    lines = [describe_error(e, model=model, data=data) for e in (err.errors() if err is not None else [])]
    lines = [line for line in dict.fromkeys(lines) if line.split(": ", 1)[0] not in said]
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
    ``--option VALUE: the fix``: the fields are named as the options that set them (a check
    across fields, which has no one field, names them itself)."""
    return "\n".join(option_error(e) for e in err.errors())


def option_error(e: dict[str, Any]) -> str:
    """One pydantic error of a field set by an option, as ``--option VALUE: the fix``."""
    def plain(v: Any) -> Any:  # 0.0 -> 0, as a user would type it
        return int(v) if isinstance(v, float) and v.is_integer() else v

    if not e["loc"]:
        return e["msg"].removeprefix("Value error, ")
    option = "--" + "-".join(str(x) for x in e["loc"]).replace("_", "-")
    ctx = {k: plain(v) for k, v in (e.get("ctx") or {}).items()}
    fix = OPTION_FIXES.get(e["type"], "").format(**ctx) or e["msg"].removeprefix("Value error, ")
    if fix.startswith((f"{e['loc'][-1]} is ", f"{e['loc'][-1]} '")) and ": " in fix:  # the value once is enough
        fix = fix.split(": ", 1)[1]
    return f"{option} {plain(e.get('input'))}: {fix}"


def partition_errors(err: ValidationError | None, extra: list[str] = (), options: Any = (),
                     model: type[BaseModel] | None = None) -> str:
    """The errors of a partition from options and --from-yaml, worded as a config file's are; a
    field in ``options`` (given as an option) is named as that option (`option_error`). ``model``:
    the partition's type, whose keys an unknown one is told."""
    lines = [*extra, *(option_error(e) if e["loc"] and e["loc"][0] in options
                       else describe_error(e, set_hint=False, model=model) for e in (err.errors() if err else []))]
    return "invalid partition:\n  " + "\n  ".join(lines)
