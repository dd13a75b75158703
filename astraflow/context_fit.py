"""Whether a run's requests fit its models' context: a model's positions (its config.json, stretched by
rope scaling as vLLM counts them), the ``max_model_len`` each ``vllm`` engine sets, and the workload's
prompts measured against what a generation leaves of them. ``preflight`` checks a model's positions with
it before a run starts, the orchestrator a rollout partition added to a live run, and ``launch`` the
workload's prompts once the models exist; apart so that the checks of a model directory and of this
machine read without the arithmetic of positions."""

from __future__ import annotations

import json
import os

from astraflow.config import ConfigError, RunConfig
from astraflow.partition_settings import effective_rollout


#: config.json keys that give a model's positions, by family (GPT-2 and its kin say ``n_positions``)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def max_positions(config: dict) -> int | None:
    """The positions of a model from its config.json: the first of its family's keys that is
    set, in its ``text_config`` for a multimodal model; None if it names none."""
    for c in (config, config.get("text_config")):
        if isinstance(c, dict):
            for key in POSITION_KEYS:
                if isinstance(c.get(key), int) and not isinstance(c[key], bool):
                    return c[key]
    return None


def engine_limits(cfg: RunConfig) -> list[tuple[str, int]]:
    """``(field, max_model_len)`` of every rollout partition's ``vllm`` engine that sets one
    (the run's ``rollout`` section, or a partition's own over it), each field once."""
    return list(dict(x for x in (engine_limit(cfg, part) for part in cfg.partitions) if x).items())


def engine_limit(cfg: RunConfig, part) -> tuple[str, int] | None:
    """``(field, max_model_len)`` of ``part``'s ``vllm`` engine where it sets one, else None."""
    limit = _limit_of(cfg, part) if part.role == "rollout" else None
    if not limit:
        return None
    own = "max_model_len" in part.rollout.get("engine", {}).get("vllm", {})
    return f"{f'partitions[{part.name}].rollout' if own else 'rollout'}.engine.vllm.max_model_len", limit


def _tightest(cfg: RunConfig, positions: int | None) -> tuple[int | None, str | None]:
    """The fewest positions a request of the run gets, and the ``max_model_len`` field that sets
    it (None: the model's own ``positions``): a ``vllm`` engine's own limit where it sets one
    (rope scaling may raise it past the model's), the model's on every other rollout partition."""
    limits = [(limit, field) for field, limit in engine_limits(cfg)]
    unlimited = any(part.role == "rollout" and not _limit_of(cfg, part) for part in cfg.partitions)
    candidates = limits + ([(positions, None)] if unlimited or not limits else [])
    candidates = [c for c in candidates if isinstance(c[0], int)]
    return min(candidates, key=lambda c: c[0]) if candidates else (None, None)


def _limit_of(cfg: RunConfig, part) -> int | None:
    engine = effective_rollout(cfg.rollout, part).engine
    return engine.vllm.max_model_len if engine.type == "vllm" else None


def model_limits(cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """Per existing policy model (``"policy NAME (DIR)"``): the longest ``max_model_len`` vLLM takes
    for it and its positions before rope scaling; models not built yet, simulated or naming no
    positions are left out."""
    out = {}
    for pol in cfg.policies:
        config = pol.model / "config.json"
        if cfg.simulated(pol) or not config.is_file():
            continue
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            continue
        allowed, positions = vllm_positions(data), max_positions(data)
        if allowed is not None and positions is not None:
            out[f"policy {pol.name} ({pol.model})"] = (allowed, positions)
    return out


def vllm_positions(config: dict) -> int | None:
    """The longest ``max_model_len`` vLLM takes for a model's config.json: its positions, times
    its rope scaling factor where the rope type stretches them (``yarn`` from its original
    positions; ``llama3``, ``longrope`` and ``su`` count them stretched already); None if it
    names none."""
    positions = max_positions(config)
    if not isinstance(positions, int):
        return None
    for c in (config, config.get("text_config")):
        rope = c.get("rope_scaling") if isinstance(c, dict) else None
        if not isinstance(rope, dict) or not isinstance(rope.get("factor"), (int, float)) or rope["factor"] <= 1:
            continue
        kind = rope.get("rope_type", rope.get("type"))
        if kind in ("llama3", "longrope", "su"):
            return positions
        base = c.get("original_max_position_embeddings", rope.get("original_max_position_embeddings"))
        base = base if kind == "yarn" and isinstance(base, int) and not isinstance(base, bool) else positions
        return int(base * rope["factor"])
    return positions


def long_context_allowed() -> bool:
    """vLLM's own override of its ``max_model_len`` bound (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``), read
    as vLLM reads it."""
    return os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def check_engine_positions(cfg: RunConfig, allowed: int, positions: int, whose: str,
                           limits: list[tuple[str, int]] | None = None) -> None:
    """``ConfigError`` when a ``vllm`` engine's ``max_model_len`` (``limits``, default every
    rollout partition's) is past the ``allowed`` positions of the model ``whose`` describes
    (``positions`` before rope scaling): vLLM refuses it at every start."""
    if long_context_allowed():
        return
    for field, limit in engine_limits(cfg) if limits is None else limits:
        if limit > allowed:
            scaled = f" ({positions} before rope scaling)" if allowed != positions else ""
            raise ConfigError(f"{field} {limit}: the model of {whose} has {allowed} positions{scaled}, and vLLM "
                              f"refuses a longer max_model_len; lower it to {allowed} or less, or leave it unset "
                              "(the model's own)")


#: prompts measured per split and policy (a dataset's first ones): the check stays within seconds
PROMPTS_MEASURED = 20_000


class _Unrenderable(ValueError):
    """A prompt the workload and the model's tokenizer cannot turn into tokens (its cause chained)."""


def _prompt_length(tok, wl, payload, split: str) -> int:
    from astraflow.agents.chat import prompt_ids

    try:
        return len(prompt_ids(tok, wl, payload))
    except Exception as err:
        row = payload.get("row") if isinstance(payload, dict) else None
        raise _Unrenderable(f"the {split} prompt" + (f" of {row}" if row else "")) from err


def prompts_that_do_not_fit(cfg: RunConfig, wl, policies: list[str] | None = None) -> list[str]:
    """A line per policy whose model (one that exists already) has fewer positions than some
    single-turn prompts of ``wl`` need with ``workload.sampling.max_new_tokens``: their rollouts
    fail, and held-out ones are left out of the accuracy. ``ValueError`` when no train prompt
    fits. ``policies``: only these (default: all). Agentic episodes budget their context themselves
    (``max_context_tokens``)."""
    from astraflow.agents.workload import is_agentic

    if is_agentic(type(wl)):
        return []
    from astraflow.model_loading import load_tokenizer

    new, lines = cfg.workload.sampling.max_new_tokens, []
    for pol in cfg.policies:
        config = pol.model / "config.json"
        if cfg.simulated(pol) or not config.is_file() or (policies is not None and pol.name not in policies):
            continue  # a model init builds is sized to the workload's prompts
        positions, field = _tightest(cfg, max_positions(json.loads(config.read_text())))
        if not isinstance(positions, int) or positions <= new:
            continue  # no limit known; or max_new_tokens alone overflows, which preflight refuses
        tok, room = load_tokenizer(pol.model), positions - new
        over: dict[str, tuple[int, int]] = {}
        longest: tuple[int, str] = (0, "")
        try:
            for split in ("train", "eval"):
                tasks = wl.tasks(split)[:PROMPTS_MEASURED]
                lengths = [_prompt_length(tok, wl, p, split) for p in tasks]
                over[split] = (sum(n > room for n in lengths), len(tasks))
                for n, p in zip(lengths, tasks):
                    if n > longest[0]:
                        longest = (n, str(p.get("row", "")) if isinstance(p, dict) else "")
        except _Unrenderable as err:  # every rollout of such a prompt would fail on it
            raise ValueError(f"policy {pol.name}: {err} cannot be rendered with {pol.model}'s tokenizer and chat "
                             f"template ({type(err.__cause__).__name__}: {err.__cause__}); fix the template "
                             "(tokenizer_config.json's chat_template) or the messages the workload gives it") from None
        if not any(n for n, _ in over.values()):
            continue
        limit = f"{field} {positions}" if field else f"{positions} positions"
        what = (f"policy {pol.name}: {over['train'][0]} of {over['train'][1]} train and {over['eval'][0]} of "
                f"{over['eval'][1]} held-out prompts are longer than the {room} tokens left for a prompt "
                f"({limit} less workload.sampling.max_new_tokens {new}); the longest has "
                f"{longest[0]} tokens" + (f" ({longest[1]})" if longest[1] else ""))
        fix = ("remove the long prompts from the data, lower max_new_tokens, or "
               + (f"raise {field}" if field else "use a model with more positions"))
        if over["train"][0] == over["train"][1]:
            raise ValueError(f"{what}: no train prompt fits; {fix}")
        lines.append(f"{what}. Their rollouts will fail (held-out ones are left out of the accuracy): {fix}")
    return lines
