"""The workload boundary.

A *workload* is a dataset plus a verifiable reward (``math``, ``mix``): the prompts of a split,
how a prompt is rendered and how a completion is scored. It is registered by name and chosen in
the config. Workloads are a leaf: they import no engine and no component; the episode logic
that drives engines over a workload's tasks (workflows) lives on the rollout side.

A workload's ``params`` (``workload.params`` in the config) are typed: the class names their
pydantic model as ``Params``, which config validation checks them against (a bad or unknown
param fails ``astraflow check`` naming the field) and the class validates them with when it is
built.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, ClassVar, Mapping, Protocol

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from astraflow.configerrors import bool_problems, refuse_bools
from astraflow.registry import Registry


class Workload(Protocol):
    """A dataset of prompts with a verifiable reward, built as ``cls(seed=seed, **params)``
    (``workload.seed``, unless ``params`` sets ``seed``).

    Two methods are optional and looked up by name: ``render_messages(payload)``, the prompt as
    chat messages for a model with a chat template (``astraflow.agents.chat.prompt_ids``), and
    ``demonstration(payload)``, the completion a supervised warm start trains on
    (``runtime.model_build``)."""

    #: the pydantic model of the workload's ``params``. A class registered without one (a
    #: test's ad-hoc workload) gets its params as keyword arguments, unchecked by the config.
    Params: ClassVar[type[BaseModel]]

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """The payloads of a split (``"train"`` or ``"eval"``), deterministic by seed."""

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        """The text the policy sees for a payload."""

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        """Verifiable reward of a completion (1.0 correct, 0.0 wrong)."""

    def source_weights(self) -> dict[str, float]:
        """The workload's sources and their mixing weights. A workload made of several sources
        (``mix``) tags each payload with ``"source": <name>`` and the data layer mixes the
        sources by these weights; a single-source workload returns ``{"": 1.0}``."""


def not_a_workload(obj: Any) -> str | None:
    """Why ``obj`` cannot be a workload (None: it can): a class with ``tasks(split)``."""
    if not isinstance(obj, type) or not callable(getattr(obj, "tasks", None)):
        return ("is not a workload class: a workload is a class built with its params as keywords, with "
                "tasks(split), render_prompt and reward (see docs/extending.md)")
    return None


WORKLOADS: Registry = Registry("workload", not_a_workload)


#: the modules of the shipped workloads (imported to register them)
BUILTIN_MODULES = ("astraflow.workloads.math", "astraflow.workloads.mix", "astraflow.workloads.calculator",
                   "astraflow.workloads.textworld", "astraflow.workloads.search",
                   "astraflow.workloads.dataset", "astraflow.workloads.code", "astraflow.workloads.sim")


def workload_class(name: str) -> type:
    """The workload class registered as ``name``, or a user's ``"package.module:name"``
    (``ValueError`` listing the known ones, or naming a module that does not import)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return WORKLOADS.resolve(name)


def params_model(name: str) -> type[BaseModel] | None:
    """The params model of workload ``name``; None for a workload registered without one."""
    return getattr(workload_class(name), "Params", None)


def unknown_param(name: str, key: str, model: type[BaseModel]) -> str:
    """What an unknown param ``key`` of workload ``name`` is told: the closest known one, if
    any, and all its params (docs/configuration.md does not list a workload's params)."""
    known = sorted(model.model_fields)
    close = difflib.get_close_matches(key, known, n=1)
    return (f"unknown param of workload {name!r}" + (f"; did you mean {close[0]}?" if close else "")
            + f" (its params: {', '.join(known) or 'none'})")


def check_params(name: str, params: Mapping[str, Any]) -> None:
    """Validate ``params`` against workload ``name``'s params model: a pydantic
    ``ValidationError`` (a ``ValueError``) naming each bad or unknown field (an unknown one
    with the workload's params) and refusing a boolean where a number is wanted."""
    model = params_model(name)
    if model is None:
        return
    refuse_bools(dict(params), model)  # pydantic would read `true` as 1
    try:
        model.model_validate(params)
    except ValidationError as err:
        raise ValidationError.from_exception_data(err.title, [
            {"type": PydanticCustomError("unknown_param", unknown_param(name, str(e["loc"][0]), model)),
             "loc": e["loc"], "input": e["input"]}
            if e["type"] == "extra_forbidden" and len(e["loc"]) == 1 else
            {"type": PydanticCustomError(e["type"], e["msg"], e.get("ctx")), "loc": e["loc"], "input": e["input"]}
            for e in err.errors()]) from None


def make_workload(name: str, params: Mapping[str, Any], seed: int) -> Workload:
    """Build workload ``name`` seeded by ``seed`` unless ``params`` sets ``seed``; bad params
    raise ``ValueError`` naming the field and the fix."""
    cls = workload_class(name)
    model = params_model(name)
    bools = bool_problems(dict(params), model, "params") if model is not None else []
    if bools:  # pydantic would read `true` as 1
        raise ValueError(f"{name} workload: " + "; ".join(bools))
    try:
        return cls(**{"seed": seed, **params})
    except ValidationError as err:
        raise ValueError(explain(name, err, params_model(name))) from None


def error_text(error: Mapping[str, Any]) -> str:
    """One pydantic error's message (a validator's own ``ValueError`` text without the
    ``Value error,`` prefix pydantic adds)."""
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    return str(error["msg"])


def explain(name: str, err: ValidationError, model: type[BaseModel] | None) -> str:
    """``err`` as one line: ``<name> workload: <field>: <what is wrong>; ...``, unknown params
    listed together with the known ones (the fields of ``model``)."""
    unknown = sorted(str(e["loc"][0]) for e in err.errors() if e["type"] == "extra_forbidden" and len(e["loc"]) == 1)
    known = f"; known: {sorted(model.model_fields)}" if model is not None else ""
    parts = [f"unknown params {unknown}{known}"] if unknown else []
    for e in err.errors():
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            continue
        loc = ".".join(str(x) for x in e["loc"])
        parts.append(f"{loc}: {error_text(e)}" if loc else error_text(e))
    return f"{name} workload: " + "; ".join(parts)
