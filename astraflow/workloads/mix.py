"""Mixing several workloads (datasets) by weight: the ``mix`` workload.

A run trains on one workload; to train on several (two difficulty levels, two task families)
the config names ``mix`` and lists its sources, each a registered workload with its own
parameters and a weight::

    workload:
      name: mix
      params:
        sources:
          add2: {workload: math, weight: 3, params: {digits: 2, ops: ["+"]}}
          mul1: {workload: math, weight: 1, params: {digits: 1, ops: ["*"]}}

The mixture is an ordinary workload: its payloads are the sources' payloads, each tagged with
``"source": <name>``, and ``render_prompt`` / ``reward`` dispatch on that tag, so workflows
and RaaS nodes need no change. The *weights* are applied by the data layer
(``astraflow.dataflow.layer``), which asks ``source_weights()``: it rolls out and serves
groups of each source in proportion to them (a workload without ``source_weights`` is one
source ``""`` of weight 1).
"""

from __future__ import annotations

from typing import Annotated, Any, Mapping

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from astraflow.agents.workload import is_agentic
from astraflow.configbase import Strict
from astraflow.workloads.base import (WORKLOADS, Workload, error_text, explain, make_workload, params_model,
                                      workload_class)

#: the payload key that names a payload's source (added by the mixture).
SOURCE_KEY = "source"
_SHAPE = "{workload: <name>, weight: <w>, params: {...}}"


class Source(Strict):
    """One source of a mixture."""

    workload: str
    """Registered workload of the source (not ``mix``: list a mix's sources directly)."""
    weight: float = Field(default=1.0, gt=0, strict=True)
    """Share of the source, relative to the other sources' weights."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The source workload's params (checked against its params model)."""

    @field_validator("workload")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name == "mix":
            raise ValueError("workload mix is itself a mix; list its sources directly")
        if is_agentic(workload_class(name)):  # an unknown name raises, listing the known ones
            raise ValueError(f"workload {name} is agentic (multi-turn); a mix's sources are single-turn "
                             "workloads: run it on its own with workflow: agent")
        return name

    @model_validator(mode="after")
    def _params_fit(self) -> "Source":
        model = params_model(self.workload)
        if model is not None:
            try:
                model.model_validate(self.params)
            except ValidationError as err:
                raise ValueError(explain(self.workload, err, model)) from None
        return self


class MixParams(Strict):
    """The ``mix`` workload's params."""

    sources: dict[Annotated[str, Field(min_length=1)], Source] = Field(
        default_factory=dict, min_length=1, validate_default=True)
    """Source name -> ``{workload, weight, params}``, mixed by weight."""

    @field_validator("sources", mode="wrap")
    @classmethod
    def _name_the_source(cls, sources: Any, handler: Any) -> dict[str, Source]:
        """The sources' errors as sentences that name the source and the fix."""
        try:
            return handler(sources)
        except ValidationError as err:
            raise PydanticCustomError("mix_sources", "{why}", {"why": _why(err)}) from None


def _why(err: ValidationError) -> str:
    """What is wrong with the sources, one clause per source and problem."""
    out: list[str] = []
    unknown: dict[Any, list[str]] = {}
    for e in err.errors():
        if len(e["loc"]) == 0:
            out.append(f"must map at least one source name to {_SHAPE}, e.g. "
                       "sources: {add2: {workload: math, weight: 3, params: {digits: 2}}}")
            continue
        name, *field = e["loc"]
        src = f"source {name!r}"
        if field == ["[key]"]:
            out.append(f"source names must be non-empty strings, got {name!r}")
        elif not field and e["type"] == "model_type":
            out.append(f"{src} must be a mapping {_SHAPE}")
        elif e["type"] == "extra_forbidden":
            unknown.setdefault(name, []).append(str(field[0]))
        elif e["type"] == "missing":
            out.append(f"{src} needs `{field[0]}: <registered name>`, e.g. math")
        elif field == ["weight"]:
            out.append(f"{src} has weight {e['input']!r}; set weight to a number > 0 "
                       "(remove the source to leave it out)")
        elif e["type"] == "value_error":  # a validator's sentence (unknown workload, a nested mix, bad params)
            out.append(f"{src}: {error_text(e)}")
        else:
            out.append(f"{src}: {'.'.join(map(str, field))}: {error_text(e)}")
    for name, keys in unknown.items():
        out.append(f"source {name!r} has unknown keys {sorted(keys)}; known: {sorted(Source.model_fields)} "
                   "(workload parameters go under params:)")
    return "; ".join(dict.fromkeys(out))


@WORKLOADS.register("mix")
class MixtureWorkload:
    """Several registered workloads mixed by weight (``workload.params.sources``, ``MixParams``).
    Every source gets the run's ``seed`` unless its ``params`` set one."""

    Params = MixParams

    def __init__(self, seed: int = 0, **params: Any):
        cfg = MixParams.model_validate(params)
        self.sources: dict[str, Workload] = {
            name: make_workload(src.workload, src.params, seed) for name, src in cfg.sources.items()}
        self._weights: dict[str, float] = {name: src.weight for name, src in cfg.sources.items()}

    def source_weights(self) -> dict[str, float]:
        """Source name -> weight (as configured, not normalised), in config order."""
        return dict(self._weights)

    def _tagged(self, name: str, split: str) -> list[dict[str, Any]]:
        out = []
        for payload in self.sources[name].tasks(split):
            if SOURCE_KEY in payload:
                raise ValueError(
                    f"mix workload: source {name!r} ({type(self.sources[name]).__name__}) already uses "
                    f"the payload key {SOURCE_KEY!r}, which the mixture needs; rename that key in the workload"
                )
            out.append({**payload, SOURCE_KEY: name})
        return out

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """Every source's payloads, tagged with their source. ``train``: source after source
        (the data layer draws each source in its own shuffled order). ``eval``: interleaved
        round-robin, so that any prefix (``eval.num_prompts``) holds every source."""
        per = [self._tagged(name, split) for name in self.sources]
        if split != "eval":
            return [p for lst in per for p in lst]
        out = []
        for i in range(max(len(lst) for lst in per)):
            out.extend(lst[i] for lst in per if i < len(lst))
        return out

    def _source(self, payload: Mapping[str, Any]) -> Workload:
        name = payload.get(SOURCE_KEY)
        if name not in self.sources:
            raise ValueError(
                f"mix workload: payload has source {name!r}, not one of {sorted(self.sources)}; "
                "payloads must come from this mixture's tasks()"
            )
        return self.sources[name]

    @staticmethod
    def _untagged(payload: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in payload.items() if k != SOURCE_KEY}

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        return self._source(payload).render_prompt(self._untagged(payload))

    def render_messages(self, payload: Mapping[str, Any]) -> list[dict[str, str]] | None:
        """The source's chat messages, or ``None`` for a source whose prompts are plain text."""
        render = getattr(self._source(payload), "render_messages", None)
        return render(self._untagged(payload)) if render is not None else None

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        return self._source(payload).reward(completion, self._untagged(payload))

    @property
    def uses_sandbox(self) -> bool:
        """Whether a source's rewards run programs in the sandbox (its deadline handling and the
        nodes' start-up check then apply to the mixture)."""
        return any(getattr(s, "uses_sandbox", False) for s in self.sources.values())

    def reward_and_stats(self, completion: str, payload: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        """The source's reward and episode statistics (none for a source that reports none)."""
        source, untagged = self._source(payload), self._untagged(payload)
        fn = getattr(source, "reward_and_stats", None)
        return fn(completion, untagged) if fn is not None else (source.reward(completion, untagged), {})
