"""Terminal progress of a run: what is being waited for (and for how long), and one status
line per interval while it trains (step, reward, held-out accuracy, throughput, staleness,
weight version per RaaS node). Plain lines when the output is not a terminal (logs, CI)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

from rich.console import Console


class Progress:
    def __init__(self, enabled: bool = True, console: Console | None = None, interval_s: float = 5.0):
        self.enabled = enabled
        self.console = console or Console(stderr=False, highlight=False, soft_wrap=True)
        self.interval_s = interval_s
        self._last = 0.0
        self._last_eval_reported = -1

    def note(self, msg: str) -> None:
        if self.enabled:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Show what is being waited for while the block runs; report how long it took."""
        t0 = time.time()
        if self.enabled and self.console.is_terminal:
            with self.console.status(f"{what} ..."):
                yield
        else:
            yield
        self.note(f"{what}: done in {time.time() - t0:.1f}s")

    def update(self, state: dict[str, Any], trainers: dict[str, dict[str, Any]]) -> None:
        if not self.enabled:
            return
        for ev in state.get("eval", []):
            if ev["step"] > self._last_eval_reported:
                self._last_eval_reported = ev["step"]
                self.note(
                    f"[bold]eval[/bold] {ev['policy']} v{ev['step']}: held-out accuracy "
                    f"[bold]{ev['eval_accuracy']:.3f}[/bold] ({ev['eval_prompts']} prompts, {ev['eval_seconds']:.1f}s)"
                )
        now = time.time()
        if now - self._last < self.interval_s:
            return
        self._last = now
        parts = []
        for p, t in trainers.items():
            m = t.get("last_metrics", {})
            parts.append(
                f"{p} step {t['version']} reward {m.get('reward_mean', float('nan')):.3f} "
                f"loss {m.get('loss', float('nan')):.4f} wait {t.get('wait_fraction', 0):.0%}"
            )
        hist = next(iter(state.get("staleness_hist", {}).values()), {})
        nodes = " ".join(
            f"{n.split('-')[1]}{n.split('-')[-1]}:v{(i.get('versions') or {}).get(next(iter(trainers), ''), '?')}"
            for n, i in state.get("nodes", {}).items()
            if not i.get("gone") and n.startswith("rollout")
        )
        self.note(
            " | ".join(parts)
            + f" | {state['trajectories_per_s']:.1f} traj/s {state['tokens_per_s']:.0f} tok/s"
            + f" | staleness {hist} | nodes {nodes}"
        )
