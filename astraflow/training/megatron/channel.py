"""The Megatron backend's side of the control channel to its rank processes.

Each rank connects back to the backend over a Unix socket in its private work directory, or
under srun over TCP, authenticated with the launch's token (``launch``). ``RankChannel._call``
sends a command to every rank (or to the ones named) and waits for every answer, each wait with
a deadline while watching the ranks' processes; a rank that exits, closes its channel or misses
the deadline stops them all and raises ``RankError`` with how each ended (an exit code, a
signal) and the tails of their logs: ``RankKilled`` when one was killed by SIGKILL, which the
trainer reports as a lost process (the run restarts it, ``BackendProcessLost``).
``MegatronBackend`` (``backend``) starts the ranks and sets the attributes declared here; its
commands go through ``_call``.
"""

from __future__ import annotations

import shutil
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.training.megatron.launch import LocalRanks, RankError, RankKilled, SrunRanks, how_ended

if TYPE_CHECKING:
    from astraflow.training.megatron.backend import MegatronBackendConfig

#: seconds the other ranks have to answer after one answered that its disk is full
FULL_DISK_GRACE_S = 30.0


class RankChannel:
    """Commands to the ranks and their answers, and stopping the ranks after a failure (a base of
    ``MegatronBackend``, which sets these attributes when it starts them)."""

    config: MegatronBackendConfig
    #: the started rank processes (``launch.start_ranks``)
    _ranks: LocalRanks | SrunRanks
    #: one channel per rank, in rank order; empty once the ranks were stopped
    _conns: list[Connection]
    #: per rank: its log file
    _logs: list[Path]
    #: the backend's private work directory (rendezvous file, the ranks' working directory)
    _workdir: Path
    #: why the ranks were stopped (what a later call reports); None while they run
    _stopped: str | None

    def _call(self, cmd: str, payload: Any, timeout_s: float, per_rank: list[Any] | None = None,
              ranks: list[int] | None = None) -> list[Any]:
        """Send ``cmd`` with ``payload`` (or rank r ``per_rank[r]``) to every rank, or only to
        ``ranks`` (a command no collective runs in); their answers, in the order sent. A rank
        that answered ``full_disk`` makes it raise that ``OSError`` once every rank answered (the
        channels stay in step), or once the others had ``FULL_DISK_GRACE_S`` to (a rank left
        waiting in a collective the failed one never joined)."""
        if not self._conns:
            raise RankError(f"the backend's ranks were stopped: {self._stopped}; {cmd!r} needs a new backend")
        ranks = list(range(len(self._conns))) if ranks is None else ranks
        for r in ranks:
            try:
                self._conns[r].send((cmd, payload if per_rank is None else per_rank[r]))
            except OSError as e:  # its end is closed: the rank died since the last command
                raise self._lost(r, cmd, "before") from e
        deadline = time.monotonic() + timeout_s
        results = []
        full: OSError | None = None
        try:
            for r in ranks:
                # a rank that answered 'stop' exits next: not a crash while a slower one answers
                done = tuple(ranks[:len(results)]) if cmd == "stop" else ()
                results.append(self._answer(r, cmd, timeout_s, deadline, done))
                if isinstance(results[-1], OSError):
                    full = full or results[-1]
                    deadline = min(deadline, time.monotonic() + FULL_DISK_GRACE_S)
        except RankError as err:
            if full is not None:
                raise full from err
            raise
        if full is not None:
            raise full
        return results

    def _answer(self, r: int, cmd: str, timeout_s: float, deadline: float, done: tuple[int, ...]) -> Any:
        """Rank ``r``'s answer to ``cmd`` (an ``OSError`` for its full disk), or ``RankError``;
        the ranks in ``done`` may have exited."""
        c = self._conns[r]
        while not c.poll(0.2):
            dead = [d for d in self._ranks.exited() if d not in done]
            if dead:
                raise self._error(f"rank(s) {dead} exited during {cmd!r}", dead)
            if time.monotonic() > deadline:
                raise self._error(f"rank {r} did not answer {cmd!r} within {timeout_s:.0f}s", [r])
        try:
            status, result = c.recv()
        except (EOFError, OSError) as e:  # OSError: a TCP channel reset by its peer
            raise self._lost(r, cmd, "during", done) from e
        if status == "full_disk":
            return OSError(*result)
        assert status == "ok", status
        return result

    def _lost(self, r: int, cmd: str, when: str, done: tuple[int, ...] = ()) -> RankError:
        """The ``RankError`` (the other ranks stopped) for rank ``r``'s channel found closed
        ``when`` (before, during) ``cmd``: the ranks that exited (but ``done``), else ``r``."""
        dead = self._exited_soon(done)
        if dead:
            return self._error(f"rank(s) {dead} exited {when} {cmd!r}", dead)
        return self._error(f"rank {r} closed its channel {when} {cmd!r}", [r])

    def _exited_soon(self, done: tuple[int, ...] = (), wait_s: float = 10.0) -> list[int]:
        """The ranks (but ``done``) that have exited, given ``wait_s`` to show it: a channel
        closes just before its process ends (and under srun, the step ends a moment after its
        failed rank)."""
        deadline = time.monotonic() + wait_s
        while (not (dead := [d for d in self._ranks.exited() if d not in done])
               and time.monotonic() < deadline):
            time.sleep(0.1)
        return dead

    def _error(self, what: str, ranks: list[int]) -> RankError:
        """``what``, with how each of ``ranks`` ended and the tails of their logs (and srun's), once
        every rank is stopped: ``RankKilled`` when one of them was killed by SIGKILL."""
        codes = self._ranks.exit_codes(ranks)
        ended = [f"rank {r} {how_ended(c)}" for r, c in codes.items() if c is not None]
        what += f": {'; '.join(ended)}" if ended else ""
        self._kill(what)
        tails = []
        for r in ranks:
            text = self._logs[r].read_text(errors="replace") if self._logs[r].exists() else ""
            tails.append(f"--- rank {r} log ({self._logs[r]}), last lines:\n" + "\n".join(text.splitlines()[-25:]))
        for log in self._ranks.launcher_logs:  # what srun said about the step
            text = log.read_text(errors="replace") if log.exists() else ""
            tails.append(f"--- {log}, last lines:\n" + "\n".join(text.splitlines()[-10:]))
        killed = any(c == -signal.SIGKILL for c in codes.values())
        return (RankKilled if killed else RankError)(what + "\n" + "\n".join(tails))

    def _kill(self, why: str) -> None:
        """Stop the rank processes this backend started and close the channels (``why``: what a
        later call reports), as after a failure (``_drop_workdir``)."""
        self._stopped = self._stopped or why
        self._ranks.kill()
        self._conns = []
        self._drop_workdir(failed=True)

    def _drop_workdir(self, failed: bool) -> None:
        """Remove the work directory (rendezvous file, the ranks' working directory): after a
        clean stop, and after a failure when the logs live elsewhere (``log_dir``); a failure's
        ``RankError`` points at the logs, so the directory stays when they are in it."""
        if not failed or self.config.log_dir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
