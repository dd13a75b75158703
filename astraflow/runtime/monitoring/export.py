"""Monitoring room: a run's curves outside the page, as PNG plots (``astraflow plot``, needs
matplotlib) or TensorBoard event files (``astraflow tensorboard``, needs tensorboard). Both read
``metrics.jsonl`` through the metrics reader; neither is needed by a run.
"""

from __future__ import annotations

import io
import math
import time
from pathlib import Path

from astraflow.runtime.monitoring.metrics import is_eval_record, read_metrics, tail_records
from astraflow.runtime.monitoring.snapshot import read_snapshot
from storage.atomic import write_atomically
from storage.ownership import UnsafeRunDir, check_owner_only, owner_only
from storage.paths import RunPaths


def _own_run_dir(run_dir: Path | str, option: str) -> None:
    """Refuse to write into a run directory another user could change: a symlink they planted
    there (``plots/reward.png`` -> ``~/.bashrc``) would have us overwrite a file of ours."""
    try:
        check_owner_only(run_dir)
    except UnsafeRunDir as err:
        raise ValueError(f"{err}; or pass {option} to write somewhere of your own") from None


def export_tensorboard(run_dir: Path | str, logdir: Path | str | None = None, follow: bool = False,
                       poll_s: float = 2.0, start_grace_s: float = 60.0) -> int:
    """Mirror ``metrics.jsonl`` into TensorBoard event files (optional: needs the ``tensorboard``
    package; nothing in a run depends on it). Every numeric field of a trainer line becomes the
    scalar ``<policy>/<field>`` at its step, every evaluation field ``<policy>/eval/<field>``.

    ``follow=True`` keeps mirroring new lines until the run ends (``summary.json`` appears) or its
    orchestrator stops writing status (its snapshot is stale: ``Snapshot.stale``) or is gone before
    its first (``Snapshot.gone_before_first_status``); a directory
    where no run appears within ``start_grace_s`` (no orchestrator, status, metrics or summary:
    a mistyped one, a run that died before starting) is a ``ValueError``. Returns lines written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("TensorBoard export needs the tensorboard package: pip install tensorboard") from None
    paths = RunPaths(Path(run_dir))
    if not paths.metrics.exists() and not follow:
        raise ValueError(f"{paths.metrics} does not exist: pass the --run-dir of a run that started")
    if logdir is not None:
        writer = SummaryWriter(log_dir=str(logdir))
    else:
        _own_run_dir(run_dir, "--logdir")
        with owner_only():  # in the run directory, owner-only as everything the run writes there
            writer = SummaryWriter(log_dir=str(paths.tensorboard))
    offset = written = 0
    t0 = time.monotonic()
    try:
        while True:
            if follow and time.monotonic() - t0 > start_grace_s and not any(
                    p.exists() for p in (paths.orchestrator_file, paths.status_file, paths.metrics, paths.summary)):
                raise ValueError(f"no run in {paths.root} after {start_grace_s:.0f} s (no status, metrics or summary): "
                                 "pass the --run-dir of a run that started")
            # decided before reading, so the lines written before the run ended are all read
            snap = read_snapshot(paths.root) if follow else None
            ended = not follow or paths.summary.exists() or snap.stale or bool(snap.gone_before_first_status())
            records, offset = tail_records(paths.metrics, offset)
            for rec in records:
                prefix = f"{rec.get('policy', '?')}/" + ("eval/" if is_eval_record(rec) else "")
                for key, value in rec.items():
                    number = isinstance(value, (int, float)) and not isinstance(value, bool)
                    if key not in ("step", "policy") and number:
                        writer.add_scalar(prefix + key, value, global_step=int(rec["step"]))
                written += 1
            writer.flush()
            if ended:
                break
            time.sleep(poll_s)
    finally:
        writer.close()
    return written


PLOTS = ("reward", "accuracy", "throughput", "staleness")


def write_plots(run_dir: Path | str, out: Path | str | None = None) -> list[Path]:
    """Write ``reward.png``, ``accuracy.png``, ``throughput.png`` and ``staleness.png`` from the
    run's ``metrics.jsonl`` into ``out`` (default ``<run>/plots``); returns the paths written."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("astraflow plot needs matplotlib: pip install 'astraflow[plot]'") from None
    matplotlib.use("Agg")
    view = read_metrics(run_dir)
    if not view.policies:
        raise ValueError(f"{RunPaths(Path(run_dir)).metrics} has no metrics yet: plot a run that took a step")
    if out is not None:
        return _draw_all(view, Path(out))
    _own_run_dir(run_dir, "--out")
    with owner_only():  # in the run directory, owner-only as everything the run writes there
        return _draw_all(view, RunPaths(Path(run_dir)).plots)


def _draw_all(view, out_dir: Path) -> list[Path]:
    """Draw every plot of `view` into `out_dir`, made if missing."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # under a file, in a read-only place: a ValueError naming the option
        raise _unwritable(out_dir, err) from None
    import matplotlib.pyplot as plt

    written = []
    for name in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        try:
            _DRAW[name](ax, view.policies)
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            png = io.BytesIO()
            fig.savefig(png, format="png", dpi=100)
            write_atomically(path, png.getvalue(), durable=False)  # replaces a link there, never writes through it
        except OSError as err:
            raise _unwritable(out_dir, err) from None
        finally:
            plt.close(fig)
        written.append(path)
    return written


def _present(xs: list, ys: list) -> tuple[list, list]:
    """The points of a series whose value is known and finite (a step line may lack a field; a
    NaN or an infinity is not drawn: matplotlib would leave a gap or a blank axis)."""
    keep = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [x for x, _ in keep], [y for _, y in keep]


def _legend_or_say(ax, drawn: bool, nothing: str) -> None:
    """The legend when a series has points, else ``nothing`` in the middle of the axes (a blank
    plot with a legend reads as a plotting failure)."""
    if drawn:
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, nothing, ha="center", va="center", transform=ax.transAxes)


def _draw_reward(ax, policies: dict) -> None:
    drawn = False
    for p, c in policies.items():
        xs, ys = _present(c.step, c.reward_mean)
        ax.plot(xs, ys, marker=".", label=p)
        drawn = drawn or bool(xs)
    ax.set(title="mean reward per training batch", xlabel="trainer step", ylabel="reward")
    _legend_or_say(ax, drawn, "no trainer step with a finite reward yet")
    ax.grid(alpha=0.3)


def _draw_accuracy(ax, policies: dict) -> None:
    drawn = False
    for p, c in policies.items():
        xs, ys = _present(c.eval_step, c.eval_accuracy)
        if xs:
            ax.plot(xs, ys, marker="o", label=p)
            drawn = True
    ax.set(title="held-out accuracy", xlabel="weight version", ylabel="accuracy", ylim=(-0.02, 1.02))
    evaluated = any(c.eval_step for c in policies.values())
    _legend_or_say(ax, drawn, "no evaluation with a finite accuracy yet" if evaluated else "no evaluation yet")
    ax.grid(alpha=0.3)


def _draw_throughput(ax, policies: dict) -> None:
    ax2 = ax.twinx()
    # run-wide figures, written with every policy's step: one series, the points of all in time order
    run_wide = sorted(((t, e, k) for c in policies.values()
                       for t, e, k in zip(c.time, c.episodes_per_s, c.generated_tokens_per_s)),
                      key=lambda point: point[0])
    times = [t for t, _, _ in run_wide]
    episodes, tokens = _present(times, [e for _, e, _ in run_wide]), _present(times, [k for _, _, k in run_wide])
    ax.plot(*episodes, marker=".", color="tab:blue", label="episodes/s (run)")
    ax2.plot(*tokens, marker=".", color="tab:orange", linestyle="--", label="tokens/s (run)")
    ax.set(title="throughput (cumulative average)", xlabel="seconds", ylabel="episodes/s")
    ax2.set_ylabel("tokens/s")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    if episodes[0] or tokens[0]:
        ax.legend(h1 + h2, l1 + l2, loc="best")
    else:
        _legend_or_say(ax, False, "no trainer step with a finite throughput yet")
    ax.grid(alpha=0.3)


def _draw_staleness(ax, policies: dict) -> None:
    n = len(policies)
    for i, (p, c) in enumerate(policies.items()):
        ks = sorted(c.staleness_hist, key=int)
        ax.bar([int(k) + (i - (n - 1) / 2) * 0.8 / n for k in ks], [c.staleness_hist[k] for k in ks],
               width=0.8 / n, label=p)
    ax.set(title="staleness of consumed trajectories", xlabel="versions behind", ylabel="trajectories")
    _legend_or_say(ax, any(c.staleness_hist for c in policies.values()), "no trajectory consumed yet")
    ax.grid(alpha=0.3, axis="y")


_DRAW = {"reward": _draw_reward, "accuracy": _draw_accuracy, "throughput": _draw_throughput,
         "staleness": _draw_staleness}


def _unwritable(out_dir: Path, err: OSError) -> ValueError:
    """The ``ValueError`` for a plots directory that cannot be created or written, naming ``--out``."""
    where = f" ({err.filename})" if err.filename else ""
    return ValueError(f"--out {out_dir}: the plots directory cannot be created or written: "
                      f"{err.strerror or err}{where}; pass an --out in a place you can write to")
