"""What a placed actor's task runs on its worker: the actor's class, named by a string, imported
and constructed there.

A task that named the class itself would be unpickled by the Dask scheduler too (it loads every
graph it is given), and the scheduler would import the class's module for nothing: a trainer's
or a RaaS node's pulls in torch and transformers, seconds during which the scheduler's event loop
serves no one. A string crosses the scheduler as it is. This module imports nothing heavy, so the
scheduler and a worker that unpickle the task pay nothing for it.
"""

from __future__ import annotations

import importlib
from typing import Any


def class_path(cls: type) -> str:
    """``module:qualname`` of ``cls``, what `construct` takes."""
    return f"{cls.__module__}:{cls.__qualname__}"


def by_name(cls: type) -> bool:
    """Whether a worker can import ``cls`` by its `class_path`: the path leads back to the class
    itself (not one defined in a function, in the ``__main__`` of the placing process, or bound
    to another name, which Dask pickles by value)."""
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return False
    try:
        return _resolve(class_path(cls)) is cls
    except Exception:
        return False


def construct(path: str, /, **kwargs: Any) -> Any:
    """An instance of the class at ``path`` (``module:qualname``), built with ``kwargs``."""
    return _resolve(path)(**kwargs)


def _resolve(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
