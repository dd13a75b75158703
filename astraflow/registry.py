"""Name -> class or function registries for everything a config selects by name.

Workloads, workflows, dataflow rules, the dataset workload's rewards and the trainer's advantage
estimators and losses register themselves with a decorator; a config names them. An unknown name
raises ``ValueError`` listing the known ones, so a typo in a config fails at load time with the fix
in the message.
"""

from __future__ import annotations

import difflib
import importlib
import os
from pathlib import Path
from typing import Callable, Generic, TypeVar

from storage.ownership import USER_DIR_ENV, add_user_dir, user_dir_fix

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, check: Callable[[object], str | None] | None = None):
        """``check(obj)``: why a user's ``module:name`` cannot be one of these (None: it can)."""
        self.kind = kind
        self.check = check
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def resolve(self, name: str) -> T:
        """``get``, where ``"package.module:name"`` first imports the user's module (which
        registers its classes), so a new one needs no change in AstraFlow. A module that cannot
        be imported, or that calls ``sys.exit`` as it is imported, is a ``ValueError`` naming the
        fix. ``name`` is an attribute of the module (registered or not; it wins over a built-in of
        the same name), or a name it registered."""
        if ":" in name:
            module, name = name.split(":", 1)
            add_user_dir()  # the working directory of `astraflow`, last on the path (if only its user can change it)
            try:
                mod = importlib.import_module(module)
            except ImportError as err:
                raise ValueError(f"{self.kind} {module}:{name}: {_import_failure(module, err)}") from None
            except Exception as err:  # a user's module that fails as it runs: name it, no traceback
                raise ValueError(f"{self.kind} {module}:{name}: importing {module!r} raised "
                                 f"{type(err).__name__}: {err}") from None
            except SystemExit as err:  # a script's sys.exit() would end `astraflow check` silently, with its code
                raise ValueError(f"{self.kind} {module}:{name}: importing {module!r} called sys.exit({err.code!r}): "
                                 "guard it with if __name__ == '__main__'") from None
            if hasattr(mod, name):  # the module's own, registered or not, before a built-in of that name
                obj = getattr(mod, name)
                why = self.check(obj) if self.check is not None else None
                if why:
                    raise ValueError(f"{self.kind} {module}:{name} {why}")
                return obj
            if name not in self._items:
                # the module's names that could be one of these (a rule of another stage is not a hint)
                own = [a for a, obj in vars(mod).items() if not a.startswith("_")
                       and (self.check is None or self.check(obj) is None)]
                close = difflib.get_close_matches(name, own + list(self._items), n=1)
                hint = f"did you mean {module}:{close[0]}? " if close else ""
                raise ValueError(f"{self.kind} {module}:{name}: {module!r} has no {name!r} and registered no "
                                 f"{self.kind} of that name; {_shadowed(mod)}{hint}known: "
                                 f"{', '.join(sorted(self._items)) or '(none)'}")
            why = self.check(self._items[name]) if self.check is not None else None
            if why:  # what the user's module registered, checked as its attribute would be
                raise ValueError(f"{self.kind} {module}:{name} {why}")
        return self.get(name)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items)) or '(none)'}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


def _shadowed(mod: object) -> str:
    """A note when the working directory holds a module of ``mod``'s name that the import did not
    find: the directory comes last on the path, so an installed module of that name wins."""
    user_dir, top = os.environ.get(USER_DIR_ENV), getattr(mod, "__name__", "").split(".")[0]
    if not user_dir or not top:
        return ""
    mine = [p for p in (Path(user_dir) / f"{top}.py", Path(user_dir) / top) if p.exists()]
    found = getattr(mod, "__file__", None) or "a module outside it"
    if not mine or Path(found).resolve().is_relative_to(mine[0].resolve()):
        return ""
    return (f"{mod.__name__!r} is {found}, not your {mine[0]}: an installed module of that name comes before "
            "the working directory, which is searched last; rename yours. ")


def _import_failure(module: str, err: ImportError) -> str:
    """Why ``module`` could not be imported, and the fix: not found where Python looks, or found
    but itself importing something that fails (installing or fixing that is the fix, not moving it)."""
    missing = getattr(err, "name", None)
    not_found = isinstance(err, ModuleNotFoundError) and (module == missing or module.startswith(f"{missing}."))
    if not missing or not_found:
        return f"cannot import {module!r} ({err}); {user_dir_fix()}"
    if isinstance(err, ModuleNotFoundError):
        worker = os.environ.get("ASTRAFLOW_WORKER_NAME")  # the orchestrator's environment may have it
        where = (f"the Python environment worker {worker}'s jobs start in" if worker
                 else "this Python environment")
        return (f"{module!r} was found, but it imports {missing!r}, which is not installed ({err}); install it "
                f"in {where} or fix that import in {module!r}")
    return f"{module!r} was found, but an import in it fails ({err}); fix that import in {module!r}"
