"""Sampling seeds that make an episode's tokens independent of what else its engine decodes.

An engine batches the requests of every episode on its node. Drawing all their random numbers
from one generator would make an episode's tokens depend on which requests shared its batches
and in what order they came, so no run could be repeated. Instead the RaaS node opens an
``episode_seeds`` scope around each episode (from the run's seed, the task and its attempt),
each request the episode makes takes the scope's next seed (``seeded``, called by the engine),
and the engine draws the k-th token of a request from ``uniforms(seed, k)``: a counter-based
stream (SplitMix64's output function) that keeps no state. The same run seed, task, attempt and
weights give the same tokens, whichever node, batch or engine process serves them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from dataclasses import replace
from typing import Any, Iterator

import numpy as np


def mix(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` (stable across processes and Python versions, unlike ``hash``)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Scope:
    """One episode's request seeds: the n-th request gets ``mix(base, n)``."""

    def __init__(self, base: int):
        self.base, self.requests = base, 0

    def next(self) -> int:
        self.requests += 1
        return mix(self.base, self.requests - 1)


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("astraflow_episode_seeds", default=None)


@contextlib.contextmanager
def episode_seeds(run_seed: int, task_id: str, attempt: int) -> Iterator[None]:
    """Requests made inside this scope (and in tasks it starts) are seeded from the run's seed,
    ``task_id`` and ``attempt``: a task leased again after a failure samples afresh."""
    token = _SCOPE.set(_Scope(mix(run_seed, task_id, attempt)))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def seeded(params: Any) -> Any:
    """``params`` (a ``SamplingParams``) with the episode's next request seed, where it has no
    seed of its own and an episode scope is open; otherwise unchanged."""
    scope = _SCOPE.get()
    if params.seed is not None or scope is None:
        return params
    return replace(params, seed=scope.next())


_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def uniforms(seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Per row, draw ``draws[i]`` of the stream seeded with ``seeds[i]``, as float64 in [0, 1)
    (53 random bits: exact in float64)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (draws.astype(np.uint64) + np.uint64(1)) * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
