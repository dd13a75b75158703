"""``LeaseStock``: tasks a rollout worker leases ahead for its nodes (``rollout.lease_ahead``).

With many nodes on one worker (sim fleets), every freed slot would otherwise cost its node a
round trip to the data layer, which a busy data layer answers in tens of milliseconds at the
tail. The stock keeps tasks leased under the worker's stock name
(``contracts.lease_stock_name``) and answers its nodes' leases itself: at once from what it
holds, or, when it is empty, at once with nothing (a node that does not wait) or with the next
refill (a node that waits: the stock's long poll stands for the node's). ``REFILLERS`` sender
threads refill it (``DataLayer.lease_ahead``, a long poll), sized to what the nodes ask for
during ``COVER_TRIPS`` refill round trips and never more than ``most``: a task waits in the
stock for about that long, so staleness does not grow and other workers are not starved.

Admission by version is the data layer's: the stock's heartbeat reports the oldest weight
versions among the nodes that asked for tasks lately (those new tasks would go to), and while
admission refuses new groups a waiting node whose weights are behind is answered at once with
nothing, as the data layer's own long poll would, so that it asks again with newer ones.

The data layer moves a task's lease from the stock to the node that took it when that node's
heartbeat names the task among those it holds, or when the node completes it; the stock's own
heartbeat (``beat``, sent with every gathered heartbeat) renews what it still holds. A
draining worker, a finished run or ``drain`` stops the refills and returns what no node took
(``DataLayer.return_leases``: back to the front of the queue, no attempt counted).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any

from astraflow.contracts import RolloutTask, lease_stock_name
from astraflow.pending import Pending, settle_all
from astraflow.transport import Packed

log = logging.getLogger("astraflow.rollout")

#: round trips of the refill call the stock covers at the nodes' current rate
COVER_TRIPS = 2.0
#: refill round trips remembered for the stock's size (the largest of them counts)
TRIPS_KEPT = 32
#: refill calls on their way at once (a long poll in one does not hold back the other)
REFILLERS = 2
#: the nodes that asked for tasks within this many seconds are those new tasks would go to
RECENT_S = 2.0
#: the longest pause after refills that came back empty at once (weights behind, a finished run)
MAX_PAUSE_S = 0.4


class LeaseStock:
    """The lease stock of one worker (module docstring)."""

    def __init__(self, handle: Any, worker: str, most: int, wait_s: float = 0.5):
        self.handle, self.worker, self.most, self.wait_s = handle, worker, most, wait_s
        self.name = lease_stock_name(worker)
        self._cond = threading.Condition()
        self._tasks: deque[RolloutTask] = deque()
        #: node -> the weight versions it last reported (a lease or a heartbeat); the stock
        #: reports the oldest
        self._node_versions: dict[str, dict[str, int]] = {}
        #: node -> when it last asked for tasks
        self._asked_at: dict[str, float] = {}
        self._largest_ask = 1
        #: nodes waiting for the next refill: (node, capacity, deadline, answer)
        self._waiting: deque[tuple[str, int, float, Pending]] = deque()
        self._trips: deque[float] = deque(maxlen=TRIPS_KEPT)
        #: tasks the nodes asked for per second (those they took and those the stock lacked)
        self._rate = 0.0
        self._rate_at, self._handed, self._wanted = time.monotonic(), 0, 0
        self._threads: list[threading.Thread] = []
        #: tasks asked for by the refill calls on their way
        self._asking = 0
        self._stopped = False
        #: tasks handed to nodes, node leases it could not serve, refill calls, tasks returned
        self.counts = {"handed": 0, "misses": 0, "refills": 0, "returned": 0}

    # -- the nodes' side -------------------------------------------------------------------
    def lease(self, node: str, capacity: int, wait: float, versions: dict[str, int] | None) -> Pending | None:
        """``node``'s lease of up to ``capacity`` tasks, answered from the stock: at once when
        it holds some or ``wait`` is 0 (the stock's refill is the worker's ask), else with the
        next refill (the stock's long poll stands for the node's). None once the stock has
        stopped (the node asks the data layer itself)."""
        answer = Pending()
        with self._cond:
            if versions is not None:
                self._node_versions[node] = versions
            self._asked_at[node] = time.monotonic()
            self._largest_ask = max(self._largest_ask, capacity)
            if self._stopped:
                return None
            if not self._threads:
                self._threads = [threading.Thread(target=self._run, name=f"lease-stock-{self.worker}", daemon=True)
                                 for _ in range(REFILLERS)]
                self._threads.append(threading.Thread(target=self._expire, name=f"lease-stock-{self.worker}-waits",
                                                      daemon=True))
                for thread in self._threads:
                    thread.start()
            out = self._hand(capacity)
            if len(out) < capacity:
                self._wanted += capacity - len(out)
            if not out:
                self.counts["misses"] += 1
                if wait > 0:
                    self._waiting.append((node, capacity, time.monotonic() + wait, answer))
                    self._cond.notify_all()
                    return answer
            self._cond.notify_all()  # below its size now: the sender refills
        answer.settle(Packed(out))
        return answer

    def saw(self, node: str, versions: dict[str, int] | None) -> None:
        """``node`` reported the weight versions it holds (its heartbeat)."""
        if versions is not None:
            with self._cond:
                self._node_versions[node] = versions

    def _hand(self, capacity: int) -> list[RolloutTask]:
        out = [self._tasks.popleft() for _ in range(min(capacity, len(self._tasks)))]
        self.counts["handed"] += len(out)
        self._handed += len(out)
        return out

    def _serve_waiting(self, refill_empty: bool) -> list[tuple[Pending, list[RolloutTask]]]:
        """Under the lock: the waiting nodes' answers, in the order they asked. With tasks in
        stock each gets its share; after a refill that found none (the data layer's long poll
        ran out) or past its own wait, a node gets none and asks again."""
        now, out, left = time.monotonic(), [], deque()
        for node, capacity, deadline, answer in self._waiting:
            got = self._hand(capacity)
            if got or refill_empty or deadline <= now or self._stopped:
                out.append((answer, got))
            else:
                left.append((node, capacity, deadline, answer))
        self._waiting = left
        return out

    def beat(self) -> dict[str, Any] | None:
        """The stock's own heartbeat (None before its first lease): it renews what it holds
        (a task a node took is renewed by that node's heartbeat, which moves it)."""
        with self._cond:
            if not self._threads:
                return None
            holding = [t.task_id for t in self._tasks]
            return {"stock": True, "worker": self.worker, "holding": holding,
                    "versions": self._oldest(), "stocked": len(self._tasks)}

    def answered(self, reply: dict[str, Any]) -> None:
        """The data layer's answer to ``beat``: a draining worker or a finished run returns
        the stock. While admission refuses new groups, a waiting node whose weights are behind
        the committed versions is answered now with nothing (as the data layer's own long poll
        would), so that it asks again with the weights it loads next."""
        if (reply.get("draining") or reply.get("finished")) and not self._stopped:
            threading.Thread(target=self.drain, name=f"lease-stock-{self.worker}-drain", daemon=True).start()
            return
        committed = reply.get("versions")
        if not reply.get("refused") or not committed:
            return
        with self._cond:
            behind, left = [], deque()
            for waiter in self._waiting:
                held = self._node_versions.get(waiter[0]) or {}
                lags = any(int(held.get(p, v)) < v for p, v in committed.items())
                (behind if lags else left).append(waiter)
            self._waiting = left
        settle_all((answer, Packed()) for *_, answer in behind)

    # -- the sender ------------------------------------------------------------------------
    def size(self) -> int:
        """How many tasks the stock holds when full: what the nodes take during ``COVER_TRIPS``
        refill round trips (the slowest remembered), at least one node's ask, at most ``most``."""
        trip = max(self._trips, default=0.05)
        return max(1, min(self.most, math.ceil(self._rate * COVER_TRIPS * trip) + self._largest_ask))

    def _oldest(self) -> dict[str, int] | None:
        """Per policy, the oldest version among the nodes that asked within ``RECENT_S`` (all
        of them when none did): the stock stands for them in admission by version."""
        recent = time.monotonic() - RECENT_S
        asking = [n for n, at in self._asked_at.items() if at >= recent] or list(self._node_versions)
        out: dict[str, int] = {}
        for node in asking:
            for p, v in self._node_versions.get(node, {}).items():
                out[p] = min(out.get(p, v), v)
        return out or None

    def _short(self) -> int:
        """Tasks to ask for now: what the stock lacks of its size, or what waiting nodes ask
        for, less what refills on their way ask for already."""
        return max(self.size() - len(self._tasks), sum(w[1] for w in self._waiting)) - self._asking

    def _update_rate(self) -> None:
        now = time.monotonic()
        dt = now - self._rate_at
        if dt >= 0.1:
            self._rate = 0.7 * self._rate + 0.3 * (self._handed + self._wanted) / dt
            self._rate_at, self._handed, self._wanted = now, 0, 0

    def _run(self) -> None:
        pause = 0.0
        while True:  # ends when stopped (``drain``)
            with self._cond:
                self._update_rate()
                while not self._stopped and self._short() <= 0:
                    self._cond.wait(0.5)
                    self._update_rate()
                if self._stopped:
                    break
                want = self._short()
                self._asking += want
            t0 = time.monotonic()
            try:
                # no versions: the stock's heartbeat reports them for admission, and a refill waits in
                # the long poll for tasks rather than returning at once for weights to load
                got = list(self.handle.lease_ahead(self.worker, want, self.wait_s).result(self.wait_s + 60))
            except Exception as err:  # the data layer is being re-placed, or gone
                log.warning("lease stock of %s: refill failed (%s); retrying in 1s", self.worker, err)
                with self._cond:  # the waiting nodes get nothing this time, and ask again
                    self._asking -= want
                    answers = self._serve_waiting(refill_empty=True)
                settle_all((answer, Packed(tasks)) for answer, tasks in answers)
                time.sleep(1.0)
                continue
            elapsed = time.monotonic() - t0
            with self._cond:
                self._asking -= want
                self.counts["refills"] += 1
                self._tasks.extend(got)
                answers = self._serve_waiting(refill_empty=not got)
                if got and elapsed < self.wait_s / 2:  # served at once: a round trip, not a long poll
                    self._trips.append(elapsed)
                stopped = self._stopped
            settle_all((answer, Packed(tasks)) for answer, tasks in answers)
            if stopped:  # drained meanwhile: what came back goes back
                break
            if got or (self.wait_s > 0 and elapsed >= self.wait_s / 2):  # tasks, or held for a long poll
                pause = 0.0
            else:  # refused at once (weights behind, a finished run): do not ask in a tight loop
                pause = min(max(pause * 2, 0.05), MAX_PAUSE_S)
                time.sleep(pause)
        self._give_back()

    def _expire(self) -> None:
        """Answer each waiting node with nothing once its own wait is over (a refill may take
        longer: the stock's long poll is the data layer's)."""
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                # the first to wait is the first due (the nodes of one worker wait alike)
                due = self._waiting[0][2] if self._waiting else now + 1.0
                if due > now:
                    self._cond.wait(min(due - now, 1.0))
                    continue
                answers = self._serve_waiting(refill_empty=False)
            settle_all((answer, Packed(tasks)) for answer, tasks in answers)

    # -- the end ---------------------------------------------------------------------------
    def drain(self, timeout: float = 30.0) -> int:
        """Stop refilling and return every stocked task. Returns how many went back."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            answers = self._serve_waiting(refill_empty=True)
        settle_all((answer, Packed(tasks)) for answer, tasks in answers)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(self.wait_s + 60)
        return self._give_back(timeout)

    def _give_back(self, timeout: float = 30.0) -> int:
        with self._cond:
            tasks, self._tasks = list(self._tasks), deque()
        if not tasks:
            return 0
        try:
            self.handle.return_leases(self.worker, [t.task_id for t in tasks]).result(timeout)
        except Exception as err:  # their leases expire instead
            log.warning("lease stock of %s: returning %d tasks failed (%s)", self.worker, len(tasks), err)
            return 0
        self.counts["returned"] += len(tasks)
        return len(tasks)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {**self.counts, "stocked": len(self._tasks), "size": self.size(), "rate": round(self._rate, 1)}
