"""The one module that knows the on-disk layout of a run.

Components name a run's files through ``RunPaths`` and the store-relative helpers below
rather than joining strings (the certificate files inside ``security/`` are named by
``astraflow.runtime.security``, which creates them). A run directory on shared storage looks like::

    <run>/
      config.yaml                 the resolved configuration (written once at start)
      metrics.jsonl               one JSON object per line: the durable record of the run
      scheduler.json              Dask scheduler address file (rendezvous for workers, CLI)
      summary.json                final state of the run (steps, evaluations, ledger)
      summary.<time>.json         the summary of an earlier run in the same directory (resumed)
      control/                    partitions.json (desired) + partitions.lock, status.json,
                                  orchestrator.json, dataflow_state.json, run.lock,
                                  dataflow.snapshot + dataflow.changes.<n> + ledger.jsonl
                                  (the data layer's durable state: base, log of changes, journal),
                                  autoscale.jsonl (the autoscaler's changes), models.json (the
                                  architecture each policy's weights are trained as)
      security/                   owner-only: the run's TLS certificates and key (ca.pem, run.pem,
                                  run-key.pem), tls.json (where they are), dashboard.token
      plots/, tensorboard/        written on request by ``astraflow plot`` / ``astraflow tensorboard``
      logs/                       one log file per process
      jobs/                       worker job scripts and logs; submitted.json: every job the
                                  current incarnation submitted (the next one cancels leftovers)
      trajectories/               the Zarr trajectory store (unless the config points elsewhere)
        astraflow_store.json      the store's layout version (checked on every open)
        segments/<segment>/       append-only, one writer each (a node writes a series)
          data/                   its Zarr v3 group (per-token and per-entry arrays)
          commits/log             its commit log: one checksummed record per write
          commits/<seqno>.json    one commit marker per published batch (segments written
                                  before the commit log; still read, followed by the log)
      weights/<policy>/v<N>/      one committed weight version (shards + manifest + marker)
      weights/<policy>/staging/   versions being written (never read)
      weights/<policy>/readers/   hold files of readers that have a version open
      weights/<policy>/deltas/    sparse deltas v<N-1> -> v<N> (when ``storage.deltas`` is on)
      trainer_state/<policy>/     a trainer's own state for resuming (optimizer.pt)
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: the longest name of a run or a policy: each becomes a path component and part of job and
#: file names, so it stays far below a filesystem's limit on one name
NAME_MAX = 64


def is_plain_name(name: str) -> bool:
    return bool(_SAFE.fullmatch(name))


def check_name(kind: str, name: str) -> str:
    """Names that become path components must be plain: letters, digits, ``_ . -``."""
    if not is_plain_name(name):  # fullmatch: '$' alone would let a trailing newline through
        raise ValueError(
            f"{kind} name {name!r} is not usable as a path component: use letters, digits, '_', '.', '-'"
        )
    return name


class RunPaths:
    """Paths inside one run directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def scheduler_file(self) -> Path:
        return self.root / "scheduler.json"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def desired_partitions(self) -> Path:
        """The partitions the run should have (config + ``astraflow partitions add/remove``)."""
        return self.control / "partitions.json"

    @property
    def partitions_lock(self) -> Path:
        """Held (flock) by a CLI call for its read-modify-write of `desired_partitions`."""
        return self.control / "partitions.lock"

    @property
    def run_lock(self) -> Path:
        """Held (flock) by the ``astraflow run`` that owns the directory; it says who (pid, host,
        start time)."""
        return self.control / "run.lock"

    @property
    def status_file(self) -> Path:
        """Snapshot of the run written by the orchestrator every tick (read by ``status``)."""
        return self.control / "status.json"

    @property
    def orchestrator_file(self) -> Path:
        """Who runs the orchestrator: pid, host, start time, dashboard address."""
        return self.control / "orchestrator.json"

    @property
    def dataflow_state(self) -> Path:
        """The data layer's saved state: dataflow rules, versions (for resuming a run)."""
        return self.control / "dataflow_state.json"

    @property
    def dataflow_snapshot(self) -> Path:
        """Everything the data layer holds, rewritten before each call that changed it answers."""
        return self.control / "dataflow.snapshot"

    @property
    def autoscale_log(self) -> Path:
        """One JSON line per change the autoscaler made (its reason and the signals behind it)."""
        return self.control / "autoscale.jsonl"

    @property
    def models_record(self) -> Path:
        """The architecture (config.json signature) each policy's weights are trained as,
        checked when the run resumes."""
        return self.control / "models.json"

    @property
    def security(self) -> Path:
        """Owner-only: the run's TLS certificates and key, and its dashboard token."""
        return self.root / "security"

    @property
    def dashboard_token(self) -> Path:
        """The token a request to the run's dashboard must carry."""
        return self.security / "dashboard.token"

    @property
    def tls_record(self) -> Path:
        """Where the run's TLS files are (``TLSFiles`` as JSON): how its clients and workers find them."""
        return self.security / "tls.json"

    @property
    def ledger_journal(self) -> Path:
        """One line per task created and per task ended, across the run's incarnations."""
        return self.control / "ledger.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def archived_summary(self, stamp: int, n: int = 1) -> Path:
        """Where the summary of a finished run is kept when the directory is run again
        (``n`` > 1: the n-th one archived in the same second)."""
        suffix = "" if n == 1 else f"-{int(n)}"
        return self.root / f"summary.{int(stamp)}{suffix}.json"

    @property
    def plots(self) -> Path:
        """Default output directory of ``astraflow plot``."""
        return self.root / "plots"

    @property
    def tensorboard(self) -> Path:
        """Default event-file directory of ``astraflow tensorboard``."""
        return self.root / "tensorboard"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        return self.logs / f"{check_name('process', process)}.log"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def trainer_state(self) -> Path:
        """The trainers' own state for resuming, one directory per policy."""
        return self.root / "trainer_state"

    def optimizer_state(self, policy: str) -> Path:
        """A trainer's saved optimiser state (AdamW moments), for resuming the run."""
        return self.trainer_state / check_name("policy", policy) / "optimizer.pt"

    @property
    def jobs(self) -> Path:
        """Rendered job scripts and their stdout/stderr."""
        return self.root / "jobs"

    @property
    def job_records(self) -> Path:
        """Every worker job the current incarnation of the run submitted (`astraflow.runtime.jobrecords`)."""
        return self.jobs / "submitted.json"

    def make(self) -> "RunPaths":
        """Create the run directory (owner-only, mode 0700, when it is new) and its subdirectories."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (self.control, self.logs, self.jobs):
            d.mkdir(parents=True, exist_ok=True)
        return self


def default_run_dir(name: str, stamp: str, parent: Path = Path("runs")) -> Path:
    """The run directory ``astraflow run`` uses when none is given: ``runs/<name>-<stamp>``."""
    return parent / f"{name}-{stamp}"


def tmp_sibling(final: Path) -> Path:
    """A unique temporary name next to ``final`` (same directory, so rename/link is atomic).

    Hidden and ending in ``.tmp``: listings of markers, versions and segments skip it, and a
    file left behind by a killed process is recognisable and removable.
    """
    return final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def is_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


# -- trajectory store layout (relative to the store root) ------------------------------------

def segments_root(store_root: Path) -> Path:
    return store_root / "segments"


def segment_dir(store_root: Path, segment: str) -> Path:
    return store_root / "segments" / check_name("segment", segment)


def segment_data_dir(store_root: Path, segment: str) -> Path:
    """The segment's Zarr v3 group (flat per-token arrays and per-entry index arrays)."""
    return segment_dir(store_root, segment) / "data"


def segment_commit_dir(store_root: Path, segment: str) -> Path:
    """What a segment has committed: its commit log (and, in segments written before the log,
    one commit marker per published batch, created atomically)."""
    return segment_dir(store_root, segment) / "commits"


def commit_log(store_root: Path, segment: str) -> Path:
    """The segment's append-only commit log (``trajectories.layout``: record format)."""
    return segment_commit_dir(store_root, segment) / "log"


def commit_marker(store_root: Path, segment: str, seqno: int) -> Path:
    return segment_commit_dir(store_root, segment) / f"{seqno:010d}.json"


COMMIT_MARKER_RE = re.compile(r"^(\d{10})\.json$")


def store_layout_file(store_root: Path) -> Path:
    """Records the layout version of a trajectory store; opened first, checked always."""
    return store_root / "astraflow_store.json"


# -- weight store layout (relative to the weights root) --------------------------------------

def policy_dir(weights_root: Path, policy: str) -> Path:
    return weights_root / check_name("policy", policy)


def version_dir(weights_root: Path, policy: str, version: int) -> Path:
    return policy_dir(weights_root, policy) / f"v{int(version):08d}"


def staging_root(weights_root: Path, policy: str) -> Path:
    return policy_dir(weights_root, policy) / "staging"


def staging_dir(weights_root: Path, policy: str, version: int) -> Path:
    return staging_root(weights_root, policy) / f"v{int(version):08d}"


def manifest_file(weights_root: Path, policy: str, version: int) -> Path:
    return version_dir(weights_root, policy, version) / "manifest.json"


def commit_file(weights_root: Path, policy: str, version: int) -> Path:
    """Written last: a version without it does not exist for readers."""
    return version_dir(weights_root, policy, version) / "COMMITTED"


def deltas_root(weights_root: Path, policy: str) -> Path:
    return policy_dir(weights_root, policy) / "deltas"


def delta_dir(weights_root: Path, policy: str, from_version: int, to_version: int) -> Path:
    """Sparse bf16 delta ``from_version -> to_version`` (written by the delta writer, which
    creates a ``COMMITTED`` file in it last; the weight store reports only such deltas)."""
    return deltas_root(weights_root, policy) / f"v{int(from_version):08d}-v{int(to_version):08d}"


DELTA_DIR_RE = re.compile(r"^v(\d{8})-v(\d{8})$")


def readers_dir(weights_root: Path, policy: str) -> Path:
    return policy_dir(weights_root, policy) / "readers"


def hold_file(weights_root: Path, policy: str, version: int, token: str) -> Path:
    """A reader's hold on one version (``token`` makes it unique per hold; content: pid, host)."""
    return readers_dir(weights_root, policy) / f"v{int(version):08d}.{check_name('hold token', token)}.hold"


HOLD_FILE_RE = re.compile(r"^v(\d{8})\.[A-Za-z0-9_.-]+\.hold$")


VERSION_DIR_RE = re.compile(r"^v(\d{8})$")
