"""Isolated tests (``sandbox.isolate_tests``), inside the sandbox: the runner (``runner.py``)
loads this file (after ``wire.py``) from its input directory and calls ``run_isolated``;
standard library only, never imported by the host but in tests.

The runner's process becomes the *judge*: it forks the *program's process*, which runs the
program and then answers the judge's requests. Only the judge holds the result channel and
reads the tests (from its standard input, after the fork: they never exist in the program's
process); it runs them with proxies of what the program defined (never under a builtin's name,
nor a dunder). Only plain values travel between the two (``wire.py``); anything else the program
returns stays in its process and reaches the tests as a ``Remote``: it can be called, indexed,
iterated, measured and printed, each by a request, but comparing it or testing its truth never
asks the program. A list, dict or set the tests pass to a call is updated in place with what
the call left in it. An exception crosses as its nearest builtin class, or as a class of the
tests' own standing for one the program defined at top level (``except TheirError`` works),
with its arguments where they are plain; ``StopIteration`` and its kin cross as
``RuntimeError``, so a program cannot end the tests' iterations early. So a program can make
its functions return what it likes, but not what the tests compare it with, nor the builtins,
assertions or report of the tests.
"""

import builtins
import os
import sys

try:  # on the host (tests, linters) the wire is a module; in the sandbox its source comes first in this file
    from astraflow.sandbox.wire import ProgramGone, dumps, no_handles, read_frame, write_frame
except ImportError:
    pass

#: names the tests never take from the program: a program global called ``len`` must not shadow theirs
RESERVED = frozenset(dir(builtins))
#: what must not end the tests' own iterations when the program raises it
ENDS_ITERATION = ("StopIteration", "StopAsyncIteration", "GeneratorExit")
#: most items one request takes from a program iterator (fewer at first: it may be endless)
MAX_CHUNK = 1024


def offered(name) -> bool:
    """Whether a program global of this name reaches the tests."""
    return type(name) is str and not name.startswith("__") and name not in RESERVED


# -- the program's process ------------------------------------------------------------------

def serve(requests: int, answers: int, run_program, namespace: dict, describe) -> None:
    """Run the program (``run_program(report_memory)`` -> (ok, exit code), in ``namespace``),
    report it and what it defined, then answer requests until the judge closes the pipe.
    Never returns."""
    handles = {}

    def handle(x) -> int:
        handles[id(x)] = x
        return id(x)

    ok, code = run_program(lambda: write_frame(answers, ("memory",), no_handles))
    _flush()  # what the program printed: this process ends by a kill
    if not ok:
        write_frame(answers, ("program", False, code), no_handles)
        os._exit(code)
    names, errors, modules = {}, {}, {}
    for name, value in list(namespace.items()):
        if offered(name) and type(value) is type(sys):  # the tests import it themselves
            modules[name] = getattr(value, "__name__", None)
        elif offered(name):
            try:
                if isinstance(value, type) and issubclass(value, BaseException):
                    errors[value] = name, _builtin_base(value).__name__
                dumps(value, handle)
                names[name] = value
            except BaseException:  # an object the program made unreadable: not offered to the tests
                pass
    write_frame(answers, ("program", True, names, dict(errors.values()), modules), handle)
    while True:
        try:
            kind, obj, arg = read_frame(requests, handles.__getitem__)
        except ProgramGone:
            os._exit(0)
        try:
            result = _ANSWERS[kind](obj, arg)
            if kind == "call":  # what the call left in the containers it was given
                result = (result, [a for a in arg[0] if type(a) in (list, dict, set)],
                          {k: a for k, a in arg[1].items() if type(a) in (list, dict, set)})
            answer = dumps(("ok", result), handle)
        except BaseException as err:  # what the program raised, or a result that cannot travel
            answer = dumps(_raised(err, errors, describe), no_handles)
        _flush()
        os.write(answers, len(answer).to_bytes(4, "big"))
        while answer:
            answer = answer[os.write(answers, answer):]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:  # the program replaced or closed it
            pass


#: what the program's process does for each kind of request: (object, argument) -> result
_ANSWERS = {
    "call": lambda obj, a: obj(*a[0], **a[1]),
    "getattr": getattr,
    "setattr": lambda obj, a: setattr(obj, a[0], a[1]),
    "getitem": lambda obj, a: obj[a],
    "setitem": lambda obj, a: obj.__setitem__(a[0], a[1]),
    "delitem": lambda obj, a: obj.__delitem__(a),
    "len": lambda obj, _: len(obj),
    "iter": lambda obj, _: iter(obj),
    "take": lambda obj, n: _take(obj, n),
    "str": lambda obj, _: str(obj),
    "repr": lambda obj, _: repr(obj),
    "int": lambda obj, _: int(obj),
    "float": lambda obj, _: float(obj),
    "await": lambda obj, _: __import__("asyncio").run(obj),
}


def _take(it, n: int) -> list:
    """Up to ``n`` items of the iterator ``it`` (fewer: it ended)."""
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def _builtin_base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__module__ == "builtins" and issubclass(c, BaseException))


def _raised(err: BaseException, errors: dict, describe) -> tuple:
    """``("raise", class name, top-level, args, line)``: the program's top-level exception class
    ``err`` is of (top-level True), else its nearest builtin class; its arguments where plain;
    its line as the runner describes it."""
    try:
        mine = next((errors[c][0] for c in type(err).__mro__ if c in errors), None)
        try:
            args = tuple(err.args)
            dumps(args, no_handles)
        except BaseException:
            args = None
        return ("raise", mine or _builtin_base(type(err)).__name__, mine is not None, args,
                str.__str__(describe(err)))
    except BaseException:
        return ("raise", "Exception", False, None, "the program's exception could not be reported")


# -- the judge --------------------------------------------------------------------------------

class Remote:
    """A program object that stays in the program's process (module docstring)."""

    __slots__ = ("_ref", "_ask")

    def __init__(self, ref: int, ask):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_ask", ask)

    def __call__(self, *args, **kwargs):
        result, changed, changed_kw = self._ask("call", self._ref, (args, kwargs))
        _update([a for a in args if type(a) in (list, dict, set)], changed)
        _update([kwargs[k] for k in changed_kw if k in kwargs], [changed_kw[k] for k in changed_kw if k in kwargs])
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
        return Items(it) if type(it) is Remote else iter(it)

    def __next__(self):
        return next(Items(self, 1))

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
    """The tests' iterator over a program iterator: items taken in growing chunks (one request
    each), so an endless generator is read only as far as the tests go."""

    def __init__(self, it: Remote, limit: int = MAX_CHUNK):
        self.it, self.buffer, self.chunk, self.limit, self.done = it, [], 1, limit, False

    def __iter__(self):
        return self

    def __next__(self):
        if not self.buffer and not self.done:
            it = self.it
            taken = it._ask("take", it._ref, self.chunk)
            self.buffer = list(reversed(_typed(taken, list, "next()")))
            self.done = len(taken) < self.chunk
            self.chunk = min(2 * self.chunk, self.limit)
        if not self.buffer:
            raise StopIteration
        return self.buffer.pop()


def _update(given: list, now: list) -> None:
    """The tests' lists, dicts and sets given to a call, filled with what the call left in them."""
    for old, new in zip(given, now if type(now) is list else []):
        if type(old) is not type(new):
            continue
        if type(old) is list:
            old[:] = new
        else:
            old.clear()
            old.update(new)


def _typed(value, kind: type, what: str):
    if type(value) is not kind:
        raise TypeError(f"{what} of a program object gave {type(value).__name__}, not {kind.__name__}")
    return value


class Judge:
    """The judge's end of the pipes: asks, and rebuilds answers (raising what the program raised)."""

    def __init__(self, requests: int, answers: int):
        self.requests, self.answers = requests, answers
        self.remotes: dict[int, Remote] = {}
        #: the tests' classes standing for the program's top-level exception classes, by name
        self.errors: dict[str, type] = {}
        #: the program's process ended (a test that caught ``ProgramGone`` still ends the run)
        self.gone = False

    def remote(self, ref: int) -> Remote:
        r = self.remotes.get(ref)
        if r is None:
            r = self.remotes[ref] = Remote(ref, self.ask)
        return r

    @staticmethod
    def _ref(obj) -> int:
        """A program object's reference, to send it back; nothing else of the tests' may cross."""
        if type(obj) is Remote:
            return object.__getattribute__(obj, "_ref")
        raise TypeError(f"the tests passed a {type(obj).__name__} to the program: with isolated tests "
                        "(sandbox.isolate_tests) only plain values and the program's own objects cross")

    def ask(self, kind: str, ref: int, args):
        data = dumps((kind, self.remote(ref), args), self._ref)  # before the pipe: a refusal sends nothing
        try:
            os.write(self.requests, len(data).to_bytes(4, "big"))
            while data:
                data = data[os.write(self.requests, data):]
            message = read_frame(self.answers, self.remote)
        except (ProgramGone, BrokenPipeError):
            self.gone = True
            raise ProgramGone() from None
        if message[0] == "ok" and len(message) == 2:
            return message[1]
        if message[0] == "raise" and len(message) == 5:
            raise self._error(*message[1:])
        raise ValueError(f"the program's process answered {str(message[0])[:40]!r}")

    def _error(self, name, top_level, args, line) -> BaseException:
        """The exception the tests see for one the program raised (module docstring)."""
        cls = self.errors.get(name) if top_level else None
        if cls is None:
            cls = getattr(builtins, str(name), None)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)) or cls.__name__ in ENDS_ITERATION:
                cls = RuntimeError
        line = str(line)
        try:
            return cls(*args) if type(args) is tuple else cls(line)
        except BaseException:  # arguments a builtin does not take (UnicodeError's kin)
            return RuntimeError(line)

    def program_names(self, first) -> dict:
        """The names of the program's report (``serve``): its plain values and proxies, and a
        class of the tests' own for each of its exception classes. Anything else in the report
        (forged by the program: it can write to that pipe) is left out."""
        if not (type(first) is tuple and len(first) == 5 and first[:2] == ("program", True)
                and all(type(part) is dict for part in first[2:])):
            raise ValueError("the program's process sent a malformed report")
        names = {k: v for k, v in first[2].items() if offered(k)}
        for name, module in first[4].items():  # the modules the program imported: the standard library's
            if offered(name) and type(module) is str:
                try:
                    __import__(module)
                    names[name] = sys.modules[module]
                except BaseException:  # none of that name here
                    pass
        for name, base in first[3].items():
            base = getattr(builtins, str(base), None)
            if offered(name) and isinstance(base, type) and issubclass(base, BaseException):
                names[name] = self.errors[name] = type(name, (base,), {"__module__": "__main__"})
        return names


def run_isolated(names: list, send, memory, result_fd: int, run_program, namespace: dict, run_test, describe,
                 read_tests) -> int:
    """The judge (module docstring): fork the program's process (``run_program`` in
    ``namespace``), run the tests against it, report each through ``send``; the runner's exit
    code. ``memory()`` reports an execution out of memory; ``result_fd`` is closed in the
    program's process; ``read_tests()`` reads the tests' source from standard input (after the
    fork, so the program's process never holds it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    to_program, from_judge = os.pipe()
    to_judge, from_program = os.pipe()
    pid = os.fork()
    if pid == 0:  # the program's process: no result channel, no tests, no standard input
        try:
            for fd in (result_fd, from_judge, to_judge):
                os.close(fd)
            _no_input()
            serve(to_program, from_program, run_program, namespace, describe)
        finally:
            os._exit(70)
    os.close(to_program)
    os.close(from_program)
    source = read_tests()
    _no_input()
    judge = Judge(from_judge, to_judge)
    try:
        first = read_frame(to_judge, judge.remote)
        while first == ("memory",):
            memory()
            first = read_frame(to_judge, judge.remote)
    except ProgramGone:
        return _program_ended(pid)
    if type(first) is tuple and first[:2] == ("program", False):  # failed: reported as if it had run here
        send("program", False)
        return _program_ended(pid)
    tests = type(sys)("__main__")
    tests.__dict__.update(judge.program_names(first))
    tests.__dict__.update(__builtins__=builtins, __name__="__main__")
    send("program", True)
    sys.modules["__main__"] = tests
    try:
        ok, error = True, None
        try:
            exec(compile(source, "/in/tests.py", "exec"), tests.__dict__)
        except BaseException as err:
            if isinstance(err, MemoryError):
                memory()
            ok, error = False, describe(err)
        if judge.gone:
            return _program_ended(pid)
        if names == ["tests"] or not ok:
            for name in names:
                send("test", (name, ok, error))
            send("done")
            return 0 if ok else 1
        failed = 0
        for name in names:
            passed, error = run_test(tests.__dict__.get(name))
            if judge.gone:
                return _program_ended(pid)
            failed += not passed
            send("test", (name, passed, error))
        send("done")
        return 1 if failed else 0
    finally:
        _stop(pid)


def _no_input() -> None:
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _program_ended(pid: int) -> int:
    """The runner's exit as the program's process ended: its exit code, or its signal sent to
    the runner itself (a CPU limit or a kill reads as it would in one process)."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        sys.stdout.flush()
        sys.stderr.flush()
        import _signal  # not ``signal``: its enums cost every execution milliseconds to import

        if sig != 9:  # SIGKILL has no handler to reset
            _signal.signal(sig, _signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


def _stop(pid: int) -> None:
    try:
        os.kill(pid, 9)  # SIGKILL
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
