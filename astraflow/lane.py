"""The direct lane: an actor's frequent calls over one plain connection per process, beside Dask.

A Dask actor call costs the actor's worker a fixed amount of CPU whatever it carries (message
framing, handler dispatch, metrics) and the caller more; with many RaaS nodes calling the data
layer, that floor, not the data layer's own work, bounds what it serves. So the data layer
also listens on its worker's host (``LaneServer``, started on the first ``lane_address`` ask, on
the worker's event loop, with the worker's TLS settings: exactly the peers that may call it
through Dask can connect), and a ``transport.Link`` sends the methods it names (the nodes'
frequent calls) down one connection per process (``LaneClient``), many calls in flight at once.
A call runs as Dask runs an async actor method: on the worker's event loop, concurrently with
the others (a parked long poll holds nothing up). Every other call, and every call when the lane
cannot be reached, goes through Dask as before.

Frames: ``[u32 length][u64 call id][pickle]``: a request's pickle is ``(method, args, kwargs)``,
an answer's ``(ok, value or exception)``; a pickle that cannot be read fails its own call only.
Pickles are trusted as Dask's are: with TLS (the default) only holders of the run's certificate
get a connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import pickle
import struct
import threading
from typing import Any

from distributed.comm.core import CommClosedError

from astraflow.pending import Pending

log = logging.getLogger("astraflow.lane")

HEADER = struct.Struct("<IQ")  # the length of what follows the length, the call id
#: the most bytes one frame may hold (a corrupt length must not allocate gigabytes)
MAX_FRAME = 1 << 30
#: seconds a client waits for its connection (then the caller goes through Dask)
CONNECT_S = 10.0


class LaneClosed(CommClosedError):
    """The lane's connection closed with the call unanswered: the caller makes it again
    through Dask, which tells whether the actor itself is gone."""


def _frame(call_id: int, value: Any) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data) + 8, call_id) + data


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next frame's call id and pickle (not yet read: a bad one fails only its call)."""
    size, call_id = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"a lane frame of {size} bytes is more than {MAX_FRAME}")
    return call_id, await reader.readexactly(size - 8)


def _portable(err: Exception) -> Exception:
    """``err`` if it survives a pickle round trip (what the caller will do), else a
    ``RuntimeError`` that names it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


class LaneServer:
    """Serves ``methods`` (async methods of ``target``) to lane clients (module docstring)."""

    def __init__(self, target: Any, methods: frozenset[str]):
        self.target, self.methods = target, methods
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        #: the context of the actor call that started the lane (Dask's worker context var), set by
        #: ``start``: each call runs in a copy, as it would under Dask
        self._context: contextvars.Context | None = None
        self.calls = 0

    async def start(self, host: str, ssl_context: Any = None) -> str:
        """Listen on ``host`` (a free port); the address clients connect to."""
        self._context = contextvars.copy_context()
        self._server = await asyncio.start_server(self._serve, host, 0, ssl=ssl_context)
        port = self._server.sockets[0].getsockname()[1]
        return f"{'tls' if ssl_context is not None else 'tcp'}://{f'[{host}]' if ':' in host else host}:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        self._writers.add(writer)
        try:
            while True:
                try:
                    call_id, data = await _read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError, OSError):
                    return
                # a call that is still running when its caller leaves finishes all the same, as
                # under Dask (a lease it makes expires; a completion it records stays recorded)
                loop.create_task(self._run(writer, call_id, data), context=self._context.copy())
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _run(self, writer: asyncio.StreamWriter, call_id: int, data: bytes) -> None:
        self.calls += 1
        name = "?"
        try:
            name, args, kwargs = pickle.loads(data)
            if name not in self.methods:
                raise AttributeError(f"{name!r} is not served by the direct lane")
            answer = (True, await getattr(self.target, name)(*args, **kwargs))
        except Exception as err:  # the caller raises it, as it would an actor's error
            answer = (False, _portable(err))
        try:
            data = _frame(call_id, answer)
        except Exception as err:
            data = _frame(call_id, (False, RuntimeError(f"{name}: its answer cannot be sent ({err!r})")))
        if writer.is_closing():
            return
        writer.write(data)
        try:
            await writer.drain()
        except (ConnectionError, OSError):
            pass

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()
        self._server = None


class LaneClient:
    """One connection to a ``LaneServer``, shared by every caller of a process (thread-safe):
    ``submit`` returns a ``Pending`` (``result(timeout)``, ``wait_async``, ``done``). Its reads
    and writes run on an event loop of its own, in a daemon thread."""

    def __init__(self, address: str, ssl_context: Any = None, connect_s: float = CONNECT_S):
        self.address = address
        scheme, _, hostport = address.partition("://")
        host, _, port = hostport.rpartition(":")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, Pending] = {}
        #: frames submitted and not yet handed to the connection, and whether a flush is on its way
        self._outbox: list[bytes] = []
        self._flushing = False
        self.closed = False
        self._loop = asyncio.new_event_loop()
        self._writer: asyncio.StreamWriter | None = None
        threading.Thread(target=_run_loop, args=(self._loop,), name="astraflow-lane", daemon=True).start()
        try:
            self._reader, self._writer = asyncio.run_coroutine_threadsafe(
                asyncio.open_connection(host.strip("[]"), int(port), ssl=ssl_context if scheme == "tls" else None),
                self._loop).result(connect_s)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        asyncio.run_coroutine_threadsafe(self._read(), self._loop)

    def submit(self, name: str, args: tuple, kwargs: dict) -> Pending:
        call_id = next(self._ids)
        data = _frame(call_id, (name, args, kwargs))
        answer = Pending()
        with self._lock:
            if self.closed:
                raise LaneClosed(f"the direct lane to {self.address} is closed")
            self._waiting[call_id] = answer
            self._outbox.append(data)
            wake, self._flushing = not self._flushing, True
        if wake:  # calls submitted meanwhile ride along: one wake-up of the loop, one write
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the connection closed as this call came: it fails as the others
                answer.settle(None, LaneClosed(f"the direct lane to {self.address} is closed"))
        return answer

    def _flush(self) -> None:
        with self._lock:
            frames, self._outbox, self._flushing = self._outbox, [], False
        if not self._writer.is_closing():
            self._writer.write(b"".join(frames))

    async def _read(self) -> None:
        try:
            while True:
                call_id, data = await _read_frame(self._reader)
                with self._lock:
                    answer = self._waiting.pop(call_id, None)
                try:
                    ok, value = pickle.loads(data)
                except Exception as err:
                    ok, value = False, RuntimeError(f"the answer cannot be read here ({type(err).__name__}: {err})")
                if answer is not None:
                    answer.settle(value if ok else None, None if ok else value)
        except (Exception, asyncio.CancelledError) as err:  # closed by either side, or an unreadable frame
            self._close(err)
            self._loop.stop()

    def _close(self, why: BaseException) -> None:
        with self._lock:
            self.closed = True
            waiting, self._waiting = self._waiting, {}
        if waiting:
            log.info("the direct lane to %s closed with %d calls unanswered (%s): they go through Dask",
                     self.address, len(waiting), type(why).__name__)
        for answer in waiting.values():
            answer.settle(None, LaneClosed(f"the direct lane to {self.address} closed ({type(why).__name__})"))
        if self._writer is not None:
            self._writer.close()  # its reader ends, and with it this client's loop

    def close(self) -> None:
        """Close the connection; calls in flight fail with ``LaneClosed``."""
        if not self.closed:
            self._loop.call_soon_threadsafe(self._close, ConnectionAbortedError("closed by the caller"))


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


_clients: dict[str, LaneClient] = {}
_clients_lock = threading.Lock()


def client(address: str, ssl_context: Any = None) -> LaneClient:
    """This process's open connection to ``address`` (made on first use, or again once closed)."""
    with _clients_lock:
        found = _clients.get(address)
        if found is None or found.closed:
            found = _clients[address] = LaneClient(address, ssl_context)
        return found


def listen_args() -> tuple[str, Any] | None:
    """From inside an actor method: the host of the actor's worker and the TLS context its
    listeners use; None when not on a Dask worker (a data layer made in-process)."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:
        return None
    hostport = worker.address.partition("://")[2]
    host = hostport.rpartition(":")[0].strip("[]")
    return host, worker.security.get_listen_args("worker").get("ssl_context")


def connect_args(worker: Any) -> Any:
    """The TLS context a caller presents: on a worker (``worker`` bound) the worker's own
    certificate, as it presents to other workers (``dask worker --tls-cert`` gives a worker no
    client certificate, and the lane's server requires one), else its client's; None without TLS."""
    security = getattr(worker, "security", None)
    role = "worker"
    if security is None:
        try:
            from distributed import get_client
            security, role = get_client().security, "client"
        except ValueError:
            return None
    return security.get_connection_args(role).get("ssl_context")


class LaneServed:
    """Mixin for an actor whose async methods ``LANE_METHODS`` may be called on the direct
    lane: ``lane_address`` starts its ``LaneServer`` on the first ask (on the worker's event
    loop) and answers ``(address, methods)``, or None when ``lane_enabled()`` is false or the
    actor is not on a Dask worker. ``close_lane`` stops it."""

    LANE_METHODS: frozenset[str] = frozenset()
    _lane_start: asyncio.Future | None = None
    _lane_server: LaneServer | None = None

    def lane_enabled(self) -> bool:
        return True

    async def lane_address(self) -> tuple[str, list[str]] | None:
        if self._lane_start is None:  # callers asking at once share one start
            self._lane_start = asyncio.ensure_future(self._start_lane())
        return await asyncio.shield(self._lane_start)

    async def _start_lane(self) -> tuple[str, list[str]] | None:
        where = listen_args() if self.lane_enabled() else None
        if where is None:
            return None
        self._lane_server = LaneServer(self, self.LANE_METHODS)
        address = await self._lane_server.start(*where)
        log.info("direct lane of %s at %s", type(self).__name__, address)
        return address, sorted(self.LANE_METHODS)

    async def close_lane(self) -> None:
        """Stop the lane; later asks answer None (its callers go through Dask)."""
        closed = asyncio.get_running_loop().create_future()
        closed.set_result(None)
        self._lane_start = closed
        if self._lane_server is not None:
            await self._lane_server.close()
            self._lane_server = None
