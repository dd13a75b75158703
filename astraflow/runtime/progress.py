"""Runtime room: terminal progress of a run. What is being waited for (and for how long), and
one status line per interval while it trains (step, reward, held-out accuracy, throughput,
staleness, weight version per RaaS node), from the same per-tick `Tick` the status file is
written from. Plain lines when the output is not a terminal (logs, CI)."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from rich.console import Console
from rich.markup import escape

from astraflow.runtime.monitoring.text import batch_wait

if TYPE_CHECKING:
    from astraflow.runtime.monitoring import Tick


#: nodes named on a progress line; more are counted
MAX_NODES_SHOWN = 8
#: characters of a failure reason shown on a progress line
REASON_SHOWN = 80


def top_failure(ledger: dict) -> tuple[int, str]:
    """How many rollout tasks failed (``Ledger.summary``) and the commonest reason ("" when none)."""
    failed = int((ledger.get("events") or {}).get("failed", 0))
    by_reason = ledger.get("failed_by_reason") or {}
    return failed, max(by_reason, key=by_reason.get) if by_reason else ""


def failures_outnumber_consumed(ledger: dict, jobs_dir: object) -> str | None:
    """The end-of-run warning when more rollout tasks failed than were trained on (a run can end
    ``completed`` on the few episodes that did not fail), or None."""
    failed, reason = top_failure(ledger)
    consumed = int((ledger.get("events") or {}).get("consumed", 0))
    if failed <= consumed:
        return None
    return (f"more rollout tasks failed ({failed}) than were trained on ({consumed}); the commonest reason: "
            f"{reason or 'none recorded'} (the tracebacks are in the RaaS nodes' logs under {jobs_dir})")


def accuracy_changes(evals: list[dict]) -> list[str]:
    """The end-of-run line of each policy: its first and last held-out accuracy and the run time
    between them (the records' ``time``, which a resumed run continues; a policy named where
    there are several). Evaluations with no accuracy (no episode of the round completed) are left out."""
    scored: dict[str, list[dict]] = {}
    for e in evals:
        if "eval_accuracy" in e:
            scored.setdefault(str(e.get("policy", "")), []).append(e)
    lines = []
    for policy, mine in scored.items():
        first, last = mine[0], mine[-1]
        name = f" ({policy})" if len(scored) > 1 else ""
        lines.append(f"held-out accuracy{name} {first['eval_accuracy']:.3f} (v{first['step']}) -> "
                     f"{last['eval_accuracy']:.3f} (v{last['step']}) in "
                     f"{float(last.get('time', 0.0)) - float(first.get('time', 0.0)):.0f}s")
        # a second evaluation set (``eval_sets``, HumanEval beside the code workload's split) runs at the
        # first and the last evaluation only: its own first and last
        sets: dict[str, list[tuple[int, dict]]] = {}
        for e in mine:
            for set_name, res in (e.get("eval_sets") or {}).items():
                if "accuracy" in res:
                    sets.setdefault(set_name, []).append((e["step"], res))
        for set_name, seen in sets.items():
            (v0, a), (v1, b) = seen[0], seen[-1]
            lines.append(f"{set_name}{name} {a['accuracy']:.3f} (v{v0}) -> {b['accuracy']:.3f} (v{v1}), "
                         f"{b.get('prompts', 0)} prompts")
    return lines


def second_sets(ev: dict) -> str:
    """An evaluation line's tail for its second evaluation sets (``eval_sets``): ``""`` when none ran."""
    return "".join(f"; {n} {r['accuracy']:.3f} ({r.get('prompts', 0)} prompts)"
                   for n, r in (ev.get("eval_sets") or {}).items() if "accuracy" in r)


class _Console(Console):
    """A console whose reader went away (``astraflow run ... | head``, a ``tee`` killed) goes
    quiet: the run goes on (rich's own console would exit the process, skipping the summary)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # later writes of the process go nowhere, without an error
        os.close(devnull)


class Progress:
    def __init__(self, enabled: bool = True, console: Console | None = None, interval_s: float = 5.0,
                 heartbeat_s: float = 15.0):
        self.enabled = enabled
        self.heartbeat_s = heartbeat_s
        self._waits: list[list[str]] = []  # [what, detail] of the open waiting() blocks, innermost last
        self.console = console or _Console(stderr=False, highlight=False, soft_wrap=True)
        self.interval_s = interval_s
        self._last = 0.0
        self._eval_shown: dict[str, int] = {}  # per policy, the last evaluated version shown
        #: (read at, episodes, tokens) the data layer had generated at the last status line
        self._counted: tuple[float, int, int] | None = None

    def note(self, msg: str, markup: bool = False) -> None:
        """One timestamped line. ``msg`` is shown as written (an error's ``[/INST]`` or an
        install hint's ``.[vllm]`` is text, not a style) unless ``markup`` says it is rich markup."""
        if not self.enabled:
            return
        try:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg if markup else escape(msg)}")
        except OSError:  # its terminal is gone (a hang-up): the run's files say the rest
            self.enabled = False

    @contextmanager
    def waiting(self, what: str, live: bool = True) -> Iterator[None]:
        """Show what is being waited for, and for how long, while the block runs; report how
        long it took. On a terminal a spinner line counts the seconds; in a log a line says
        what started and, every ``heartbeat_s``, that it is still waiting. :meth:`detail` adds
        what the innermost wait is blocked on (e.g. the workers that have not joined).
        ``live=False`` for a block that draws its own progress bar (one live display at a time)."""
        if not self.enabled:
            yield
            return
        t0 = time.time()
        self._waits.append([what, ""])
        stop = threading.Event()
        on_terminal = self.console.is_terminal and live
        if not self.console.is_terminal:
            self.note(f"{what} ...")

        def text() -> str:
            detail = self._waits[-1][1] if self._waits and self._waits[-1][0] == what else ""
            return (f"{escape(what)} ... {time.time() - t0:.0f}s"
                    + (f" [dim]({escape(detail)})[/dim]" if detail else ""))

        def tick(status) -> None:  # the spinner's seconds, or a heartbeat line in logs
            last_note = t0
            while not stop.wait(1.0):
                if status is not None:
                    self._drawn(status.update, text())
                elif time.time() - last_note >= self.heartbeat_s:
                    last_note = time.time()
                    self.note("still " + text()[0].lower() + text()[1:], markup=True)

        status = self.console.status(text()) if on_terminal else None
        if status is not None:
            self._drawn(status.start)
        ticker = threading.Thread(target=tick, args=(status,), daemon=True, name="astraflow-progress")
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join(timeout=5)
            if status is not None:  # its terminal may be gone (a hang-up): that must not replace the stop
                self._drawn(status.stop)
            self._waits.pop()
        self.note(f"{what}: done in {time.time() - t0:.1f}s")

    def _drawn(self, draw, *args) -> None:
        """``draw(*args)`` on the terminal; a terminal that is gone ends the progress output."""
        try:
            draw(*args)
        except OSError:
            self.enabled = False

    def detail(self, msg: str) -> None:
        """What the innermost :meth:`waiting` block is blocked on right now (shown with it)."""
        if self._waits:
            self._waits[-1][1] = msg

    def evals_shown(self, evals: list[dict]) -> None:
        """Count ``evals`` as shown (a resumed run's earlier evaluations: not printed again)."""
        for ev in evals:
            self._eval_shown[ev["policy"]] = max(self._eval_shown.get(ev["policy"], -1), ev["step"])

    def update(self, tick: Tick) -> None:
        """Report new evaluations at once, and one status line every ``interval_s``."""
        if not self.enabled:
            return
        state, trainers = tick.data_layer, tick.trainers
        for ev in state.get("eval", []):
            if ev["step"] > self._eval_shown.get(ev["policy"], -1):
                self._eval_shown[ev["policy"]] = ev["step"]
                agentic = (f", {ev['eval_turns']:.1f} turns and {ev['eval_tool_calls']:.1f} tool calls per episode, "
                           f"{ev['eval_invalid_call_rate']:.0%} of the calls invalid" if "eval_turns" in ev else "")
                acc = (f"[bold]{ev['eval_accuracy']:.3f}[/bold]" if ev.get("eval_prompts")
                       else "n/a (no episode of the round completed)")
                failed = ev.get("eval_failed_tasks", 0)
                left_out = f", {failed} failed task{'s' if failed != 1 else ''} left out" if failed else ""
                # a round asked for at v runs on v or newer weights (nodes never go back): which, when newer
                lo, hi = ev.get("eval_version_min"), ev.get("eval_version_max")
                ran_on = (f" (on v{lo} weights)" if lo == hi else f" (on v{lo}-v{hi} weights)") \
                    if lo is not None and hi is not None and (lo, hi) != (ev["step"], ev["step"]) else ""
                self.note(
                    f"[bold]eval[/bold] {ev['policy']} v{ev['step']}{ran_on}: held-out accuracy "
                    f"{acc} ({ev.get('eval_prompts', 0)} prompts{left_out}, {ev['eval_seconds']:.1f}s{agentic})"
                    f"{escape(second_sets(ev))}",
                    markup=True)
        now = time.time()
        if now - self._last < self.interval_s:
            return
        self._last = now
        parts = []
        for p, t in trainers.items():
            m = t.get("last_metrics", {})
            # a trainer that has taken no step yet (since a resume too) has no reward or loss to show
            trained = (f" reward {m['reward_mean']:.3f} loss {m['loss']:.4f}"
                       if "reward_mean" in m and "loss" in m else " (no new step yet)")
            parts.append(f"{p} step {t['version']}{trained} wait {t.get('wait_fraction', 0):.0%}{batch_wait(t)}")
        hists = state.get("staleness_hist", {})
        # one policy: its histogram; several: each policy's, named
        hist = (next(iter(hists.values()), {}) if len(hists) <= 1
                else " ".join(f"{p} {h}" for p, h in hists.items()))
        # a node's weight versions: one per policy, in the trainers' order (``v3`` or ``v3/1``), after its
        # partition and index (``h100-0``: partition names often end in digits, as hosts do)
        shown = [f"{n.split('-')[1]}-{n.split('-')[-1]}:v"
                 + "/".join(str((i.get("versions") or {}).get(p, "?")) for p in (trainers or [""]))
                 for n, i in state.get("nodes", {}).items() if not i.get("gone") and n.startswith("rollout")]
        # many nodes (``rollout.nodes_per_worker``): the first few, then how many more
        nodes = " ".join(shown[:MAX_NODES_SHOWN]) + (f" +{len(shown) - MAX_NODES_SHOWN} more"
                                                      if len(shown) > MAX_NODES_SHOWN else "")
        failed, reason = top_failure(state.get("ledger") or {})
        if len(reason) > REASON_SHOWN:
            reason = reason[:REASON_SHOWN - 3] + "..."
        failures = f" | [bold]{failed} tasks failed[/bold] ({escape(reason)})" if failed else ""
        ep_s, tok_s = self._rates(tick)
        self.note(
            " | ".join(parts)
            + f" | {ep_s:.1f} ep/s {tok_s:.0f} tok/s"
            + f" | staleness {hist} | nodes {nodes}{failures}", markup=True)

    def _rates(self, tick: Tick) -> tuple[float, float]:
        """Episodes and sampled tokens per second since the previous status line (a run that
        stopped generating shows 0, not an average that decays slowly); the run's average on the
        first line, and where the counts went back (a data layer replaced without its state)."""
        state = tick.data_layer
        eps, toks = state.get("episodes_generated"), state.get("tokens_generated")
        last = self._counted
        self._counted = (tick.read_at, int(eps), int(toks)) if eps is not None and toks is not None else None
        if last is None or self._counted is None or tick.read_at <= last[0] or eps < last[1] or toks < last[2]:
            return float(state["episodes_per_s"]), float(state["generated_tokens_per_s"])
        span = tick.read_at - last[0]
        return (eps - last[1]) / span, (toks - last[2]) / span
