"""Workers as Slurm jobs, driven through the Slurm command-line tools.

Every call to ``sbatch``, ``squeue``, ``scancel``, ``sinfo`` and ``scontrol`` goes through
`run_slurm` (``slurm_cli.py``, with what reads the tools' output), whose `SlurmCommandError`
carries the exit code, command, stdout and stderr. One worker = one batch job on one node, its
script rendered from ``templates/worker.sbatch.j2`` by `schedulers.sbatch_script`
(`SlurmScheduler.render` returns the script and the ``sbatch`` argv without submitting: the
dry run). `jobs()` is one ``squeue --json`` call; `wait_for` polls it with backoff.

Jobs carry ``--comment=<tag>``: `jobs()` lists the jobs with this scheduler's tag, so a restarted
orchestrator with the same tag finds the workers it started before (`cancel_previous` cancels them).
A job's name is its worker's name followed by the tag (`job_name`): several runs of one user have
workers of the same names, and ``squeue`` shows names, not comments.

Facts about the Slurm versions this targets (22.05+):
* ``squeue --json`` ignores ``-j``/``--name`` filters in 22.05, so filtering happens here.
* ``scancel <unknown id>`` exits 0 silently: `cancel` confirms unknown ids with ``squeue``.
* Finished jobs stay visible in ``squeue`` for ``MinJobAge`` seconds (default 300).

Why not dask-jobqueue's ``SLURMJob``: it renders its own worker command (a nanny, its own name
suffixes) and template, which would put a second worker command line next to the one the
local backend uses, and it is an async ``ProcessInterface`` meant to be driven by its own
cluster object. Submission here is a handful of synchronous CLI calls we control and test.

pyslurm is not used for submission or polling: it is locked to Slurm's major version (PyPI has
only 25.11; it cannot build against 22.05). `pyslurm_status` reports whether an installed
pyslurm matches the site's Slurm, for a future backend; the CLI path is always available.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schedulers.base import ACTIVE_STATES, JobRef, JobStatus, UnknownJobError
from schedulers.command import TLSFiles, partition_worker_command, worker_env
from schedulers.partition import Partition, parse_worker_name, worker_name
from schedulers.slurm_cli import (PartialSubmitError, SlurmCommandError, SlurmWaitTimeout, backoff, exit_code,
                                  first_then, is_mine, normalise_state, run_slurm, sbatch_env, state_text, user_name)
from schedulers.slurm_cli import pyslurm_status, slurm_version  # noqa: F401  (this module's public names)
from schedulers.sbatch_script import (WORKER_TEMPLATE, check_job_dir, environment, job_name, render_worker_job,
                                     worker_of_job)
from storage.atomic import write_atomically

log = logging.getLogger("schedulers")

_TAG = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def run_tag(run_dir: Path) -> str:
    """The ``--comment`` of the Slurm jobs of the run in ``run_dir``: readable and unique per run
    directory, the same for every incarnation of the run (how a restarted run finds its jobs),
    whatever path reaches it (a symlink to it, or to a directory above it)."""
    real = run_dir.resolve()
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", real.name)[:40] or "run"
    digest = hashlib.sha1(os.fsencode(real)).hexdigest()[:8]  # its bytes, whatever the locale
    return f"astraflow.{base}.{digest}"

@dataclass(frozen=True)
class SlurmNode:
    """One node as ``sinfo --json`` reports it (read by `astraflow partitions` and tests)."""

    name: str
    """Node name (``h100-1``)."""
    partitions: tuple[str, ...]
    """Slurm partitions the node belongs to."""
    state: str
    """Slurm node state (``idle``, ``mixed``, ``allocated``, ``down``...)."""
    cpus: int
    """CPUs Slurm schedules on the node."""
    gres: str
    """Generic resources (``gpu:h100:4``), empty when none."""


class SlurmScheduler:
    """`Scheduler` backend submitting one Slurm batch job per worker.

    `job_dir`: where rendered scripts (``<worker>.sbatch``) and logs (``<worker>.<jobid>.log``)
    go; must be on a filesystem the compute nodes share (``<run>/jobs``). `python`: the
    interpreter on the compute nodes (the venv with astraflow installed). `interface`/`host`:
    what the worker listens on (``ib0`` at a site, ``lo`` for a one-host test cluster).
    `setup_lines`: shell lines run before the worker (``module load ...``, ``source venv/bin/activate``),
    as written: they are the run owner's shell, not quoted values.
    `tag`: the ``--comment`` that marks this run's jobs. `command_timeout`: per Slurm command.
    `cancel_wait_s`: how long `cancel_previous` waits for the jobs it cancelled to end.
    """

    kind = "slurm"
    supports_gres = True

    def __init__(
        self,
        job_dir: str | Path,
        *,
        python: str = sys.executable,
        interface: str | None = None,
        host: str | None = None,
        setup_lines: Sequence[str] = (),
        tag: str = "astraflow",
        death_timeout: float = 60,
        command_timeout: float = 30.0,
        tls: TLSFiles | None = None,
        cancel_wait_s: float = 120.0,
    ):
        if not _TAG.fullmatch(tag):
            raise ValueError(f"tag {tag!r}: use 1-64 letters, digits, '_', '.', ':' or '-'")
        if host is not None and interface is not None:
            raise ValueError("give either host or interface for the workers, not both")
        self.job_dir = check_job_dir(job_dir)
        self.python = python
        self.interface = interface
        self.host = host
        self.setup_lines = tuple(setup_lines)
        self.tag = tag
        self.death_timeout = death_timeout
        self.command_timeout = command_timeout
        self.cancel_wait_s = cancel_wait_s
        self.tls = tls
        self._submitted: dict[str, JobRef] = {}
        self._env_noted = False  # the sbatch variables left out are said once
        self._template = environment().get_template(WORKER_TEMPLATE)

    # ------------------------------------------------------------------ rendering (dry run)
    def script_path(self, name: str) -> Path:
        return self.job_dir / f"{name}.sbatch"

    def render(self, partition: Partition, scheduler_address: str, index: int) -> tuple[str, list[str]]:
        """The job script of worker `index` of `partition` and the argv that submits it.

        Writes nothing and submits nothing: printing both is the dry run.
        """
        if partition.scheduler != "slurm":
            raise ValueError(
                f"partition {partition.name!r} has scheduler {partition.scheduler!r}: set scheduler: slurm "
                "to submit it to Slurm"
            )
        name = worker_name(partition, index)
        command = partition_worker_command(
            partition,
            scheduler_address,
            name,
            python=self.python,
            host=self.host,
            interface=self.interface,
            death_timeout=self.death_timeout,
            tls=self.tls,
        )
        return render_worker_job(self._template, partition, name, job_dir=self.job_dir, tag=self.tag,
                                 setup_lines=self.setup_lines, env=worker_env(partition, name), command=command)

    # ------------------------------------------------------------------ Scheduler protocol
    def submit(self, partition: Partition, scheduler_address: str, count: int, start_index: int = 0) -> list[JobRef]:
        """One ``sbatch`` per worker, all or none: if one fails, the jobs this call submitted
        before it are cancelled by id and `PartialSubmitError` says which (a request is never
        left half-submitted with jobs nobody tracks)."""
        if count < 0:
            raise ValueError(f"count is {count}: use 0 or more")
        self.job_dir.mkdir(parents=True, exist_ok=True)
        refs: list[JobRef] = []
        for index in range(start_index, start_index + count):
            try:
                refs.append(self._submit_one(partition, scheduler_address, index))
            except SlurmCommandError as err:
                if not refs:
                    raise
                self._undo(refs, err)
            except BaseException as err:  # writing the script, running sbatch at all: the same all or none
                if refs:
                    err.add_note(self._cancel_submitted(refs))
                raise
        return refs

    def _submit_one(self, partition: Partition, scheduler_address: str, index: int) -> JobRef:
        script, argv = self.render(partition, scheduler_address, index)
        path = Path(argv[-1])
        # sbatch copies the script when it submits: atomic for readers, no fsync needed
        write_atomically(path, script, durable=False)
        env, left_out = sbatch_env(partition)
        if left_out and not self._env_noted:
            self._env_noted = True
            log.warning("sbatch runs without %s from the environment: the partition's settings decide these",
                        ", ".join(left_out))
        try:
            out = run_slurm(argv, timeout=self.command_timeout, env=env).strip()
        except SlurmCommandError as err:
            if err.returncode == 124:  # timed out: the controller may have taken the job all the same
                err.add_note(self._cancel_unanswered(worker_name(partition, index)))
            raise
        job_id = out.split(";")[0]  # --parsable prints "id" or "id;cluster"
        if not _JOB_ID.fullmatch(job_id):
            raise SlurmCommandError(argv, 0, out, "sbatch --parsable printed no job id")
        name = worker_name(partition, index)
        ref = JobRef(job_id, partition.name, name, self.kind, self.job_dir / f"{name}.{job_id}.log", path)
        self._submitted[job_id] = ref
        return ref

    def _cancel_unanswered(self, name: str) -> str:
        """After an ``sbatch`` that timed out: cancel the job of worker ``name`` with this run's tag
        if Slurm has it (nobody tracks it, and a later submit would reuse the name); says what
        was done."""
        try:
            uid, me, named = os.getuid(), user_name(), job_name(name, self.tag)
            found = [str(j["job_id"]) for j in self._squeue()
                     if j.get("comment") == self.tag and j.get("name") == named and is_mine(j, uid, me)
                     and normalise_state(state_text(j.get("job_state"))) in ACTIVE_STATES]
            if found:
                run_slurm(["scancel", *found], timeout=self.command_timeout)
        except (SlurmCommandError, OSError, ValueError) as err:
            return (f"whether it submitted {name} anyway is unknown ({err}); look for it with "
                    f"squeue --me --name {job_name(name, self.tag)}")
        return f"it had submitted {name} anyway: cancelled job(s) {', '.join(found)}" if found else \
            f"Slurm lists no job {name}: nothing was submitted"

    def _undo(self, refs: list[JobRef], err: SlurmCommandError) -> None:
        """Cancel the jobs a failed submit call already submitted, then raise `PartialSubmitError`."""
        undone = self._cancel_submitted(refs)
        raise PartialSubmitError(err, [r.job_id for r in refs], undone) from err

    def _cancel_submitted(self, refs: list[JobRef]) -> str:
        """Cancel the jobs of a submit call that failed part way and forget them; says how it went."""
        ids = [r.job_id for r in refs]
        try:
            run_slurm(["scancel", *ids], timeout=self.command_timeout)
            undone = f"cancelled the {len(ids)} job(s) it had already submitted ({', '.join(ids)})"
        except (SlurmCommandError, OSError) as again:
            undone = (f"cancelling the {len(ids)} job(s) it had already submitted ({', '.join(ids)}) failed too: "
                      f"{again}; cancel them with `scancel {' '.join(ids)}`")
        for job_id in ids:
            self._submitted.pop(job_id, None)
        return undone

    def close(self) -> None:
        """Nothing to release: Slurm jobs live in Slurm and are cancelled by id (``cancel``)."""

    def cancel(self, job_ids: Iterable[str], wait: bool = False) -> None:
        """``wait``: until Slurm no longer lists them active, at most ``cancel_wait_s``
        (``SlurmWaitTimeout`` past it)."""
        ids = [str(j) for j in job_ids]
        bad = [j for j in ids if not _JOB_ID.fullmatch(j)]
        if bad:
            raise ValueError(f"not Slurm job ids: {bad}: pass the ids submit() returned (digits)")
        if not ids:
            return
        run_slurm(["scancel", *ids], timeout=self.command_timeout)
        # scancel exits 0 for ids it does not know: confirm with one squeue call
        if any(j not in self._submitted for j in ids):
            seen = {str(j["job_id"]) for j in self._squeue()}
            unknown = [j for j in ids if j not in self._submitted and j not in seen]
            if unknown:
                raise UnknownJobError(unknown, self.kind)
        if wait:
            self._wait_ended(ids, self.cancel_wait_s)

    def cancel_previous(self, records: Sequence[JobRef]) -> list[JobStatus]:
        """Cancel every active worker job with this run's tag that this object did not submit
        (call it before this incarnation submits). `records` are not needed: Slurm lists a
        run's jobs by its tag, which also finds a job submitted just before a crash that was
        never recorded, while a recorded id alone proves nothing once Slurm reuses ids (a
        cluster whose state was reset numbers its jobs from 1 again)."""
        stale = [j for j in self.jobs() if j.active and j.job_id not in self._submitted]
        if stale:
            run_slurm(["scancel", *(j.job_id for j in stale)], timeout=self.command_timeout)
            self._wait_ended([j.job_id for j in stale], self.cancel_wait_s)
        return stale

    def _wait_ended(self, job_ids: Sequence[str], deadline_s: float) -> None:
        """Until none of ``job_ids`` is active (gone from ``squeue`` counts as ended): a cancelled
        job's processes run on until they exit or Slurm kills them (its ``KillWait``), and a worker
        of a previous incarnation must not write into a run directory the next one is cleaning
        up. `SlurmWaitTimeout` when some are still active after ``deadline_s``."""
        deadline, left = time.monotonic() + deadline_s, set(job_ids)
        seen: dict[str, JobStatus | None] = {j: None for j in left}
        failed: SlurmCommandError | None = None
        for _ in first_then(backoff(deadline)):
            try:
                listed = self.jobs()
            except SlurmCommandError as err:  # squeue did not answer this time: ask again
                failed = err
                continue
            seen = {s.job_id: s for s in listed if s.job_id in left and s.active}
            left = set(seen)
            if not left:
                return
        states = ", ".join(f"{j} {s.raw_state or s.state if s else 'unknown'}" for j, s in sorted(seen.items()))
        why = f" (the last squeue failed: {failed})" if failed is not None else ""
        raise SlurmWaitTimeout(f"cancelled jobs still running after {deadline_s:g} s: {states}{why}", seen)

    def jobs(self) -> list[JobStatus]:
        uid, me = os.getuid(), user_name()
        out = []
        for j in self._squeue():
            job_id = str(j["job_id"])
            if j.get("comment") != self.tag or not is_mine(j, uid, me):
                continue
            name = worker_of_job(j.get("name", ""), self.tag)
            try:
                part = str(parse_worker_name(name)["partition"])
            except ValueError:
                continue  # a job with our tag that is not a worker (e.g. the head job)
            raw = state_text(j.get("job_state"))
            state = normalise_state(raw)
            reason = j.get("state_reason") or None
            if reason == "None":
                reason = None
            code = exit_code(j.get("exit_code"))
            if state == "FAILED" and code not in (None, 0):
                reason = f"{reason or raw}; exit code {code}"
            node = j.get("nodes") or j.get("batch_host") or None
            out.append(JobStatus(job_id, part, name, state, reason, raw, node if state == "RUNNING" else None))
        return out

    # ------------------------------------------------------------------ extras
    def wait_for(self, job_ids: Iterable[str], states: Iterable[str], deadline_s: float) -> dict[str, JobStatus]:
        """Poll `jobs()` (one squeue per poll, with backoff) until every job is in one of `states`.

        Raises `SlurmWaitTimeout` (with the last statuses) when `deadline_s` passes first.
        """
        ids, wanted = [str(j) for j in job_ids], set(states)
        deadline = time.monotonic() + deadline_s
        last: dict[str, JobStatus | None] = {}
        for _ in first_then(backoff(deadline)):
            by_id = {s.job_id: s for s in self.jobs()}
            last = {j: by_id.get(j) for j in ids}
            if all(s is not None and s.state in wanted for s in last.values()):
                return {j: s for j, s in last.items() if s is not None}
        summary = ", ".join(f"{j}={s.state if s else 'absent'}" for j, s in last.items())
        raise SlurmWaitTimeout(f"jobs not in {sorted(wanted)} after {deadline_s} s: {summary}", last)

    def nodes(self) -> list[SlurmNode]:
        """The cluster's nodes from one ``sinfo --json`` call."""
        data = json.loads(run_slurm(["sinfo", "--json"], timeout=self.command_timeout))
        return [
            SlurmNode(n["name"], tuple(n.get("partitions", ())), str(n.get("state", "")), int(n.get("cpus", 0)),
                      "" if n.get("gres") in (None, "(null)") else str(n["gres"]))
            for n in data.get("nodes", [])
        ]

    def ping(self) -> bool:
        """True when slurmctld answers (``scontrol ping``)."""
        try:
            run_slurm(["scontrol", "ping"], timeout=self.command_timeout)
        except SlurmCommandError:
            return False
        return True

    def _squeue(self) -> list[dict[str, Any]]:
        data = json.loads(run_slurm(["squeue", "--json", "--states=all"], timeout=self.command_timeout))
        return list(data.get("jobs", []))
