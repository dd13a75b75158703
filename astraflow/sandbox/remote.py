"""The tests' proxies of the program's objects in isolated tests (``judge.py``): each operation
a request to the program's process, whose answer crosses only as a plain value; comparison and
truth never ask the program. Standard library only; inside the sandbox the host puts this
source before ``judge.py``'s (never imported there)."""

#: most items one request takes from a program iterator (fewer at first: it may be endless)
MAX_CHUNK = 1024
#: iterators and views of the tests' that cross to the program as the list of their items
AS_LIST = (range, map, zip, filter, enumerate, reversed, type({}.keys()), type({}.values()), type({}.items()),
           type(iter([])), type(iter(())), type(iter("")), type(iter(range(0))), type(x for x in ()))


class Remote:
    """A program object that stays in the program's process (module docstring)."""

    __slots__ = ("_ref", "_ask")

    def __init__(self, ref: int, ask):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_ask", ask)

    def __call__(self, *args, **kwargs):
        args = tuple(list(a) if type(a) in AS_LIST else a for a in args)
        sent = {k: list(a) if type(a) in AS_LIST else a for k, a in kwargs.items()}
        result, changed, changed_kw = self._ask("call", self._ref, (args, sent))
        _update(args, changed)
        _update(kwargs, changed_kw)
        return result

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", self._ref, name)

    def __setattr__(self, name: str, value) -> None:
        self._ask("setattr", self._ref, (name, value))

    def __getitem__(self, key):
        return self._ask("getitem", self._ref, key)

    def __setitem__(self, key, value) -> None:
        self._ask("setitem", self._ref, (key, value))

    def __delitem__(self, key) -> None:
        self._ask("delitem", self._ref, key)

    def __len__(self) -> int:
        return _typed(self._ask("len", self._ref, None), int, "len()")

    def __iter__(self):
        it = self._ask("iter", self._ref, None)
        return _items(it) if type(it) is Remote else iter(it)

    def __next__(self):
        return next(_items(self))

    def __contains__(self, item) -> bool:  # compared here, not by the program
        return any(item is x or item == x for x in self)

    def __str__(self) -> str:
        return _typed(self._ask("str", self._ref, None), str, "str()")

    def __repr__(self) -> str:
        return _typed(self._ask("repr", self._ref, None), str, "repr()")

    def __int__(self) -> int:
        return _typed(self._ask("int", self._ref, None), int, "int()")

    def __index__(self) -> int:
        return self.__int__()

    def __float__(self) -> float:
        return _typed(self._ask("float", self._ref, None), float, "float()")

    def __await__(self):
        return self._ask("await", self._ref, None)
        yield  # a generator: ``await`` takes the value above as its result

    def __eq__(self, other) -> bool:  # never the program's own comparison (``!=`` inverts this)
        return other is self

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise TypeError("a program object that is not a plain value has no truth value in isolated tests "
                        "(sandbox.isolate_tests): compare a plain value it returns instead")


class Items:
    """The tests' iterator over a program iterator (one per iterator, ``_items``): items taken in
    growing chunks (one request each), so an endless generator is read only a little past where
    the tests go, and what was taken is handed out in order, whichever way the tests ask."""

    def __init__(self, it: Remote):
        self.it, self.buffer, self.chunk, self.done = it, [], 1, False

    def __iter__(self):
        return self

    def __next__(self):
        if not self.buffer and not self.done:
            it = self.it
            taken, ended = _typed(it._ask("take", it._ref, self.chunk), tuple, "next()")
            self.buffer = list(reversed(_typed(taken, list, "next()")))
            self.done = ended is True
            self.chunk = min(2 * self.chunk, MAX_CHUNK)
        if not self.buffer:
            raise StopIteration
        return self.buffer.pop()


#: the tests' iterator of each program iterator they hold
_ITEMS: dict = {}


def unread(it: Remote) -> bool:
    """Whether the tests hold items of ``it`` they took ahead and have not used."""
    found = _ITEMS.get(id(it))
    return found is not None and found.it is it and bool(found.buffer)


def _items(it: Remote) -> Items:
    found = _ITEMS.get(id(it))
    if found is None or found.it is not it:
        found = _ITEMS[id(it)] = Items(it)
    return found


def _update(given, changed) -> None:
    """The tests' lists, dicts and sets given to a call (``given``: its arguments by position or
    keyword), filled with what the call left in them (``changed``: (position or keyword, value))."""
    for key, new in changed if type(changed) is list else []:
        try:
            old = given[key]
        except (IndexError, KeyError, TypeError):
            continue
        for kind in (list, dict, set):
            if isinstance(old, kind) and type(new) is kind:
                if kind is list:
                    old[:] = new
                else:
                    old.clear()
                    old.update(new)


def _typed(value, kind: type, what: str):
    if type(value) is not kind:
        raise TypeError(f"{what} of a program object gave {type(value).__name__}, not {kind.__name__}")
    return value
