"""The numerics guard of training: a step whose loss or gradient norm is not finite (nan or inf)
is skipped by the backend, too many such steps in a row stop the trainer
(``trainer.max_nonfinite_steps``), and weights that are not finite are never published. The
messages name the usual causes and the fields to change."""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("astraflow.training")


class NonFiniteError(RuntimeError):
    """Training produced values that are not finite; the message names the likely cause."""


def likely_cause(policy: str | None = None) -> str:
    """The usual causes of non-finite values and what to change, in words."""
    name = policy if policy else "<name>"
    return (f"likely cause: a learning rate too high (lower policies[{name}].trainer.lr) or bad data "
            "(nan/inf rewards or behaviour log-probs in the batches)")


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of the floating-point tensors of ``state`` that hold a nan or an inf."""
    return [k for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def refuse_nonfinite(state: dict, policy: str, version: int) -> None:
    """``NonFiniteError`` when ``state`` (weights about to be published) is not finite."""
    bad = nonfinite_tensors(state)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteError(f"policy {policy}: not publishing v{version}, its weights hold nan/inf ({shown}); "
                             f"{likely_cause(policy)}")


class NonFiniteSteps:
    """The trainer's count of steps in a row whose loss or gradient norm was not finite: the
    backend skipped them (``nonfinite_skipped`` in their metrics; a backend that does not say is
    judged by its ``loss`` and ``grad_norm``). ``limit`` of them raise ``NonFiniteError``."""

    def __init__(self, policy: str, limit: int):
        self.policy, self.limit = policy, limit
        self.in_a_row = 0

    def observe(self, metrics: dict[str, float], step: int) -> None:
        """Count the metrics of ``step``; adds ``nonfinite_in_a_row`` to them."""
        skipped = metrics.get("nonfinite_skipped")
        if skipped is None:
            skipped = not all(math.isfinite(metrics.get(k, 0.0)) for k in ("loss", "grad_norm"))
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        metrics["nonfinite_in_a_row"] = float(self.in_a_row)
        if not skipped:
            return
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"trainer {self.policy}: {self.in_a_row} steps in a row had a loss or gradient norm that is "
                f"not finite (nan/inf) and were skipped (trainer.max_nonfinite_steps = {self.limit}); "
                f"{likely_cause(self.policy)}. The weights published so far are finite: fix it and run "
                "again on this run directory to resume")
        log.warning("trainer %s: step %d skipped, its loss or gradient norm is not finite (%d in a row; %s)",
                    self.policy, step, self.in_a_row, likely_cause(self.policy))
