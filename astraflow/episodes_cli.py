"""``astraflow episodes RUN_DIR``: read what a run's policies did, in a terminal, during the run
or after it: the newest stored episodes (and a sample of older ones), turn by turn.

It reads what the dashboard's episode viewer reads (``runtime.monitoring.episodes``); episodes
of a workflow without an episode log (single-turn) are shown as their prompt and completion,
decoded from the stored tokens with the policy model's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import yaml

from astraflow.clibase import UserError, UserPath, printable
from storage.paths import RunPaths

#: batches the command may read (the dashboard reads fewer per request, to stay cheap while training)
READ_BUDGET = 256


@click.command("episodes")
@click.argument("run_dir", type=UserPath(file_okay=False, exists=True))
@click.option("-n", "--limit", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Newest matching episodes shown.")
@click.option("--sample", type=click.IntRange(0, 100), default=0, show_default=True,
              help="Older matching episodes shown as well, sampled evenly over the run.")
@click.option("--policy", help="Only episodes this policy acted in.")
@click.option("--kind", type=click.Choice(["train", "eval"]), help="Only training rollouts or held-out evaluations.")
@click.option("--workload", help="Only episodes of this workload (a source of a mixed workload).")
@click.option("--min-reward", type=float, help="Only episodes with at least this reward.")
@click.option("--max-reward", type=float, help="Only episodes with at most this reward.")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output: the dashboard's /astraflow/api/episodes.json view, each episode "
                   "with `prompt` and `completion` decoded where it has no turns (`parts`: the completion's runs of "
                   "trained and untrained tokens; `policy`: the one that wrote it).")
def episodes(run_dir: str, limit: int, sample: int, policy: str | None, kind: str | None, workload: str | None,
             min_reward: float | None, max_reward: float | None, as_json: bool) -> None:
    """Show the episodes stored by the run in RUN_DIR, newest first: task, reward, how each ended
    and what the policy wrote, turn by turn (tool calls and results, observations). Works while
    the run trains and after it (with storage.keep_trajectories: false only the episodes not yet
    trained on are left)."""
    from pydantic import ValidationError

    from astraflow.configerrors import option_errors
    from astraflow.runtime.monitoring.episodes import EpisodeQuery, EpisodeReader

    paths = RunPaths(run_dir)
    if not paths.config.exists():
        raise UserError(f"{run_dir} is not a run directory (no {paths.config.name}): pass the --run-dir of a run "
                        "that started")
    try:
        query = EpisodeQuery(limit=limit, sample=sample, policy=policy, kind=kind, workload=workload,
                             min_reward=min_reward, max_reward=max_reward)
    except ValidationError as err:
        raise UserError(option_errors(err).replace("\n", "; ")) from None
    try:
        view = EpisodeReader(run_dir, read_budget=READ_BUDGET).view(query)
    except ValueError as err:  # a damaged file of the run (named, with the fix)
        raise UserError(str(err)) from None
    shown = view.recent + view.sampled
    if view.note and not as_json:
        raise UserError(f"no episodes to show: {view.note}")
    texts = _single_turn_texts(paths, view.store, [e for e in shown if not e.turns])
    if as_json:
        out = view.model_dump(mode="json")
        for e in out["recent"] + out["sampled"]:
            e.update(texts.get(e["id"], {}))
        click.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    if not shown:
        why = "none matches the filters" if view.batches else "none is stored"
        for flag, what, name, known in (("--policy", "policies", policy, view.policies),
                                        ("--workload", "workloads", workload, view.workloads)):
            if name is not None and name not in known:  # a misspelt name, not a filter that happened to match nothing
                why = f"{flag} {name!r} is not one of this run's {what} ({', '.join(known) or 'none'})"
        raise UserError(f"no episodes to show in {run_dir}: {why} ({view.batches} batches in {view.store})")
    for e in shown:
        _show(console, e, texts.get(e.id), sampled=e in view.sampled)
    more = " (the read stopped early: older ones exist)" if view.partial else ""
    console.print(f"[dim]{len(view.recent)} newest and {len(view.sampled)} sampled of {view.batches} batches "
                  f"in {view.store}{more}[/dim]")


def _show(console, e, text: dict[str, str] | None, sampled: bool) -> None:
    """One episode: a header line, then its turns (or its prompt and completion)."""
    from rich.markup import escape
    from rich.text import Text

    # the sequence of one policy (its reward) among an episode's: which one wrote it
    writer = f"  written by {text['policy']}" if text and len(e.policies) > 1 else ""
    head = (f"{e.id}  {e.kind} {e.workload}/{e.workflow}  policies {', '.join(e.policies)}{writer}  "
            f"reward {e.reward:.3g}  {e.num_tokens} tokens, finished by {e.finish_reason}"
            + (f", truncated at {e.truncated}" if e.truncated else "") + ("  (sampled)" if sampled else ""))
    console.print()
    console.print(Text(printable(head), style="bold"))
    if e.stats:  # how the episode ended, as its workload says (a program's tests: passed, wrong, timeout)
        console.print(Text(printable("  ".join(f"{k} {v:.3g}" for k, v in sorted(e.stats.items()))), style="dim"))
    if e.task:
        task = json.dumps(e.task, ensure_ascii=False, default=str)[:400]
        console.print(Text(printable(f"task: {task}"), style="dim"))
    if text:
        console.print(Text(printable(text["prompt"]), style="dim"), end="")
        # the trained runs as the model's text, what a workflow put between them (a critique) dim
        for part in text["parts"]:
            console.print(Text(printable(part["text"]), style="bold green" if part["trained"] else "dim"), end="")
        console.print()
    elif not e.turns:
        console.print("[dim](its tokens could not be decoded: the policy's model directory is not here)[/dim]")
    for t in e.turns:
        if t.kind == "model":
            versions = "-".join(str(v) for v in sorted(set(t.versions)))
            console.print(f"[cyan]model[/cyan] [dim](v{versions}, {escape(printable(t.finish or '?'))})[/dim]")
            console.print(Text(printable(t.text or ""), style="green"))
        for c in t.calls:
            if c.error:  # a call that could not be read: no name or arguments to show
                console.print(Text(printable(f"  invalid tool call: {c.error}"), style="red"))
                continue
            call = f"  {c.name}({json.dumps(c.arguments, ensure_ascii=False)}) -> {c.result}"
            # one the tool refused (unknown tool, wrong arguments): its answer says why
            console.print(Text(printable(("  invalid tool call: " + call.lstrip()) if c.valid is False else call),
                               style="red" if c.valid is False else "yellow"))
        for m in t.messages:
            console.print(f"[magenta]{escape(printable(m.role))}[/magenta]")
            console.print(Text(printable(m.content)))
        if t.reward:
            console.print(f"[dim]reward {t.reward:.3g}{' (done)' if t.done else ''}[/dim]")
    if e.turns and e.final_reward is not None:
        console.print(f"[dim]final reward {e.final_reward:.3g}[/dim]")


def _single_turn_texts(paths: RunPaths, store_url: str | None, shown: list) -> dict[str, dict[str, Any]]:
    """``{id: {"prompt", "completion", "parts", "policy"}}`` of ``shown`` (episodes without turns),
    decoded from the stored tokens with the tokenizer of ``policy``, the one that wrote each: the completion from
    the first trained token on, and ``parts`` its runs of trained and untrained tokens (a workflow
    of its own may put untrained text, a critique, between two answers). An episode whose
    policy's model directory is missing or unreadable (a sim run) is left out."""
    if not shown or store_url is None:
        return {}
    from storage.trajectories import EntryRef, open_trajectory_store

    cfg = yaml.safe_load(paths.config.read_text()) or {}
    models = {str(p.get("name")): p.get("model") for p in cfg.get("policies") or [] if isinstance(p, dict)}
    tokenizers: dict[str, Any] = {}
    refs = [EntryRef(seg, int(index)) for seg, index in (e.id.rsplit("/", 1) for e in shown)]
    cols = open_trajectory_store(store_url, mode="r").read_columns(refs)
    out = {}
    for i, e in enumerate(shown):
        a, b = int(cols.offsets[i]), int(cols.offsets[i + 1])
        ids, mask = cols.tokens[a:b].tolist(), cols.loss_mask[a:b]
        first = next((j for j, m in enumerate(mask) if m), len(ids))  # the completion: the trained tokens
        # the policy that wrote it (a verifier's sequence is the verifier's tokens, prompt included)
        pid = int(cols.policy_ids[a + first]) if first < len(ids) else 0
        policy = e.policies[pid] if 0 <= pid < len(e.policies) else None
        tok = _tokenizer(tokenizers, models.get(policy) if policy is not None else None)
        if tok is None:
            continue
        cuts = [first] + [j for j in range(first + 1, len(ids)) if mask[j] != mask[j - 1]] + [len(ids)]
        parts = [{"text": tok.decode(ids[i:j]), "trained": bool(mask[i])} for i, j in zip(cuts, cuts[1:]) if i < j]
        out[e.id] = {"prompt": tok.decode(ids[:first]), "completion": tok.decode(ids[first:]), "parts": parts,
                     "policy": policy}
    return out


def _tokenizer(cache: dict[str, Any], model: str | None):
    """The tokenizer of model directory ``model`` (cached), ``None`` where it cannot be loaded."""
    if model is None:
        return None
    if model not in cache:
        from astraflow.model_loading import load_tokenizer

        try:
            cache[model] = load_tokenizer(Path(model))
        except (OSError, ValueError):
            cache[model] = None
    return cache[model]
