"""Isolated tests (``sandbox.isolate_tests``), inside the sandbox: the runner (``runner.py``)
loads this file (after ``wire.py`` and ``remote.py``) from its input directory and calls ``run_isolated``;
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

import _thread
import builtins
import os
import sys

if "dumps" not in globals():  # on the host (tests, linters): modules; in the sandbox their source comes first
    from astraflow.sandbox.remote import Remote, unread
    from astraflow.sandbox.wire import ProgramGone, dumps, no_handles, read_frame, write_frame

#: names the tests never take from the program: a program global called ``len`` must not shadow theirs
RESERVED = frozenset(dir(builtins))
#: what must not end the tests' own iterations when the program raises it (nor a subclass)
ENDS_ITERATION = (StopIteration, StopAsyncIteration, GeneratorExit)
#: the standard-library packages whose modules the judge imports by a name the program gives:
#: a module a program imported, one an exception it raised comes from. Only these (importing
#: some others runs code: ``unittest.__main__`` would import the program's files)
MODULES = frozenset({"array", "bisect", "calendar", "cmath", "collections", "copy", "dataclasses", "datetime",
                     "decimal", "enum", "fractions", "functools", "heapq", "itertools", "json", "math", "numbers",
                     "operator", "os", "random", "re", "statistics", "string", "sys", "textwrap", "time", "typing",
                     "unicodedata"})


def offered(name) -> bool:
    """Whether a program global of this name reaches the tests."""
    return type(name) is str and not name.startswith("__") and name not in RESERVED


def standard_class(name):
    """The exception class ``module:qualname`` names, if a builtin or one of ``MODULES``' (a
    class of the program's ``__main__`` that takes a builtin's name: the builtin), else None."""
    if type(name) is not str or ":" not in name:
        return None
    where, _, qualname = name.partition(":")
    found = builtins if where in ("builtins", "__main__") else module(where)
    for part in qualname.split(".") if found is not None else ():
        found = getattr(found, part, None)
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        return None
    home = found.__module__.split(".")[0]
    return found if home == "builtins" or home in MODULES else None


def module(name):
    """The standard-library module ``name`` if it is one of ``MODULES``' (imported), else None."""
    if type(name) is not str or name.split(".")[0] not in MODULES:
        return None
    try:
        __import__(name)
        return sys.modules[name]
    except BaseException:  # none of that name here
        return None


# -- the program's process ------------------------------------------------------------------

def serve(requests: int, answers: int, run_program, namespace: dict, describe, flush) -> None:
    """Run the program (``run_program(report_memory)`` -> (ok, exit code), in ``namespace``),
    report it and what it defined, then answer requests until the judge closes the pipe;
    ``flush()`` writes out what it printed. Never returns."""
    handles = {}

    def handle(x) -> int:
        handles[id(x)] = x
        return id(x)

    ok, code = run_program(lambda: write_frame(answers, ("memory",), no_handles))
    flush()  # what the program printed: this process ends by a kill
    if not ok:
        write_frame(answers, ("program", False, code), no_handles)
        os._exit(code)
    names, classes, modules = {}, {}, {}
    for name, value in list(namespace.items()):
        if offered(name) and type(value) is type(sys):  # the tests import it themselves
            modules[name] = getattr(value, "__name__", None)
        elif offered(name):
            try:
                if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == "__main__":
                    classes.setdefault(value, name)  # its first name; others alias it
                dumps(value, handle)
                names[name] = value
            except BaseException:  # an object the program made unreadable: not offered to the tests
                pass
    errors = {}  # name -> (builtin base, the names of its bases among the program's classes)
    for cls, name in classes.items():
        try:
            errors[name] = (_builtin_base(cls).__name__, [classes[b] for b in cls.__bases__ if b in classes])
        except BaseException:
            pass
    aliases = {}  # name -> the program's class it names, or a class elsewhere as module:qualname
    for name, v in names.items():
        try:
            if isinstance(v, type) and issubclass(v, BaseException):
                aliases[name] = classes[v] if v in classes else f"{v.__module__}:{v.__qualname__}"
        except BaseException:  # a class the program made unreadable: a proxy for the tests
            pass
    write_frame(answers, ("program", True, names, errors, aliases, modules), handle)
    while True:
        try:
            kind, obj, arg = read_frame(requests, handles.__getitem__)
        except ProgramGone:
            os._exit(0)
        try:
            result = _ANSWERS[kind](obj, arg)
            if kind == "call":  # what the call left in the containers it was given, by position and keyword
                result = (result, [(i, a) for i, a in enumerate(arg[0]) if type(a) in (list, dict, set)],
                          [(k, a) for k, a in arg[1].items() if type(a) in (list, dict, set)])
            answer = dumps(("ok", result), handle)
        except BaseException as err:  # what the program raised, or a result that cannot travel
            answer = dumps(_raised(err, classes, describe), no_handles)
        flush()
        os.write(answers, len(answer).to_bytes(4, "big"))
        while answer:
            answer = answer[os.write(answers, answer):]


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


#: the error a program iterator raised after items the judge had not had yet: raised at its next take
_PENDING: dict = {}


def _take(it, n: int) -> tuple:
    """(up to ``n`` items of the iterator ``it``, whether it ended). An error it raises after
    some items waits for the next take, so the tests get those items first."""
    err = _PENDING.pop(id(it), None)
    if err is not None:
        raise err
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            return out, True
        except BaseException as e:
            if not out:
                raise
            _PENDING[id(it)] = e
            break
    return out, False


def _builtin_base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__module__ == "builtins" and issubclass(c, BaseException))


def _raised(err: BaseException, classes: dict, describe) -> tuple:
    """``("raise", class, builtin base, args, line)`` for ``err``: its class as the name of the
    program's top-level class it is (or derives from), else as ``module:qualname``; its nearest
    builtin class; its arguments where plain; its line as the runner describes it."""
    try:
        cls = type(err)
        mine = next((classes[c] for c in cls.__mro__ if c in classes), None)
        try:
            args = tuple(err.args)
            dumps(args, no_handles)
        except BaseException:
            args = None
        return ("raise", mine or f"{cls.__module__}:{cls.__qualname__}", _builtin_base(cls).__name__, args,
                str.__str__(describe(err)))
    except BaseException:
        return ("raise", "builtins:Exception", "Exception", None, "the program's exception could not be reported")


# -- the judge --------------------------------------------------------------------------------

class Judge:
    """The judge's end of the pipes: asks, and rebuilds answers (raising what the program raised)."""

    def __init__(self, requests: int, answers: int):
        self.requests, self.answers = requests, answers
        self.remotes: dict[int, Remote] = {}
        self._lock = _thread.allocate_lock()  # one request at a time on the pipes, whatever thread asks
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
        """A program object's reference, to send it back; nothing else of the tests' may cross
        (nor a program iterator the tests have items of that the program would not see again)."""
        if type(obj) is Remote and unread(obj):
            raise TypeError("the tests passed the program an iterator of its own that they had read ahead of "
                            "(isolated tests take its items in chunks): pass list(it) instead")
        if type(obj) is Remote:
            return object.__getattribute__(obj, "_ref")
        raise TypeError(f"the tests passed a {type(obj).__name__} to the program: with isolated tests "
                        "(sandbox.isolate_tests) only plain values and the program's own objects cross")

    def ask(self, kind: str, ref: int, args):
        data = dumps((kind, self.remote(ref), args), self._ref)  # before the pipe: a refusal sends nothing
        try:
            with self._lock:
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

    def _error(self, name, base, args, line) -> BaseException:
        """The exception the tests see for one the program raised (module docstring): the class
        of the tests' own for the program's class, the standard library's class (of one of
        ``MODULES``, or a builtin: also for a program class that takes a builtin's name), else
        its nearest builtin class; never one that would end an iteration."""
        cls = self.errors.get(name) or standard_class(name)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            cls = getattr(builtins, str(base), None)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)) or issubclass(cls, ENDS_ITERATION):
            cls = RuntimeError
        line = str(line)
        args = args if type(args) is tuple else (line,)
        try:
            return cls(*args)
        except BaseException:  # a constructor that takes other arguments than it keeps (JSONDecodeError)
            try:
                return cls.__new__(cls, *args)  # the class and its arguments, without its own __init__
            except BaseException:
                return RuntimeError(line)

    def program_names(self, first) -> dict:
        """The names of the program's report (``serve``): its plain values and proxies, a class
        of the tests' own for each of its exception classes (with their hierarchy), the modules
        it imported. Anything else in the report (forged by the program: it can write to that
        pipe) is left out."""
        if not (type(first) is tuple and len(first) == 6 and first[:2] == ("program", True)
                and all(type(part) is dict for part in first[2:])):
            raise ValueError("the program's process sent a malformed report")
        names = {k: v for k, v in first[2].items() if offered(k)}
        pending = {k: v for k, v in first[3].items()
                   if offered(k) and type(v) is tuple and len(v) == 2 and type(v[1]) is list}
        while pending:  # a class after its bases
            ready = [k for k, (_, parents) in pending.items() if all(p in self.errors for p in parents)]
            if not ready:
                break
            for k in ready:
                base, parents = pending.pop(k)
                bases = tuple(self.errors[p] for p in parents) or (getattr(builtins, str(base), None),)
                if all(isinstance(b, type) and issubclass(b, BaseException) and not issubclass(b, ENDS_ITERATION)
                       for b in bases):
                    try:
                        self.errors[k] = type(k, bases, {"__module__": "__main__"})
                    except TypeError:  # bases no class can have together
                        pass
        for k, v in first[4].items():  # its other names for its classes, and the standard library's it holds
            cls = self.errors.get(v) or standard_class(v)
            if offered(k) and cls is not None:
                names[k] = cls
        for name, imported in first[5].items():  # the modules the program imported, of the standard library
            if offered(name) and module(imported) is not None:
                names[name] = module(imported)
        return names


def run_isolated(names: list, result_fd: int, namespace: dict, runner: dict) -> int:
    """The judge (module docstring): fork the program's process (``runner["run_program"]`` in
    ``namespace``; ``result_fd`` closed there), run the named tests against it, report each;
    the runner's exit code. ``runner``: the runner's ``send``, ``memory`` (reports an execution
    out of memory), ``describe``, ``flush``, ``run_test``, ``report_tests`` and ``read_tests`` (the tests'
    source from standard input, read after the fork, so the program's process never holds it)."""
    runner["flush"]()  # nothing buffered is written twice, once by each process
    to_program, from_judge = os.pipe()
    to_judge, from_program = os.pipe()
    import _signal

    # the program may signal the judge: a SIGINT would raise KeyboardInterrupt in the tests' own code
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    pid = os.fork()
    if pid == 0:  # the program's process: no result channel, no tests, no standard input
        try:
            _signal.signal(_signal.SIGINT, _signal.default_int_handler)  # as in any program
            for fd in (result_fd, from_judge, to_judge):
                os.close(fd)
            _no_input()
            serve(to_program, from_program, runner["run_program"], namespace, runner["describe"], runner["flush"])
        finally:
            os._exit(70)
    try:
        os.close(to_program)
        os.close(from_program)
        return _judge_tests(pid, names, from_judge, to_judge, runner)
    finally:
        _stop(pid)


def _judge_tests(pid: int, names: list, from_judge: int, to_judge: int, runner: dict) -> int:
    """``run_isolated``'s judge, once the program's process is forked (``pid``)."""
    send, memory, describe = runner["send"], runner["memory"], runner["describe"]
    source = runner["read_tests"]()
    _no_input()
    try:  # while the program runs
        compiled, error = compile(source, "/in/tests.py", "exec"), None
    except BaseException as err:
        compiled, error = None, err
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
    ok = True
    try:
        if error is not None:
            raise error
        exec(compiled, tests.__dict__)
    except BaseException as err:
        if isinstance(err, MemoryError):
            memory()
        ok, error = False, describe(err)
    if judge.gone:
        return _program_ended(pid)
    code = runner["report_tests"](names, ok, error, lambda name: runner["run_test"](tests.__dict__.get(name)), send,
                                  lambda: judge.gone)
    return _program_ended(pid) if code is None else code


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
