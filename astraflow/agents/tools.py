"""Tools an agent may call, the one tool-call syntax, and running calls under deadlines.

The syntax (the Hermes/Qwen convention, which chat templates of tool-using models express)::

    <tool_call>{"name": "search", "arguments": {"query": "capital of Norway"}}</tool_call>

A turn may hold several calls; each result comes back as one ``tool`` message. A call that
cannot be read (no closing tag, bad JSON, no ``name``), names an unknown tool or passes
arguments that do not fit the tool's schema gets an *error observation* the model can learn
from, and counts as an invalid call; it never fails the episode; so does a call for which the
tool raises ``ToolError`` (the model's mistake, in the tool's words). A tool that raises
anything else, runs past its timeout or returns something that is neither text nor JSON fails
the episode (``EpisodeError``).

Tools run off the node's event loop: an ``async def`` tool is awaited with its deadline, a
plain function runs on a thread, so a slow tool stalls neither heartbeats nor other episodes. A
thread cannot be killed: a plain tool that never returns keeps its (daemon) thread until it
does (code that may never return belongs in the code sandbox, a process of its own).
"""

from __future__ import annotations

import inspect
import json
import re
import time
from dataclasses import dataclass, replace
from typing import Annotated, Any, Callable, Iterable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from astraflow.agents.env import Action, EpisodeError, ToolCall, ToolError
from astraflow.agents.call_threads import CANCEL_STUCK, CallAbandoned, CallDeadline, CallThreads, awaited

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


#: a tool call past its timeout (apart from a ``TimeoutError`` the tool raised itself)
ToolDeadline = CallDeadline


def _ToolThreads(size: int = 32) -> CallThreads:
    """The threads plain tools run on (``CallThreads``: a stuck call gives its slot back)."""
    return CallThreads(size, name="astraflow-tool")


_THREADS = _ToolThreads()


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call in the tool-call syntax (what a demonstration writes)."""
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + CALL_CLOSE


def parse_action(text: str) -> Action:
    """The model turn ``text`` as an ``Action``: its well-formed calls and, for every call that
    could not be read, why."""
    calls, errors, order = [], [], []

    def error(why: str) -> None:
        order.append((False, len(errors)))
        errors.append(why)

    for m in _CALL.finditer(text):
        body, closed = m.group(1), m.group(0).endswith(CALL_CLOSE)
        if not closed:
            error(f"a tool call must end with {CALL_CLOSE}")
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            error(f"the tool call is not valid JSON ({err.msg}: character {err.pos})")  # msg may end in "at"
            continue
        except RecursionError:
            error("the tool call's JSON is nested too deeply")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or set(obj) - {"name", "arguments"}:
            error('a tool call must be {"name": <tool>, "arguments": {...}}'
                  + (f" (not {sorted(set(obj) - {'name', 'arguments'})})" if isinstance(obj, dict) else ""))
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            error(f"the arguments of {obj['name']} must be a JSON object")
            continue
        order.append((True, len(calls)))
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return Action(text=text, tool_calls=tuple(calls), errors=tuple(errors), order=tuple(order))


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by ``name`` with JSON ``arguments`` fitting ``schema``."""

    name: str
    description: str
    fn: Callable[..., Any]
    #: the pydantic model of the arguments (built from ``fn``'s signature by ``tool``)
    arguments: type[BaseModel]
    timeout_s: float = 10.0
    #: ``fn`` is a method (its first parameter ``self``): read from an instance, the tool binds to it
    method: bool = False

    def __get__(self, obj: Any, objtype: Any = None) -> "Tool":
        if obj is None or not self.method:
            return self
        return replace(self, fn=self.fn.__get__(obj, objtype), method=False)

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema of the tool (name, description, parameters), as chat templates take it."""
        params = self.arguments.model_json_schema()
        params.pop("title", None)
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, timeout_s: float = 10.0,
         description: str | None = None):
    """Make a ``Tool`` of a function (``@tool`` or ``@tool(timeout_s=2)``): its typed parameters
    are the JSON arguments, its docstring's first line the description."""

    def make(f: Callable[..., Any]) -> Tool:
        try:  # annotations as strings (``from __future__ import annotations``), read in f's module
            sig = inspect.signature(f, eval_str=True)
        except Exception as err:
            raise TypeError(f"tool {f.__qualname__}: its parameter annotations cannot be evaluated in "
                            f"{f.__module__} ({type(err).__name__}: {err}); import the types they name "
                            "at the module's top level") from err
        fields, params = {}, list(sig.parameters.values())
        method = bool(params) and params[0].name == "self"
        for p in params[1:] if method else params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):  # a JSON object's keys name each argument
                star = "*" if p.kind is p.VAR_POSITIONAL else "**"
                raise TypeError(f"tool {f.__qualname__}: {star}{p.name} cannot be called with JSON arguments; "
                                "give the tool named parameters (a list or a dict parameter for many values)")
            if p.kind is p.POSITIONAL_ONLY:  # called as fn(**arguments): a name it does not take
                raise TypeError(f"tool {f.__qualname__}: {p.name} is positional-only (before '/') and cannot be "
                                "called with JSON arguments, which name it; drop the '/'")
            ann = Any if p.annotation is inspect.Parameter.empty else p.annotation
            # each parameter by its own name as an alias of a neutral field: a name pydantic holds
            # (``model_dump``, ``model_config``, ``_x``) would otherwise fail or silently drop it
            fields[f"arg{len(fields)}"] = (Annotated[ann, Field(alias=p.name)],
                                           ... if p.default is inspect.Parameter.empty else p.default)
        try:
            model = create_model(f"{f.__name__}_args", __config__=ConfigDict(extra="forbid", allow_inf_nan=False),
                                 **fields)
        except Exception as err:  # pydantic's own error would not say which tool
            raise TypeError(f"tool {f.__qualname__}: its parameters cannot be JSON arguments ({type(err).__name__}: "
                            f"{str(err).partition(chr(10))[0]}); annotate each with a JSON type (str, int, float, "
                            "bool, list, dict or a pydantic model)") from err
        desc = description or (inspect.getdoc(f) or "").split("\n")[0]
        return Tool(name=name or f.__name__, description=desc, fn=f, arguments=model, timeout_s=timeout_s,
                    method=method)

    return make(fn) if fn is not None else make


@dataclass
class ToolResult:
    """One call's outcome: the text the model sees and whether the call was valid."""

    content: str
    valid: bool
    seconds: float = 0.0


class ToolBox:
    """The tools of one episode, by name."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.method:  # ``@tool`` on a method, read from the class: called without its ``self``
                raise ValueError(f"tool {t.name} is a method read from its class (ToolBox([{t.name}]) in the class "
                                 f"body): build the ToolBox in __init__ from the instance's, "
                                 f"self.tools = ToolBox([self.{t.name}])")
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t

    def __len__(self) -> int:
        return len(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def describe(self) -> str:
        """One line per tool, ``name(arg: type, ...): description``, for a system prompt; an
        argument with a default is written ``arg: type = default``."""
        lines = []
        for t in self.tools.values():
            schema = t.arguments.model_json_schema()
            defs = schema.get("$defs", {})
            props = schema.get("properties", {})
            args = ", ".join(f"{k}: {_type_name(v, defs)}"
                             + (f" = {json.dumps(v['default'])}" if "default" in v else "")
                             for k, v in props.items())
            lines.append(f"{t.name}({args}): {t.description}")
        return "\n".join(lines)

    async def run(self, call: ToolCall) -> ToolResult:
        """Run one call under its tool's deadline; see the module docstring for what is an
        error observation and what fails the episode."""
        t = self.tools.get(call.name)
        if t is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(f"error: unknown tool {call.name!r}; tools: {known}", valid=False)
        try:
            # strictly, as the JSON the schema describes: a string for a number or a bool fits no schema
            args = t.arguments.model_validate_json(json.dumps(dict(call.arguments)), strict=True)
        except ValidationError as err:
            why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in err.errors())
            return ToolResult(f"error: wrong arguments for {t.name}: {why}", valid=False)
        kwargs = {f.alias: getattr(args, k) for k, f in type(args).model_fields.items()}
        t0 = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(t.fn):
                out = await awaited(t.fn(**kwargs), t.timeout_s)
            else:
                out = await _THREADS.call(lambda: t.fn(**kwargs), t.timeout_s)
        except CallAbandoned:
            raise EpisodeError(f"tool {t.name} ran past its {t.timeout_s:g} s timeout and {CANCEL_STUCK}") from None
        except ToolDeadline:  # not a TimeoutError the tool raised itself
            raise EpisodeError(f"tool {t.name} ran past its {t.timeout_s:g} s timeout") from None
        except ToolError as err:  # the model's call, in the tool's words
            return ToolResult(f"error: {err}", valid=False, seconds=time.perf_counter() - t0)
        except (Exception, SystemExit) as err:  # sys.exit in a tool (an argparse CLI's bad input) is its fault
            raise EpisodeError(f"tool {t.name} raised {type(err).__name__}: {err} (a tool that raises fails its "
                               "episode, which is resampled; for a call the model got wrong raise "
                               "astraflow.agents.env.ToolError, which the model sees as the call's error)") from err
        return ToolResult(_as_text(t.name, out), valid=True, seconds=time.perf_counter() - t0)


def _type_name(schema: dict[str, Any], defs: dict[str, Any], seen: tuple[str, ...] = ()) -> str:
    """A JSON schema's type in a few characters (``integer``, ``"a" | "b"``, ``array of string``,
    ``string | null``, an object's fields in braces), as ``ToolBox.describe`` tells the model:
    an ``Optional``, enum, list or pydantic-model argument is not ``any``."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return name if name in seen else _type_name(defs.get(name, {}), defs, seen + (name,))  # a recursive model
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type_name(s, defs, seen) for s in schema[key])
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " | ".join(kind)
    if kind == "array" and isinstance(schema.get("items"), dict):
        return f"array of {_type_name(schema['items'], defs, seen)}"
    if kind == "object" and schema.get("properties"):
        return "{" + ", ".join(f"{k}: {_type_name(v, defs, seen)}" for k, v in schema["properties"].items()) + "}"
    return kind


def _as_text(name: str, out: Any) -> str:
    """A tool's result as the text the model reads: text as it is, anything else as JSON (NumPy
    scalars and arrays, what computing a result with NumPy gives, as the numbers they hold)."""
    if isinstance(out, str):
        return out
    try:
        return json.dumps(out, default=_numpy_as_json)
    except (TypeError, ValueError) as err:
        raise EpisodeError(f"tool {name} returned {type(out).__name__}, neither text nor JSON ({err}): return a "
                           "str, or a dict, list, number, bool or None") from None


def _numpy_as_json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

