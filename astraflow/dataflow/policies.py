"""Composable dataflow policies, registered by name and chosen in the config.

Stages (each a small protocol; the data layer calls them and nothing else knows they exist):

* ``Curator`` before rollout: ``accept(prompt_key, payload) -> bool`` and ``observe(prompt_key,
  rewards)`` after a group ends (to learn which prompts are worth rolling out).
* ``GroupFilter`` after rollout: ``keep(rewards) -> (bool, reason)`` for one (group, policy).
* ``Ordering`` of the buffer: ``pick(groups, version) -> list[index]`` in consumption order.

Every policy keeps its state in plain JSON-able attributes and implements
``state_dict()``/``load_state_dict()`` so a run can save and restore it. A new policy is a new
class with a ``@CURATORS.register(...)`` (or ``FILTERS`` / ``ORDERINGS``) decorator.

Randomised policies draw from their own ``random.Random`` (``self._rng``, seeded from the run
seed). Its state is part of ``state_dict()`` (key ``rng_state``), so a restored policy
*continues* its random stream: a run resumed from a checkpoint makes the same decisions the
uninterrupted run would have made from that point, given the same observations.
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from astraflow.registry import Registry

CURATORS: Registry = Registry("prompt curator")
FILTERS: Registry = Registry("group filter")
ORDERINGS: Registry = Registry("buffer ordering")


class _Stateful:
    """Default state handling: every public attribute is state."""

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        rng = self.__dict__.get("_rng")
        if isinstance(rng, random.Random):
            version, internal, gauss = rng.getstate()
            state["rng_state"] = [version, list(internal), gauss]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        rng_state = state.pop("rng_state", None)
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: unknown keys {sorted(unknown)}; "
                "the saved state belongs to another policy (check dataflow.* in the config)"
            )
        self.__dict__.update(state)
        if rng_state is not None:
            version, internal, gauss = rng_state
            self._rng = random.Random()
            self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))


class Curator(Protocol):
    def accept(self, prompt_key: str, payload: dict) -> bool: ...
    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class GroupFilter(Protocol):
    def keep(self, rewards: Sequence[float]) -> tuple[bool, str | None]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


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
class AcceptAll(_Stateful):
    """Roll out every prompt."""

    def accept(self, prompt_key: str, payload: dict) -> bool:
        return True

    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None:
        return None


@CURATORS.register("filter_solved")
class FilterSolved(_Stateful):
    """Skip prompts whose recent success rate (an exponential moving average with ``decay``)
    is above ``threshold``; a skipped prompt is still tried with probability ``explore`` so
    that forgetting is noticed."""

    def __init__(self, threshold: float = 0.9, decay: float = 0.5, explore: float = 0.1, seed: int = 0):
        if not 0 <= threshold <= 1:
            raise ValueError("filter_solved.threshold must be in [0, 1]")
        self.threshold, self.decay, self.explore = threshold, decay, explore
        self.success: dict[str, float] = {}
        self._rng = random.Random(seed)

    def accept(self, prompt_key: str, payload: dict) -> bool:
        if self.success.get(prompt_key, 0.0) <= self.threshold:
            return True
        return self._rng.random() < self.explore

    def observe(self, prompt_key: str, rewards: Sequence[float]) -> None:
        rate = sum(r > 0 for r in rewards) / max(len(rewards), 1)
        old = self.success.get(prompt_key)
        self.success[prompt_key] = rate if old is None else self.decay * old + (1 - self.decay) * rate


@CURATORS.register("greso")
class Greso(_Stateful):
    """GRESO-style pre-rollout filtering: a prompt whose groups keep having zero reward
    variance is skipped with a probability that grows with the streak of zero-variance groups,
    bounded by ``1 - floor`` (every prompt keeps a chance ``floor`` to be retried). ``rate``
    adapts so that roughly ``target_skip`` of proposals are skipped."""

    def __init__(self, floor: float = 0.1, base: float = 0.5, target_skip: float = 0.5, seed: int = 0):
        if not 0 < floor <= 1:
            raise ValueError("greso.floor must be in (0, 1]")
        self.floor, self.base, self.target_skip = floor, base, target_skip
        self.streak: dict[str, int] = {}
        self.rate = 1.0
        self.proposed = 0
        self.skipped = 0
        self._rng = random.Random(seed)

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


@CURATORS.register("curriculum")
class Curriculum(_Stateful):
    """Weight prompts by difficulty estimated from outcomes: accept with probability highest
    for prompts whose success rate is near ``target`` (neither solved nor hopeless)."""

    def __init__(self, target: float = 0.5, width: float = 0.35, floor: float = 0.1, seed: int = 0):
        self.target, self.width, self.floor = target, width, floor
        self.rate: dict[str, float] = {}
        self._rng = random.Random(seed)

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
class KeepAll(_Stateful):
    def keep(self, rewards: Sequence[float]) -> tuple[bool, str | None]:
        return True, None


@FILTERS.register("drop_zero_advantage")
class DropZeroAdvantage(_Stateful):
    """Dynamic sampling: a group whose rewards are all equal has zero advantage everywhere and
    teaches nothing; drop it (the data layer leases replacement tasks to keep batches full)."""

    def keep(self, rewards: Sequence[float]) -> tuple[bool, str | None]:
        if len(rewards) > 1 and max(rewards) - min(rewards) < 1e-9:
            return False, "zero_advantage"
        return True, None


# -- buffer ordering ---------------------------------------------------------------------------


@ORDERINGS.register("fifo")
class Fifo(_Stateful):
    """Consume groups in the order they became ready."""

    def order(self, groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]:
        return sorted(range(len(groups)), key=lambda i: groups[i].ingest_seq)


@ORDERINGS.register("edf")
class EarliestDeadlineFirst(_Stateful):
    """Consume the group whose staleness deadline (oldest version + max_staleness) comes
    first, so fewer groups expire in the buffer."""

    def order(self, groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]:
        return sorted(range(len(groups)), key=lambda i: (groups[i].oldest_version, groups[i].ingest_seq))


@ORDERINGS.register("freshest")
class FreshestFirst(_Stateful):
    """Consume the group generated by the newest weights first (the latest ready among
    equals); older groups wait and age out. For a policy that gets more sequences than its
    trainer consumes (the solver of ``solver_verifier``: 1-2 per episode against the
    verifier's 1), first-in-first-out trains on the oldest of its surplus, at the staleness
    bound; this trains on the freshest, and the surplus dropped is the oldest."""

    def order(self, groups: Sequence[BufferedGroupView], version: int, max_staleness: int) -> list[int]:
        return sorted(range(len(groups)), key=lambda i: (-groups[i].oldest_version, -groups[i].ingest_seq))


def make(registry: Registry, spec_type: str, params: dict, seed: int = 0):
    cls = registry.get(spec_type)
    kwargs = dict(params)
    if "seed" in inspect.signature(cls).parameters and "seed" not in kwargs:
        kwargs["seed"] = seed
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"{registry.kind} {spec_type!r}: bad parameters {params}: {err}") from None
