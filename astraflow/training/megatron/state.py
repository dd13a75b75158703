"""What a resume needs from the Megatron ranks: their weights and their AdamW state, in and out.

The weights cross the control channel as full tensors (the backend cuts and reassembles the
tensor-parallel shards with ``convert``), so any parallel layout can load any version. The
optimiser state does not: each rank's moments belong to the shards it holds. It is saved as

    {"backend": "megatron", "layout": {"tensor_parallel": T, "data_parallel": D, "pipeline_parallel": 1},
     "ranks": [one record per tensor-parallel rank, in rank order]}

where a rank's record is its ``torch.optim.AdamW.state_dict()`` keyed by parameter *name*
instead of position (``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups":
[{hyperparameters..., "params": [names]}]}``): plain dicts of tensors and numbers, so
``torch.save`` / ``torch.load(weights_only=True)`` round-trip it.

Data parallelism replicates the moments: every replica applies the same reduced gradient to
the same weights, so the records of data-parallel rank 0 are the whole state and a state
loads under any ``data_parallel`` (each replica gets its tensor-parallel rank's record;
``data_parallel`` is recorded for the reader). A rank's moments are cut from the full tensors
exactly as its parameters are, so a state saved under another tensor-parallel size is put back
together and cut again for this one (``for_tensor_parallel``, with ``convert``'s cuts); the
pipeline-parallel size must match (``ValueError`` naming both layouts otherwise). Names and
shapes are checked against each rank's parameters in the backend, before anything is sent, so a
refused state leaves the ranks running.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

import torch

BACKEND = "megatron"

#: the layout sizes a saved optimiser state must match to load (``tensor_parallel`` is cut
#: again, ``data_parallel`` need not)
SHARDED_BY = ("pipeline_parallel",)
#: the per-parameter moments, cut over the tensor-parallel ranks as the parameter is
MOMENTS = ("exp_avg", "exp_avg_sq")


def pack(obj: Any) -> bytes:
    """``obj`` (dicts of tensors and numbers) as bytes for the control channel. A tensor that is
    a view of a larger storage (a shard cut from a full tensor, a version read from one file
    buffer) is copied first: ``torch.save`` writes a tensor's whole storage."""
    def compact(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.clone() if x.untyped_storage().nbytes() != x.nbytes else x
        if isinstance(x, dict):
            return {k: compact(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(compact(v) for v in x)
        return x

    buf = io.BytesIO()
    torch.save(compact(obj), buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    """The inverse of ``pack`` (tensors and plain containers only: ``weights_only``)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def layout(tp_size: int, dp_size: int = 1) -> dict[str, int]:
    """The parallel layout an optimiser state was written under. The moments are sharded by
    the tensor- and pipeline-parallel sizes and replicated over the data-parallel one."""
    return {"tensor_parallel": tp_size, "data_parallel": dp_size, "pipeline_parallel": 1}


def _fmt(lay: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in lay.items())


def check_optimizer_state(state: Any, params: Sequence[Mapping[str, Sequence[int]]], dp_size: int = 1) -> None:
    """``ValueError`` unless ``state`` is a Megatron optimiser state for this backend's layout
    (cut for its tensor-parallel size by ``for_tensor_parallel``; ``params``: per
    tensor-parallel rank, parameter name -> shape; ``dp_size``: its data-parallel size, which
    may differ from the saved one) whose names and moment shapes fit."""
    current = layout(len(params), dp_size)
    _check_record(state, current)
    if len(state["ranks"]) != len(params):
        raise ValueError(f"the optimiser state holds {len(state['ranks'])} rank(s) for {_fmt(current)}: it is damaged")
    for r, (rec, own) in enumerate(zip(state["ranks"], params)):
        unknown = sorted(set(rec["state"]) - set(own))
        if unknown:
            raise ValueError(f"optimiser state of rank {r} names parameters this model does not have: {unknown[:5]}")
        for name, moments in rec["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(moments[key].shape) != tuple(own[name]):
                    raise ValueError(f"optimiser state of rank {r}: {name} {key} has shape "
                                     f"{tuple(moments[key].shape)}, the parameter {tuple(own[name])}")
        groups = [g["params"] for g in rec["param_groups"]]
        if groups != [list(own)]:
            raise ValueError(f"optimiser state of rank {r} has other parameter groups than this model's one "
                             "group of every parameter")


def _check_record(state: Any, current: Mapping[str, int]) -> None:
    """``ValueError`` unless ``state`` is a Megatron optimiser state whose layout may load
    under ``current`` (``SHARDED_BY`` equal)."""
    if not isinstance(state, dict) or state.get("backend") != BACKEND or "ranks" not in state:
        raise ValueError("not an optimiser state of the Megatron backend (a run trained with another "
                         "trainer.backend?): it needs the keys 'backend', 'layout' and 'ranks'")
    saved = state.get("layout") or {}
    if any(saved.get(k) != current[k] for k in SHARDED_BY):
        raise ValueError(
            f"the optimiser state was saved with the parallel layout {_fmt(saved)} and "
            f"this trainer runs {_fmt(current)}: its moments are sharded for the saved layout"
        )


def for_tensor_parallel(state: Any, tp_size: int) -> dict[str, Any]:
    """``state`` with one record per tensor-parallel rank of ``tp_size``: as it is when saved
    under that size, else every moment put back together from the saved ranks' cuts and cut
    again (``convert``), the step counts and parameter groups taken from saved rank 0 (every
    rank steps alike). ``ValueError`` for a record that is not a Megatron state or is damaged."""
    from astraflow.training.megatron.convert import gather_shards, shard_for_rank

    _check_record(state, layout(tp_size))
    ranks = state["ranks"]
    saved_tp = (state.get("layout") or {}).get("tensor_parallel")
    if len(ranks) == tp_size or saved_tp != len(ranks) or not ranks:
        return state  # the same size, or a damaged record that ``check_optimizer_state`` names
    names = list(ranks[0]["state"])
    if any(list(rec["state"]) != names for rec in ranks):
        raise ValueError(f"the optimiser state's {len(ranks)} ranks hold moments of different parameters: "
                         "it is damaged")
    full = {key: gather_shards([{n: rec["state"][n][key] for n in names} for rec in ranks]) for key in MOMENTS}
    records = []
    for t in range(tp_size):
        cut = {key: shard_for_rank(full[key], t, tp_size) for key in MOMENTS}
        records.append({"state": {n: {**ranks[0]["state"][n], **{key: cut[key][n] for key in MOMENTS}} for n in names},
                        "param_groups": ranks[0]["param_groups"]})
    return {**state, "layout": layout(tp_size, (state.get("layout") or {}).get("data_parallel", 1)),
            "ranks": records}


def named_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimiser state keyed by parameter name (the module docstring's record).
    The optimiser was built on ``model.parameters()``, so position i is the i-th named parameter."""
    names = [n for n, _ in model.named_parameters()]
    sd = opt.state_dict()
    return {
        "state": {names[i]: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in sd["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
                         for g in sd["param_groups"]],
    }


def load_named_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, record: dict[str, Any]) -> None:
    """Continue with a rank's saved moments (checked by ``check_optimizer_state``); the
    hyperparameters stay this optimiser's (a resumed run may change ``lr``)."""
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    own = opt.state_dict()["param_groups"]
    assert [g["params"] for g in record["param_groups"]] == [[n for n in index]], "check_optimizer_state first"
    opt.load_state_dict({"state": {index[n]: s for n, s in record["state"].items()}, "param_groups": own})
