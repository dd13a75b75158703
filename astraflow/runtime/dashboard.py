"""Scheduler preload: the AstraFlow page on the Dask dashboard (placeholder route until the
monitoring page lands). Loaded with ``dask scheduler --preload astraflow.runtime.dashboard``."""

from __future__ import annotations


def dask_setup(scheduler) -> None:  # noqa: D401  (Dask preload hook)
    return None
