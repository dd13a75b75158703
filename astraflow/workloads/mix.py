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

from typing import Any, Mapping

from astraflow.workloads.base import WORKLOADS, Workload, make_workload

#: the payload key that names a payload's source (added by the mixture).
SOURCE_KEY = "source"
_SOURCE_FIELDS = {"workload", "weight", "params"}


@WORKLOADS.register("mix")
class MixtureWorkload:
    """Several registered workloads mixed by weight (``workload.params.sources``).

    ``sources`` maps a source name to ``{workload: <registered name>, weight: <w > 0>,
    params: {...}}`` (``params`` optional; ``weight`` defaults to 1). Every source gets the
    run's ``seed`` unless its ``params`` set one."""

    def __init__(self, seed: int = 0, sources: Mapping[str, Mapping[str, Any]] | None = None, **unknown: Any):
        if unknown:
            raise ValueError(f"mix workload: unknown params {sorted(unknown)}; known: ['sources']")
        if not sources or not isinstance(sources, Mapping):
            raise ValueError(
                "mix workload: params.sources must map at least one source name to "
                "{workload: <name>, weight: <w>, params: {...}}, e.g. "
                "sources: {add2: {workload: math, weight: 3, params: {digits: 2}}}"
            )
        self.sources: dict[str, Workload] = {}
        self._weights: dict[str, float] = {}
        for name, spec in sources.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"mix workload: source names must be non-empty strings, got {name!r}")
            if not isinstance(spec, Mapping):
                raise ValueError(
                    f"mix workload: source {name!r} must be a mapping "
                    "{workload: <name>, weight: <w>, params: {...}}"
                )
            unknown = set(spec) - _SOURCE_FIELDS
            if unknown:
                raise ValueError(
                    f"mix workload: source {name!r} has unknown keys {sorted(unknown)}; known: "
                    f"{sorted(_SOURCE_FIELDS)} (workload parameters go under params:)"
                )
            if "workload" not in spec:
                raise ValueError(f"mix workload: source {name!r} needs `workload: <registered name>`, e.g. math")
            if spec["workload"] == "mix":
                raise ValueError(f"mix workload: source {name!r} is itself a mix; list its sources directly")
            weight = spec.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise ValueError(
                    f"mix workload: source {name!r} has weight {weight!r}; set weight to a number > 0 "
                    "(remove the source to leave it out)"
                )
            params = spec.get("params") or {}
            if not isinstance(params, Mapping):
                raise ValueError(f"mix workload: source {name!r}: params must be a mapping, got {params!r}")
            try:
                self.sources[name] = make_workload(str(spec["workload"]), params, seed)
            except ValueError as err:
                raise ValueError(f"mix workload: source {name!r}: {err}") from None
            self._weights[name] = float(weight)

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

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        return self._source(payload).reward(completion, self._untagged(payload))
