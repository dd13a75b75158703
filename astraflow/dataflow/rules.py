"""Dataflow rules: which prompts are rolled out, which groups are kept, in which order.

The data layer's decisions about data, registered by name and chosen in the config. They are
called *rules* (not policies: the policies are the models being trained). Stages (each a small
protocol; the data layer calls them and nothing else knows they exist):

* ``Curator`` before rollout: ``accept(prompt_key, payload) -> bool`` and ``observe(prompt_key,
  rewards)`` after a group ends (to learn which prompts are worth rolling out).
* ``GroupFilter`` after rollout: ``keep(rewards) -> (bool, reason)`` for one (group, policy);
  a ``keep(rewards, group)`` also gets the group's ``GroupView`` (lengths, how each sequence ended).
* ``Ordering`` of the buffer: ``order(groups, version, max_staleness) -> list[index]`` in
  consumption order.

A rule class is built from its validated parameters, ``cls(params, seed)``: ``Params`` (a
pydantic model next to the class) holds the parameters with their defaults and bounds, the
one place they are written; ``astraflow/dataflow/config.py`` uses it to check a config before
any process starts. A new rule is a new class with a ``Params`` model and a
``@CURATORS.register(...)`` (or ``FILTERS`` / ``ORDERINGS``) decorator; a config names it as
``package.module:name`` (the module is imported, which registers it), as workflows are named.

Every rule keeps its state in plain JSON-able attributes and implements
``state_dict()``/``load_state_dict()`` so a run can save and restore it. Randomised rules draw
from their own ``random.Random`` (``self._rng``, seeded from the run seed unless their
``params.seed`` says otherwise). Its state is part of ``state_dict()`` (key ``rng_state``), so
a restored rule *continues* its random stream: a run resumed from a checkpoint makes the same
decisions the uninterrupted run would have made from that point, given the same observations.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence

from pydantic import BaseModel, Field

from astraflow.configbase import Strict
# the contract every rule is held to; RuleError and plain_json_problem are part of this module's API
from astraflow.dataflow.rule_checks import RuleError, checked, plain_json_problem, plain_state  # noqa: F401
from astraflow.dataflow.rule_checks import takes_group
from astraflow.registry import Registry


def not_a_rule(obj: Any, methods: tuple[str, ...] = ()) -> str | None:
    """Why ``obj`` cannot be a dataflow rule with ``methods`` (None: it can): a class with a
    pydantic ``Params``, its state methods and its stage's."""
    params = getattr(obj, "Params", None)
    if not isinstance(obj, type) or not (isinstance(params, type) and issubclass(params, BaseModel)):
        return ("is not a rule class: a rule is a class with a pydantic Params model, built as "
                "cls(params, seed) (subclass RuleBase, see docs/extending.md)")
    missing = [m for m in ("state_dict", "load_state_dict", *methods) if not callable(getattr(obj, m, None))]
    if missing:
        return (f"lacks {', '.join(missing)}: subclass astraflow.dataflow.rules.RuleBase (it has the state "
                f"methods) and define the stage's {', '.join(methods)} (docs/extending.md)")
    return None


CURATORS: Registry = Registry("prompt curator", lambda obj: not_a_rule(obj, ("accept", "observe")))
FILTERS: Registry = Registry("group filter", lambda obj: not_a_rule(obj, ("keep",)))
ORDERINGS: Registry = Registry("buffer ordering", lambda obj: not_a_rule(obj, ("order",)))


class NoParams(Strict):
    """A rule without parameters."""


class SeededParams(Strict):
    """Parameters of a randomised rule."""

    seed: int | None = None
    """Seed of the rule's random stream; None: the run seed."""


class RuleBase:
    """Construction from ``Params`` and default state handling: every public attribute is state,
    except those named like a field of ``Params`` (the configuration: a resumed run takes the
    config's values, not the saved ones)."""

    Params: ClassVar[type[BaseModel]] = NoParams
    #: what a curator's ``observe`` gets per sequence: ``"reward"``, its reward (a multi-turn
    #: episode's return, per-turn rewards and invalid-call penalties included: what the advantage
    #: is computed from), or ``"success"``, whether its episode succeeded as evaluation counts it
    #: (a multi-turn episode's ``success``; any other sequence's reward)
    observes: ClassVar[str] = "reward"

    def __init__(self, params: BaseModel, seed: int = 0):
        del params, seed  # a rule without parameters or randomness

    def state_dict(self) -> dict[str, Any]:
        params = type(self).Params.model_fields
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k not in params}
        rng = self.__dict__.get("_rng")
        if isinstance(rng, random.Random):
            version, internal, gauss = rng.getstate()
            state["rng_state"] = [version, list(internal), gauss]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        rng_state = state.pop("rng_state", None)
        for name in type(self).Params.model_fields:
            state.pop(name, None)  # saved by an earlier release: the config's value stands
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: unknown keys {sorted(unknown)}; "
                "the saved state belongs to another rule (check dataflow.* in the config)"
            )
        self.__dict__.update(state)
        if rng_state is not None:
            version, internal, gauss = rng_state
            self._rng = random.Random()
            self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))


def _rng(params: SeededParams, seed: int) -> random.Random:
    return random.Random(seed if params.seed is None else params.seed)


class Curator(Protocol):
    def accept(self, prompt_key: str, payload: dict) -> bool: ...
    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class GroupView:
    """What a group filter whose ``keep`` has a second argument named ``group`` sees of the group
    besides its rewards: the policy it is routed to, the payload's source (a mixture's), and per
    sequence, in the order of ``rewards``, how it ended (``stop``; ``length``: cut by its token
    budget, or an agentic episode truncated or ended on a cut turn; ``abort``), its tokens and
    the tokens this policy generated in it."""

    policy: str
    source: str
    finish_reasons: tuple[str, ...]
    num_tokens: tuple[int, ...]
    generated_tokens: tuple[int, ...]


class GroupFilter(Protocol):
    def keep(self, rewards: Sequence[float], group: GroupView = ...) -> tuple[bool, str | None]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def keep_group(group_filter: Any, rewards: Sequence[float], group: GroupView) -> tuple[bool, str | None]:
    """``group_filter.keep`` of a group: with its ``GroupView`` where ``keep``'s second argument
    is named ``group`` (the checked wrapper of ``rule_checks`` always takes it, and passes it on
    only so); a ``keep(rewards)``, or one whose second argument is another optional one, without."""
    own = getattr(group_filter, "__dict__", {}).get("keep")
    if own is not None or takes_group(type(group_filter).keep):
        return (own or group_filter.keep)(rewards, group)
    return group_filter.keep(rewards)


@dataclass(frozen=True)
class BufferedGroupView:
    """What an ordering sees of a buffered group."""

    ingest_seq: int
    oldest_version: int


class Ordering(Protocol):
    def order(self, groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


# -- curators ----------------------------------------------------------------------------------


@CURATORS.register("accept_all")
class AcceptAll(RuleBase):
    """Roll out every prompt."""

    def accept(self, prompt_key: str, payload: dict) -> bool:
        return True

    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None:
        return None


class FilterSolvedParams(SeededParams):
    threshold: float = Field(default=0.9, ge=0, le=1)
    """A prompt whose recent success rate is above this is skipped."""
    decay: float = Field(default=0.5, ge=0, le=1)
    """Weight of the previous rate in the moving average of the success rate."""
    explore: float = Field(default=0.1, ge=0, le=1)
    """Probability that a skipped prompt is rolled out anyway (forgetting is noticed)."""


@CURATORS.register("filter_solved")
class FilterSolved(RuleBase):
    """Skip prompts whose recent success rate (an exponential moving average with ``decay``)
    is above ``threshold``; a skipped prompt is still tried with probability ``explore`` so
    that forgetting is noticed."""

    Params = FilterSolvedParams
    observes = "success"  # a shaped return above 0 is no success

    def __init__(self, params: FilterSolvedParams, seed: int = 0):
        self.threshold, self.decay, self.explore = params.threshold, params.decay, params.explore
        self.success: dict[str, float] = {}
        self._rng = _rng(params, seed)

    def accept(self, prompt_key: str, payload: dict) -> bool:
        if self.success.get(prompt_key, 0.0) <= self.threshold:
            return True
        return self._rng.random() < self.explore

    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None:
        rate = sum(r > 0 for r in rewards) / max(len(rewards), 1)
        old = self.success.get(prompt_key)
        self.success[prompt_key] = rate if old is None else self.decay * old + (1 - self.decay) * rate


class GresoParams(SeededParams):
    floor: float = Field(default=0.1, gt=0, le=1)
    """Every prompt keeps at least this chance to be retried."""
    base: float = Field(default=0.5, ge=0, le=1)
    """Skip probability after a streak of ``k`` zero-variance groups: ``rate x (1 - base^k)``."""
    target_skip: float = Field(default=0.5, ge=0, le=1)
    """Fraction of proposals the adaptive ``rate`` aims to skip."""


@CURATORS.register("greso")
class Greso(RuleBase):
    """GRESO-style pre-rollout filtering: a prompt whose groups keep having zero reward
    variance is skipped with a probability that grows with the streak of zero-variance groups,
    bounded by ``1 - floor`` (every prompt keeps a chance ``floor`` to be retried). ``rate``
    adapts so that roughly ``target_skip`` of proposals are skipped."""

    Params = GresoParams

    def __init__(self, params: GresoParams, seed: int = 0):
        self.floor, self.base, self.target_skip = params.floor, params.base, params.target_skip
        self.streak: dict[str, int] = {}
        self.rate = 1.0
        self.proposed = 0
        self.skipped = 0
        self._rng = _rng(params, seed)

    def skip_probability(self, prompt_key: str) -> float:
        k = self.streak.get(prompt_key, 0)
        if k == 0:
            return 0.0
        return min(1.0 - self.floor, self.rate * (1.0 - self.base**k))

    def accept(self, prompt_key: str, payload: dict) -> bool:
        self.proposed += 1
        skip = self._rng.random() < self.skip_probability(prompt_key)
        self.skipped += skip
        frac = self.skipped / self.proposed
        self.rate = min(1.0, max(0.05, self.rate * (0.99 if frac > self.target_skip else 1.01)))
        return not skip

    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None:
        zero_var = len(set(rewards)) <= 1
        self.streak[prompt_key] = self.streak.get(prompt_key, 0) + 1 if zero_var else 0


class CurriculumParams(SeededParams):
    target: float = Field(default=0.5, ge=0, le=1)
    """Success rate of the prompts accepted most often."""
    width: float = Field(default=0.35, gt=0)
    """Width of the acceptance bell around ``target``."""
    floor: float = Field(default=0.1, ge=0, le=1)
    """Lowest acceptance probability of a seen prompt."""


@CURATORS.register("curriculum")
class Curriculum(RuleBase):
    """Weight prompts by difficulty estimated from outcomes: accept with probability highest
    for prompts whose success rate is near ``target`` (neither solved nor hopeless)."""

    Params = CurriculumParams
    observes = "success"

    def __init__(self, params: CurriculumParams, seed: int = 0):
        self.target, self.width, self.floor = params.target, params.width, params.floor
        self.rate: dict[str, float] = {}
        self._rng = _rng(params, seed)

    def weight(self, prompt_key: str) -> float:
        r = self.rate.get(prompt_key)
        if r is None:
            return 1.0
        return max(self.floor, math.exp(-(((r - self.target) / self.width) ** 2)))

    def accept(self, prompt_key: str, payload: dict) -> bool:
        return self._rng.random() < self.weight(prompt_key)

    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None:
        rate = sum(r > 0 for r in rewards) / max(len(rewards), 1)
        old = self.rate.get(prompt_key)
        self.rate[prompt_key] = rate if old is None else 0.5 * old + 0.5 * rate


# -- group filters -----------------------------------------------------------------------------


@FILTERS.register("keep_all")
class KeepAll(RuleBase):
    """Keep every group."""

    def keep(self, rewards: Sequence[float]) -> tuple[bool, str | None]:
        return True, None


@FILTERS.register("drop_zero_advantage")
class DropZeroAdvantage(RuleBase):
    """Dynamic sampling: a group whose rewards are all equal has zero advantage everywhere and
    teaches nothing; drop it (the data layer leases replacement tasks to keep batches full)."""

    def keep(self, rewards: Sequence[float]) -> tuple[bool, str | None]:
        if len(rewards) > 1 and max(rewards) - min(rewards) < 1e-9:
            return False, "zero_advantage"
        return True, None


# -- buffer ordering ---------------------------------------------------------------------------


@ORDERINGS.register("fifo")
class Fifo(RuleBase):
    """Consume groups in the order they became ready."""

    def order(self, groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]:
        return sorted(range(len(groups)), key=lambda i: groups[i].ingest_seq)


@ORDERINGS.register("edf")
class EarliestDeadlineFirst(RuleBase):
    """Consume the group whose staleness deadline (oldest version + max_staleness) comes
    first, so fewer groups expire in the buffer."""

    def order(self, groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]:
        return sorted(range(len(groups)), key=lambda i: (groups[i].oldest_version, groups[i].ingest_seq))


@ORDERINGS.register("freshest")
class FreshestFirst(RuleBase):
    """Consume the group generated by the newest weights first (the latest ready among
    equals); older groups wait and age out. For a policy that gets more sequences than its
    trainer consumes (the solver of ``solver_verifier``: 1-2 per episode against the
    verifier's 1), first-in-first-out trains on the oldest of its surplus, at the staleness
    bound; this trains on the freshest, and the surplus dropped is the oldest."""

    def order(self, groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]:
        return sorted(range(len(groups)), key=lambda i: (-groups[i].oldest_version, -groups[i].ingest_seq))


# -- construction ------------------------------------------------------------------------------


def rule_class(registry: Registry, name: str) -> type:
    """The rule class registered as ``name``. ``"package.module:name"`` imports the user's
    module first (which registers its rules), so a new rule needs no change here."""
    return registry.resolve(name)


def make(registry: Registry, name: str, params: BaseModel | dict[str, Any], seed: int = 0):
    """The rule ``name`` of ``registry`` built from ``params`` (a dict is validated against the
    class's ``Params``: ``ValueError`` naming the bad parameter) with the run ``seed``, its stage
    methods checked (``checked``) and its state found plain JSON right away."""
    cls = rule_class(registry, name)
    if not isinstance(params, cls.Params):
        params = cls.Params.model_validate(params)
    rule = checked(cls(params, seed), registry, name)
    plain_state(rule)  # a state that could never be saved: said now, not at the first save
    return rule
