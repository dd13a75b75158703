"""Small helpers for code that runs inside Dask actors.

Component loops run in their own thread (with their own asyncio loop) inside a worker, and
call other actors through handles. A handle deserialised into an actor is not bound to the
worker when the call comes from such a thread (``get_worker()`` only works on Dask's own
threads), so ``bind`` binds it once from the actor's method, and ``call`` turns a handle call
into an awaitable with a deadline. Both send plain ``list`` arguments as one ``Packed``
object (see there: Dask would send each element as its own frame).
"""

from __future__ import annotations

import asyncio
from typing import Any

from distributed import get_worker

from astraflow.contracts import Packed


def bind(handle: Any) -> Any:
    """Bind an actor handle to the current worker (call from an actor method)."""
    if handle is not None and getattr(handle, "_worker", None) is None:
        handle._worker = get_worker()
    return handle


async def call(method: Any, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
    """``await call(handle.method, ...)`` from a component thread's event loop; raises
    ``TimeoutError`` after ``timeout`` seconds."""
    fut = method(*map(_pack, args), **{k: _pack(v) for k, v in kwargs.items()})
    return await asyncio.to_thread(fut.result, timeout)


def call_sync(method: Any, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
    """Blocking form of ``call`` for plain threads."""
    return method(*map(_pack, args), **{k: _pack(v) for k, v in kwargs.items()}).result(timeout)


def _pack(value: Any) -> Any:
    return Packed(value) if type(value) is list else value
