"""Dataflow rules from users, held to their contract: each stage method is wrapped so that an
error, a wrong return or a state that is not plain JSON raises ``RuleError`` naming the rule
(``dataflow.<stage> (<type>)``) and the user's own line, not the node or trainer that called it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import traceback
from typing import TYPE_CHECKING, Any, Sequence

from astraflow.registry import Registry

if TYPE_CHECKING:
    from astraflow.dataflow.rules import BufferedGroupView

log = logging.getLogger("astraflow.dataflow")


def plain_state(rule: Any) -> dict[str, Any]:
    """``rule.state_dict()``, checked to be plain JSON (``RuleError`` naming the rule and the
    value otherwise). Checked when the rule is built and at each saved step, not on every
    change-log record (that one is pickled, and this walk is not free)."""
    state = rule.state_dict()
    label = getattr(rule, "_checked", type(rule).__name__)
    why = plain_json_problem(state) if isinstance(state, dict) else f"state_dict returned a {type(state).__name__}"
    if why is not None:
        raise RuleError(f"{label}.state_dict is not plain JSON: {why}; a rule's state is dicts with str keys, "
                        "lists, numbers, strings, bools and None (docs/extending.md), so that a run can save "
                        "and restore it")
    return state


class RuleError(RuntimeError):
    """A dataflow rule raised, or returned what its stage does not take; the message names the
    rule (``dataflow.<stage> (<type>)``) so a user's bug is not blamed on the node or trainer
    that called it."""


def plain_json_problem(value: Any, where: str = "state") -> str | None:
    """What in ``value`` is not plain JSON (dicts with str keys, lists, numbers, strings,
    bools, None), or None: saved and loaded back, anything else would not be the same value."""
    if value is None or isinstance(value, (bool, int, float, str)):  # numpy.float64 is a float
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (why := plain_json_problem(v, f"{where}[{i}]")) is not None:
                return why
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where} has the key {k!r} of type {type(k).__name__} (a JSON object's keys are strings)"
            if (why := plain_json_problem(v, f"{where}[{k!r}]")) is not None:
                return why
        return None
    hint = " (use a list)" if isinstance(value, (tuple, set, frozenset)) else ""
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}{hint}"


_STAGE_OF = (("curator", "CURATORS"), ("group_filter", "FILTERS"), ("ordering", "ORDERINGS"))


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or type(x).__name__ == "bool_"  # numpy's too


def _user_frame(rule: Any, err: BaseException) -> traceback.FrameSummary:
    """The frame of ``err``'s traceback in the rule's own source file, the innermost (a rule
    that called a library failing inside it is named at its own line, not the library's)."""
    frames = traceback.extract_tb(err.__traceback__)
    try:
        source = inspect.getsourcefile(type(rule))
    except TypeError:  # a class without a source file
        source = None
    own = [f for f in frames if source is not None and f.filename == source]
    return own[-1] if own else frames[min(1, len(frames) - 1)]  # [0] is the wrapper's own call


@functools.cache
def takes_group(keep: Any) -> bool:
    """Whether a group filter's ``keep`` (as its class defines it: ``self`` first) takes the
    group's view: its argument after ``rewards`` is named ``group``."""
    try:
        params = [p for p in inspect.signature(keep).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and params[2].name == "group"


def checked(rule: Any, registry: Registry, name: str) -> Any:
    """``rule`` with its stage methods and ``state_dict`` replaced (on the instance: its type
    stays the rule's class) by ones that raise `RuleError` naming the rule when it raises, when
    it returns what its stage does not take, or when its state is not plain JSON."""
    from astraflow.dataflow import rules  # the registries (they import this module)

    stage = next((s for s, reg in _STAGE_OF if getattr(rules, reg) is registry), registry.kind)
    label = f"dataflow.{stage} ({name})"
    inner = getattr(rule, "__dict__", None)
    if inner is None or "_checked" in inner:
        return rule  # without an instance dict (slots) it is called as it is; checked once
    logged: set[str] = set()
    with_group = takes_group(getattr(type(rule), "keep", None))

    def call(method: str, *args: Any) -> Any:
        try:
            return getattr(type(rule), method)(rule, *args)
        except RuleError:
            raise
        except Exception as err:
            where = _user_frame(rule, err)  # the user's line, in the run's one-line reason
            if method not in logged:  # its whole traceback once, in the data layer's worker log
                logged.add(method)
                log.error("%s.%s raised", label, method, exc_info=err)
            raise RuleError(f"{label}.{method} raised {type(err).__name__}: {err} "
                            f"(at {where.filename}:{where.lineno} in {where.name})") from err

    def accept(prompt_key: str, payload: dict) -> bool:
        out = call("accept", prompt_key, payload)
        if not _is_bool(out):
            raise RuleError(f"{label}.accept returned {out!r}: a curator's accept must return a bool")
        return bool(out)

    def observe(prompt_key: str, rewards: Sequence[float]) -> None:
        call("observe", prompt_key, rewards)

    def keep(rewards: Sequence[float], group: Any = None) -> tuple[bool, str | None]:
        out = call("keep", rewards, group) if with_group else call("keep", rewards)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and _is_bool(out[0])
                and (out[1] is None or isinstance(out[1], str))):
            raise RuleError(f"{label}.keep returned {out!r}: a group filter's keep must return (bool, reason-or-None),"
                            " e.g. `return True, None` or `return False, \"too_easy\"`")
        return bool(out[0]), out[1]

    def order(groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]:
        out = list(call("order", groups, version, max_staleness))
        if sorted(out) != list(range(len(groups))):
            raise RuleError(f"{label}.order returned {len(out)} indices for {len(groups)} buffered groups, not each "
                            "index 0..n-1 once: an ordering only orders the buffer; leave groups out with "
                            "dataflow.group_filter or max_staleness instead")
        return out

    def state_dict() -> dict[str, Any]:
        state = call("state_dict")
        if isinstance(state, dict):  # the checked methods are no state (a RuleBase lists the instance's attributes)
            state = {k: v for k, v in state.items() if not (k in wrappers and v is wrappers[k])}
        return state

    stage_methods = {"accept": accept, "observe": observe, "keep": keep, "order": order}
    wrappers = {m: f for m, f in stage_methods.items() if callable(getattr(type(rule), m, None))}
    wrappers["state_dict"] = state_dict
    inner.update(wrappers)
    inner["_checked"] = label
    return rule
