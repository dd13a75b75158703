"""The direct lane (``astraflow/lane.py``): a ``Link`` sends the methods an actor serves on its
lane down one connection, the rest through Dask; answers, the actor's errors and long calls
behave as under Dask; a lane that closes or is off leaves the calls to Dask; with TLS only the
run's certificate gets a connection. Real Dask clusters with worker processes."""

from __future__ import annotations

import asyncio
import os
import ssl
import threading

import pytest
from distributed import Client, LocalCluster, Security

from astraflow.lane import LaneClient, LaneClosed, LaneServed
from astraflow.runtime.security import create_run_certificates
from astraflow.transport import Link, call


class _Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


class _FailsOnLoad:
    """Pickles fine; unpickling it raises (it is rebuilt as ``int("no")``)."""

    def __reduce__(self):
        return int, ("no",)


class _Served(LaneServed):
    LANE_METHODS = frozenset({"echo", "slow", "fail", "odd_fail", "odd_answer", "pid"})

    def __init__(self, lane: bool = True):
        self.lane = lane
        self.release = asyncio.Event()

    def lane_enabled(self) -> bool:
        return self.lane

    async def echo(self, value):
        return value

    async def slow(self):
        await self.release.wait()
        return "released"

    async def let_go(self) -> None:
        self.release.set()

    async def fail(self):
        raise ValueError("the actor's own error")

    async def odd_fail(self):
        raise _Unpicklable(1, 2)

    async def odd_answer(self):
        return _FailsOnLoad()

    async def pid(self) -> int:
        return os.getpid()

    async def plain(self) -> int:
        return os.getpid()

    async def served(self) -> int:
        return 0 if self._lane_server is None else self._lane_server.calls

    async def stop_lane(self) -> None:
        await self.close_lane()


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, processes=True, threads_per_worker=1, dashboard_address=None,
                      host="127.0.0.1") as cluster, Client(cluster) as c:
        yield c


def test_lane_methods_go_down_the_lane_and_the_rest_through_dask(client):
    actor = client.submit(_Served, actor=True, pure=False).result()
    link = Link(actor, "the served actor")
    assert link.lane_open(timeout=30)
    assert link.echo({"a": [1, 2]}).result(timeout=30) == {"a": [1, 2]}
    worker_pid = link.pid().result(timeout=30)
    assert worker_pid != os.getpid()
    assert actor.served().result() == 2  # both answered on the lane
    assert link.plain().result(timeout=30) == worker_pid
    assert actor.served().result() == 2  # not a lane method: through Dask
    assert asyncio.run(call(link.echo, 9)) == 9  # on an event loop: awaited there
    assert asyncio.run(call(link.plain)) == worker_pid
    assert actor.served().result() == 3
    address, methods = actor.lane_address().result()
    assert address.startswith("tcp://127.0.0.1:") and set(methods) == _Served.LANE_METHODS


def test_a_long_call_holds_up_no_other_and_errors_arrive_as_the_actors(client):
    actor = client.submit(_Served, actor=True, pure=False).result()
    link = Link(actor, "the served actor")
    assert link.lane_open(timeout=30)
    parked = link.slow()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(parked.result(timeout=60)))
    waiter.start()
    assert link.echo(7).result(timeout=30) == 7  # answered while the first call is parked
    assert not got
    with pytest.raises(ValueError, match="the actor's own error"):
        link.fail().result(timeout=30)
    with pytest.raises(RuntimeError, match="_Unpicklable: 1 and 2"):  # an error that cannot cross as itself
        link.odd_fail().result(timeout=30)
    actor.let_go().result()
    waiter.join(30)
    assert got == ["released"]


def test_calls_go_through_dask_when_the_lane_closes_or_is_off(client):
    actor = client.submit(_Served, actor=True, pure=False).result()
    link = Link(actor, "the served actor")
    assert link.lane_open(timeout=30)
    assert link.echo(1).result(timeout=30) == 1
    actor.stop_lane().result()
    assert link.echo(2).result(timeout=30) == 2  # the closed lane: made again through Dask
    assert link.echo(3).result(timeout=30) == 3
    assert actor.lane_address().result() is None
    assert not link.lane_open(timeout=1)

    off = client.submit(_Served, False, actor=True, pure=False).result()
    off_link = Link(off, "the actor without a lane")
    assert not off_link.lane_open(timeout=5)
    assert off_link.echo(4).result(timeout=30) == 4
    assert off.lane_address().result() is None and off.served().result() == 0


def test_an_actor_made_in_process_has_no_lane():
    assert asyncio.run(_Served().lane_address()) is None


def test_a_lane_client_fails_its_calls_when_the_connection_closes(client):
    actor = client.submit(_Served, actor=True, pure=False).result()
    address, _ = actor.lane_address().result()
    lane = LaneClient(address)
    parked = lane.submit("slow", (), {})
    assert lane.submit("echo", (5,), {}).result(30) == 5
    with pytest.raises(ValueError, match="invalid literal"):  # a request the actor cannot read: its own error
        lane.submit("echo", (_FailsOnLoad(),), {}).result(30)
    with pytest.raises(RuntimeError, match="cannot be read here"):  # an answer this side cannot read
        lane.submit("odd_answer", (), {}).result(30)
    assert lane.submit("echo", (8,), {}).result(30) == 8 and not lane.closed  # the connection serves on
    lane.close()
    with pytest.raises(LaneClosed):
        parked.result(30)
    with pytest.raises(LaneClosed):
        lane.submit("echo", (6,), {})
    actor.let_go().result()


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A cluster whose every connection needs the run's certificate, and the certificate files."""
    files = create_run_certificates(tmp_path_factory.mktemp("security"))
    pair = {"ca": str(files.ca_file), "cert": str(files.cert_file), "key": str(files.key_file)}
    security = Security(require_encryption=True, tls_ca_file=pair["ca"], tls_client_cert=pair["cert"],
                        tls_client_key=pair["key"], tls_worker_cert=pair["cert"], tls_worker_key=pair["key"],
                        tls_scheduler_cert=pair["cert"], tls_scheduler_key=pair["key"])
    with LocalCluster(n_workers=1, processes=True, threads_per_worker=1, dashboard_address=":0", protocol="tls",
                      host="127.0.0.1", security=security) as cluster, Client(cluster, security=security) as c:
        yield c, files


def test_with_tls_only_the_runs_certificate_gets_a_connection(tls, tmp_path):
    client, _ = tls
    actor = client.submit(_Served, actor=True, pure=False).result()
    link = Link(actor, "the served actor")
    assert link.lane_open(timeout=30)
    assert link.echo("over tls").result(timeout=30) == "over tls"
    assert actor.served().result() == 1
    address, _ = actor.lane_address().result()
    assert address.startswith("tls://")
    with pytest.raises(Exception):  # no certificate: the handshake is refused
        LaneClient(address.replace("tls://", "tcp://")).submit("echo", (1,), {}).result(10)
    other = create_run_certificates(tmp_path / "other")  # a certificate of another authority
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(other.ca_file))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(other.cert_file), str(other.key_file))
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        LaneClient(address, ctx).submit("echo", (1,), {}).result(10)
    assert actor.served().result() == 1


def test_a_worker_presents_its_own_certificate_on_the_lane(tmp_path):
    """A RaaS node calls the data layer's lane from a worker started as ``dask worker --tls-cert``
    starts it: with a worker certificate and no client certificate. The lane takes it (a lane
    the handshake refuses would close under every call, leaving them all to Dask)."""
    import types

    from distributed import Security

    from astraflow.lane import LaneServer, connect_args

    files = create_run_certificates(tmp_path / "security")
    security = Security(require_encryption=True, tls_ca_file=str(files.ca_file), tls_worker_cert=str(files.cert_file),
                        tls_worker_key=str(files.key_file))
    assert security.tls_client_cert is None  # as the worker's command line sets it
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = LaneServer(_Served(), frozenset({"echo"}))
    client = None
    try:
        listen = security.get_listen_args("worker")["ssl_context"]
        address = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", listen), loop).result(10)
        client = LaneClient(address, connect_args(types.SimpleNamespace(security=security)))
        assert client.submit("echo", ("from a worker",), {}).result(10) == "from a worker"
        assert server.calls == 1 and not client.closed
    finally:
        if client is not None:
            client.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
