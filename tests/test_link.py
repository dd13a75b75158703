"""A ``Link`` (``astraflow.transport``): a call through it that finds the actor's worker killed
waits for the re-placed actor and is made again there; without one it raises the loss; an error
the actor itself raises is not retried. A real Dask cluster with worker processes."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from distributed import Client, LocalCluster

from astraflow.transport import Link, actor_lost


class _Echo:
    def __init__(self):
        self.calls = 0

    def pid(self) -> int:
        self.calls += 1
        return os.getpid()

    def fail(self) -> None:
        raise ValueError("the actor's own error")


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                      host="127.0.0.1") as cluster, Client(cluster) as c:
        yield c


def _actor(client, index: int):
    client.wait_for_workers(2, timeout=60)  # a killed worker is restarted by its nanny
    workers = sorted(client.scheduler_info()["workers"])
    return client.submit(_Echo, actor=True, workers=[workers[index]], pure=False).result()


def test_a_call_waits_for_the_re_placed_actor_and_is_made_again(client):
    old = _actor(client, 0)
    link = Link(old, "the echo", reconnect_s=60)
    os.kill(old.pid().result(), signal.SIGKILL)  # a worker of the cluster this test started
    new = _actor(client, 1)
    threading.Timer(1.0, link.set, args=(new,)).start()
    assert link.pid().result(timeout=30) == new.pid().result()


def test_without_a_new_actor_the_loss_is_raised(client):
    old = _actor(client, 1)
    link = Link(old, "the echo", reconnect_s=1)
    os.kill(old.pid().result(), signal.SIGKILL)
    with pytest.raises(Exception) as err:
        # longer than Dask's connect timeout (30 s): a call routed to the dead worker's address
        # may wait that long before Dask reports the loss, and the deadline must not come first
        link.pid().result(timeout=90)
    assert actor_lost(err.value), err.value


def test_the_actors_own_error_is_not_retried(client):
    link = Link(_actor(client, 0), "the echo", reconnect_s=60)
    with pytest.raises(ValueError, match="the actor's own error"):
        link.fail().result(timeout=30)
    assert not actor_lost(ValueError("the actor's own error")) and not actor_lost(TimeoutError("slow"))


class _Slow:
    def timeout_after(self, seconds: float) -> None:
        import time

        time.sleep(seconds)
        raise TimeoutError("the actor's own deadline")


class _Watched:
    """An actor call's future that counts the waits on it once it had settled (its answer there)."""

    def __init__(self, future):
        self.future, self.settled_waits = future, 0

    def result(self, timeout):
        self.settled_waits += self.future.done()
        return self.future.result(timeout)

    def done(self):
        return self.future.done()


def test_a_timeout_the_actor_raises_is_its_answer_not_a_slice_to_wait_out(client):
    """The actor's own TimeoutError ends a slice of the wait like the slice's own deadline would:
    it is taken as the answer at once (the settled future is awaited once more, for its answer,
    perhaps once before as the slice began), not waited on slice after slice until the call's
    deadline."""
    workers = sorted(client.scheduler_info()["workers"])
    link = Link(client.submit(_Slow, actor=True, workers=[workers[0]], pure=False).result(), "the slow one")
    sent: list[_Watched] = []
    send = link.send
    link.send = lambda *args: sent.append(_Watched(send(*args))) or sent[-1]
    with pytest.raises(TimeoutError, match="the actor's own deadline"):
        link.timeout_after(1.5).result(timeout=30)
    assert len(sent) == 1 and 1 <= sent[0].settled_waits <= 2, sent[0].settled_waits
