"""The records that cross a component boundary.

RaaS nodes, the data layer and trainers never import each other; everything they exchange is
one of the frozen records below (or a reference into the trajectory/weight store). Each field
says what it means, who writes it, who reads it and what ``None`` means. Constructors validate:
an inconsistent record is a bug in its writer and fails loudly where it is made, not three
components later.

Per-token arrays are numpy arrays (not lists) so that a batch of thousands of sequences costs
one pickle of a few buffers when it crosses a Dask actor call (``astraflow.transport`` owns that
wire format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np

from storage.trajectories import EntryRef, StoredSequence
from storage.weights import WeightVersion  # noqa: F401  (re-exported: the weight store owns it)

TaskKind = Literal["train", "eval"]
FinishReason = Literal["stop", "length", "abort"]
def _plain(value: Any) -> Any:
    """JSON for numpy scalars and arrays a workflow puts in ``meta``; anything else as its text."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


#: the encoder of a stored sequence's ``meta`` (``json.dumps(..., sort_keys=True)`` makes one per call)
_META_JSON = json.JSONEncoder(sort_keys=True, default=_plain)

# Throughput names. Each means one thing wherever it appears (a node's stats, the data layer's
# metrics, ``status``, the dashboard, metrics.jsonl):
#   episodes_per_s          trajectories (episodes) completed per second
#   sequences_per_s         stored sequences per second (an episode stores one per model turn)
#   generated_tokens_per_s  tokens a policy sampled (loss mask 1) per second; prompt, tool and
#                           environment tokens are not counted
# A *step* is one optimiser update of a trainer; a *version* is a published weight version.
# A trainer at step n has published version n (version 0: the initial weights).

#: value of ``Sequence.policy_ids`` / ``Sequence.versions`` on tokens no policy generated (prompt,
#: tool output, environment feedback).
NOT_GENERATED = -1


@dataclass(frozen=True)
class RolloutTask:
    """One episode to roll out. Written by the data layer, read by a RaaS node's workflow.

    A GRPO group is ``group_size`` tasks that share ``group_id`` and ``prompt``; the data layer
    releases a group to the trainers only once every member has ended.
    """

    #: unique id of this episode, stable across lease attempts (``<group_id>/<sample index>``).
    task_id: str
    #: id shared by the samples of one prompt; group statistics are computed over it.
    group_id: str
    #: names of the policies this episode's workflow drives, in the order the workflow expects
    #: them (a single-policy workflow gets one). ``Sequence.policy_ids`` index into this tuple.
    policies: tuple[str, ...]
    #: registered workflow name (``astraflow.rollout.workflows``), e.g. ``"math_single"``.
    workflow: str
    #: the workload payload, JSON-serialisable (for math: ``{"question": ..., "answer": ...}``).
    prompt: Mapping[str, Any]
    #: ``"train"`` tasks feed trainers; ``"eval"`` tasks only produce held-out metrics.
    kind: TaskKind = "train"
    #: 0 for the first lease, incremented each time an expired or failed lease is requeued.
    attempt: int = 0
    #: sampling overrides for this task (``temperature``, ``max_new_tokens``); ``None`` means the
    #: RaaS node's engine defaults.
    sampling: Mapping[str, Any] | None = None
    #: a RaaS node runs this task only once it has loaded at least this weight version of the
    #: first policy in ``policies`` (evaluation rounds pin the version they evaluate; the other
    #: policies of a multi-policy episode take part with whatever version they have, since they
    #: advance on their own and may only get there by training on rollouts this task would
    #: hold up); -1: any.
    min_version: int = -1

    def __post_init__(self) -> None:
        if not self.task_id or not self.group_id:
            raise ValueError("RolloutTask needs a non-empty task_id and group_id")
        if not self.policies:
            raise ValueError(f"RolloutTask {self.task_id}: policies must name at least one policy")
        if self.attempt < 0:
            raise ValueError(f"RolloutTask {self.task_id}: attempt must be >= 0, got {self.attempt}")


def lease_stock_name(worker: str) -> str:
    """The data layer's name for the lease stock of rollout worker ``worker``: the tasks it
    leases ahead for its nodes (``rollout.lease_ahead``) are held under this name until a node
    takes them."""
    return f"{worker}.stock"


@dataclass(frozen=True)
class Provenance:
    """Where and when a trajectory was produced. Written by the RaaS node; read by the data
    layer's metrics and by people debugging a run. ``None`` means "not known on this node"."""

    node: str
    partition: str | None = None
    region: str | None = None
    hardware: str | None = None
    #: ``time.time()`` when the episode started / ended on the node.
    started_at: float = 0.0
    finished_at: float = 0.0
    #: seconds spent inside the inference engine for this episode.
    engine_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True, eq=False)
class Sequence:
    """One token sequence of an episode (a conversation flattened into tokens).

    Written by a RaaS node's workflow, stored in the trajectory store, read by the data layer
    (routing, staleness, group statistics) and by trainers (the loss). All per-token arrays have
    the same length.
    """

    #: int32 token ids, prompt and completion together.
    tokens: np.ndarray
    #: bool, True on tokens that carry a loss (tokens a policy generated).
    loss_mask: np.ndarray
    #: float32 behaviour log-probability of each token under the weights that sampled it;
    #: 0.0 on tokens that were not generated.
    logprobs: np.ndarray
    #: int16 index into the task's ``policies`` of the policy that generated each token;
    #: ``NOT_GENERATED`` (-1) on prompt and environment tokens.
    policy_ids: np.ndarray
    #: int32 weight version that generated each token; ``NOT_GENERATED`` (-1) elsewhere. A
    #: sequence generated across a weight update carries several versions.
    versions: np.ndarray
    #: the scalar reward the trainers optimise.
    reward: float
    #: named reward components (e.g. ``{"correct": 1.0, "format": 0.0}``); empty if none.
    rewards: Mapping[str, float] = field(default_factory=dict)
    #: why generation ended: ``"stop"`` (end token), ``"length"`` (token budget), ``"abort"``.
    finish_reason: FinishReason = "stop"

    def __post_init__(self) -> None:
        for name in ("tokens", "loss_mask", "logprobs", "policy_ids", "versions"):
            if not isinstance(getattr(self, name), np.ndarray):  # a list fails below with an operator's TypeError
                raise ValueError(f"Sequence.{name} is a {type(getattr(self, name)).__name__}, not a NumPy array: "
                                 "make the sequence with Sequence.build(...), which takes lists")
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "policy_ids", "versions"):
            arr = getattr(self, name)
            if len(arr) != n:
                raise ValueError(
                    f"Sequence.{name} has {len(arr)} entries but tokens has {n}: every per-token "
                    "array must have one entry per token"
                )
        if n == 0:
            raise ValueError("Sequence has no tokens")
        if self.finish_reason not in ("stop", "length", "abort"):
            raise ValueError(f"finish_reason must be stop/length/abort, got {self.finish_reason!r}")
        gen = self.policy_ids >= 0
        if np.any(self.loss_mask & ~gen):
            raise ValueError("Sequence.loss_mask marks a token that no policy generated")
        if np.any(gen != (self.versions >= 0)):
            raise ValueError("Sequence: generated tokens need a version >= 0, other tokens -1")
        if not np.isfinite(self.reward):
            raise ValueError(f"Sequence.reward must be finite, got {self.reward}")

    @classmethod
    def build(
        cls,
        tokens,
        loss_mask,
        logprobs,
        policy_ids,
        versions,
        reward: float,
        rewards: Mapping[str, float] | None = None,
        finish_reason: FinishReason = "stop",
    ) -> "Sequence":
        """Make a sequence from array-likes, casting to the documented dtypes."""
        return cls(
            tokens=np.asarray(tokens, dtype=np.int32),
            loss_mask=np.asarray(loss_mask, dtype=bool),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            policy_ids=np.asarray(policy_ids, dtype=np.int16),
            versions=np.asarray(versions, dtype=np.int32),
            reward=float(reward),
            rewards=dict(rewards or {}),
            finish_reason=finish_reason,
        )

    @classmethod
    def checked_already(cls, tokens: np.ndarray, loss_mask: np.ndarray, logprobs: np.ndarray,
                        policy_ids: np.ndarray, versions: np.ndarray, reward: float,
                        rewards: Mapping[str, float], finish_reason: FinishReason) -> "Sequence":
        """A sequence whose fields the caller has checked as ``__post_init__`` does, for many
        sequences at once (a batch read column-wise): made without checking each again."""
        seq = object.__new__(cls)
        seq.__dict__.update(tokens=tokens, loss_mask=loss_mask, logprobs=logprobs, policy_ids=policy_ids,
                            versions=versions, reward=reward, rewards=rewards, finish_reason=finish_reason)
        return seq

    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return (
            all(
                np.array_equal(getattr(self, k), getattr(other, k))
                for k in ("tokens", "loss_mask", "logprobs", "policy_ids", "versions")
            )
            and self.reward == other.reward
            and dict(self.rewards) == dict(other.rewards)
            and self.finish_reason == other.finish_reason
        )


@dataclass(frozen=True, eq=False)
class Trajectory:
    """Everything one episode produced. Written by a RaaS node (into its own segment of the
    trajectory store); read by the data layer, which indexes it, and by trainers through batches.
    """

    task_id: str
    group_id: str
    #: the task's ``policies``; ``Sequence.policy_ids`` index into it.
    policies: tuple[str, ...]
    workflow: str
    kind: TaskKind
    #: the lease attempt that produced it (``RolloutTask.attempt``).
    attempt: int
    sequences: tuple[Sequence, ...]
    provenance: Provenance
    #: the episode's outcome for evaluation (e.g. correctness of the final answer), set by the
    #: workflow; ``None`` means the reward of the last sequence of the first policy.
    score: float | None = None
    #: episode statistics of a multi-turn episode (``turns``, ``tool_calls``, ``invalid_calls``,
    #: ``truncated``, ``success``, seconds in the engine / tools / environment) or a workload's
    #: own (``reward_and_stats``: how a program ended, say); empty if none.
    stats: Mapping[str, float] = field(default_factory=dict)
    #: the episode's turns as the episode viewer shows them (JSON-serialisable: the task, each
    #: turn's token span, text, tool calls and rewards); ``None`` for single-turn workflows.
    episode: Mapping[str, Any] | None = None
    #: the mixture source its task's payload names (``workload.name: mix``), stamped by the RaaS
    #: node and stored; the episode viewer shows and filters by it. ``None``: no source.
    source: str | None = None

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError(f"Trajectory {self.task_id} has no sequences")
        for i, seq in enumerate(self.sequences):
            hi = int(seq.policy_ids.max())
            if hi >= len(self.policies):
                raise ValueError(
                    f"Trajectory {self.task_id}: sequence {i} has policy id {hi} but the task "
                    f"names only {len(self.policies)} policies {self.policies}"
                )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return self.__dict__ == other.__dict__

    # -- storage mapping: one stored entry per sequence --------------------------------------
    def to_stored(self) -> list[StoredSequence]:
        """One stored row per sequence. A ``ValueError`` names what a workflow gave that cannot be
        stored as JSON (keys of mixed types, a value that holds itself)."""
        meta = {
            "policies": list(self.policies),
            "workflow": self.workflow,
            "kind": self.kind,
            "attempt": self.attempt,
            "provenance": self.provenance.to_dict(),
            "score": self.score,
            "stats": dict(self.stats),
            **({"source": self.source} if self.source is not None else {}),
        }
        return [
            StoredSequence(
                task_id=self.task_id,
                group_id=self.group_id,
                seq_index=i,
                num_sequences=len(self.sequences),
                tokens=s.tokens,
                loss_mask=s.loss_mask,
                logprobs=s.logprobs,
                policy_ids=s.policy_ids,
                versions=s.versions,
                reward=s.reward,
                finish_reason=s.finish_reason,
                meta=self._meta_json({**meta, "rewards": dict(s.rewards),
                                      **({"episode": self.episode} if i == 0 and self.episode else {})}),
            )
            for i, s in enumerate(self.sequences)
        ]

    def _meta_json(self, meta: dict[str, Any]) -> str:
        try:
            return _META_JSON.encode(meta)
        except (TypeError, ValueError, RecursionError) as err:
            raise ValueError(f"Trajectory {self.task_id}: its stats, score, rewards or episode cannot be stored as "
                             f"JSON ({type(err).__name__}: {err}); give every key as a str and every value as "
                             "JSON (numbers, strings, lists, dicts)") from None

    def episode_score(self) -> float:
        """``score``, or the reward of the first policy's last sequence."""
        if self.score is not None:
            return float(self.score)
        own = [s for s in self.sequences if (s.policy_ids == 0).any()]
        return float((own or list(self.sequences))[-1].reward)


def sequence_from_stored(row: StoredSequence, meta: Mapping[str, Any] | None = None) -> Sequence:
    """The ``Sequence`` of a stored row; ``meta``: its ``meta`` already parsed."""
    return Sequence(
        tokens=row.tokens,
        loss_mask=row.loss_mask.astype(bool),
        logprobs=row.logprobs,
        policy_ids=row.policy_ids,
        versions=row.versions,
        reward=float(row.reward),
        rewards=(json.loads(row.meta) if meta is None else meta).get("rewards", {}),
        finish_reason=row.finish_reason,
    )


@dataclass(frozen=True)
class SequenceSummary:
    """What the data layer needs to know of one stored sequence without reading its tokens.
    Written by the RaaS node from the trajectory it just stored."""

    ref: EntryRef
    reward: float
    #: per policy name that generated tokens in the sequence: (generated tokens, oldest version).
    policy_tokens: Mapping[str, tuple[int, int]]
    num_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class TrajectoryRef:
    """``complete()`` payload: a trajectory that is committed in the trajectory store.
    Written by a RaaS node after the segment write returned; read by the data layer."""

    task_id: str
    group_id: str
    kind: TaskKind
    attempt: int
    node: str
    sequences: tuple[SequenceSummary, ...]
    #: ``Trajectory.episode_score()``: what an evaluation counts.
    score: float = 0.0
    #: ``Trajectory.stats`` (multi-turn episodes), for metrics and evaluation.
    stats: Mapping[str, float] = field(default_factory=dict)
    #: per policy, the newest weight version that generated a token of the trajectory: set for
    #: evaluation trajectories (their records say which weights answered), None for training ones.
    newest: Mapping[str, int] | None = None

    @classmethod
    def of(cls, traj: "Trajectory", refs: list[EntryRef]) -> "TrajectoryRef":
        assert len(refs) == len(traj.sequences), "one entry per stored sequence"
        summaries = []
        newest: dict[str, int] | None = {} if traj.kind == "eval" else None
        for ref, seq in zip(refs, traj.sequences):
            per_policy = {}
            for idx, name in enumerate(traj.policies):
                sel = seq.policy_ids == idx
                if sel.any():
                    per_policy[name] = (int((seq.loss_mask & sel).sum()), int(seq.versions[sel].min()))
                    if newest is not None:
                        newest[name] = max(newest.get(name, 0), int(seq.versions[sel].max()))
            summaries.append(
                SequenceSummary(
                    ref=ref,
                    reward=seq.reward,
                    policy_tokens=per_policy,
                    num_tokens=len(seq.tokens),
                    finish_reason=seq.finish_reason,
                )
            )
        return cls(
            task_id=traj.task_id,
            group_id=traj.group_id,
            kind=traj.kind,
            attempt=traj.attempt,
            node=traj.provenance.node,
            sequences=tuple(summaries),
            score=traj.episode_score(),
            stats=dict(traj.stats),
            newest=newest,
        )
