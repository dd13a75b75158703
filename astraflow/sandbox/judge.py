"""Isolated tests (``sandbox.isolate_tests``), inside the sandbox: the runner (``runner.py``)
loads this file from its input directory and calls ``run_isolated``; standard library only,
never imported by the host.

The runner's process becomes the *judge*: it forks the *program's process*, which runs the
program and then answers the judge's requests. Only the judge holds the result channel and
reads the tests (from its standard input, after the fork: they never exist in the program's
process); it runs them in a namespace of proxies. Between the two processes only plain values
travel (None, bool, int, float, complex, str, bytes and lists, tuples, sets, frozensets and dicts
of them; instances of their subclasses travel as the plain value), in a small encoding with a
parser of its own. Anything else the program returns stays in its process and
reaches the tests as a ``Remote``: it can be called, indexed, iterated, measured and printed,
each by a request, but comparing it or testing its truth never asks the program. So a program
can make its functions return what it likes, but not what the tests compare it with, nor the
builtins, assertions or report of the tests.
"""

import os
import sys



class ProgramGone(Exception):
    """The program's process ended while the judge waited for it."""


# -- the wire: a 4-byte length, then the message in a small tagged encoding (``ast`` and ``json``
# cost an execution milliseconds to import; ``pickle`` and ``marshal`` must not read what the program writes)

#: how deep containers may nest on the wire
MAX_DEPTH = 100
_SEQUENCES = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}
_BUILD = {b"l": list, b"t": tuple, b"S": set, b"Z": frozenset}
_PLAIN = (bool, int, float, complex, str, bytes, dict, list, tuple, set, frozenset)


def dumps(x, handle, depth: int = 0) -> bytes:
    """``x`` encoded; what is not plain becomes a handle: ``handle(x)``, its reference."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested more than {MAX_DEPTH} deep cannot cross to the tests")
    if x is None:
        return b"N"
    if x is True or x is False:
        return b"T" if x else b"F"
    t = type(x)
    if t is int:
        return b"i%d;" % x if -1 << 60 < x < 1 << 60 else b"I%d;" % ((x.bit_length() + 8) // 8) + x.to_bytes(
            (x.bit_length() + 8) // 8, "big", signed=True)
    if t is str:
        data = x.encode("utf-8", "surrogatepass")
        return b"s%d;" % len(data) + data
    if t is bytes:
        return b"b%d;" % len(x) + x
    if t is float:
        return b"f" + x.hex().encode() + b";"
    if t is complex:
        return b"c" + x.real.hex().encode() + b";" + x.imag.hex().encode() + b";"
    if t is dict:
        return b"d%d;" % len(x) + b"".join(dumps(k, handle, depth + 1) + dumps(v, handle, depth + 1)
                                           for k, v in x.items())
    tag = _SEQUENCES.get(t)
    if tag is not None:
        return tag + b"%d;" % len(x) + b"".join(dumps(i, handle, depth + 1) for i in x)
    for base in _PLAIN:
        if isinstance(x, base):  # a subclass travels as its plain value
            return dumps(base(x), handle, depth)
    return b"h%d;" % handle(x)


def loads(data: bytes, remote):
    """The value ``dumps`` wrote; ``remote(ref)`` for a handle. ``ValueError`` for anything else."""
    value, end = _load(data, 0, remote, 0)
    if end != len(data):
        raise ValueError("trailing bytes on the wire")
    return value


def _number(data: bytes, i: int) -> tuple[bytes, int]:
    end = data.index(b";", i)
    return data[i:end], end + 1


def _load(data: bytes, i: int, remote, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    tag = data[i:i + 1]
    i += 1
    if tag == b"N":
        return None, i
    if tag in (b"T", b"F"):
        return tag == b"T", i
    if tag in (b"i", b"h"):
        text, i = _number(data, i)
        return (int(text) if tag == b"i" else remote(int(text))), i
    if tag in (b"I", b"s", b"b"):
        text, i = _number(data, i)
        n = int(text)
        if n < 0 or i + n > len(data):
            raise ValueError("a length past the message")
        chunk = data[i:i + n]
        value = (int.from_bytes(chunk, "big", signed=True) if tag == b"I"
                 else chunk.decode("utf-8", "surrogatepass") if tag == b"s" else chunk)
        return value, i + n
    if tag == b"f":
        text, i = _number(data, i)
        return float.fromhex(text.decode("ascii")), i
    if tag == b"c":
        real, i = _number(data, i)
        imag, i = _number(data, i)
        return complex(float.fromhex(real.decode("ascii")), float.fromhex(imag.decode("ascii"))), i
    if tag == b"d" or tag in _BUILD:
        text, i = _number(data, i)
        items = []
        for _ in range(int(text) * (2 if tag == b"d" else 1)):
            item, i = _load(data, i, remote, depth + 1)
            items.append(item)
        if tag == b"d":
            return dict(zip(items[::2], items[1::2])), i
        return _BUILD[tag](items), i
    raise ValueError(f"unknown tag {tag!r} on the wire")


def write_frame(fd: int, message, handle) -> None:
    data = dumps(message, handle)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd: int, remote):
    """The next message, or ``ProgramGone`` at the end of the pipe."""
    return loads(_read_exactly(fd, int.from_bytes(_read_exactly(fd, 4), "big")), remote)


def _read_exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ProgramGone()
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _no_handles(x) -> int:
    raise TypeError(f"a {type(x).__name__} on the judge's wire")


# -- the program's process ------------------------------------------------------------------

def serve(requests: int, answers: int, run_program, namespace: dict, describe) -> None:
    """Run the program (``run_program(report_memory)`` -> (ok, exit code), in ``namespace``),
    report it and what it defined, then answer requests until the judge closes the pipe.
    Never returns."""
    handles = {}

    def handle(x) -> int:
        handles[id(x)] = x
        return id(x)

    ok, code = run_program(lambda: write_frame(answers, ("memory",), _no_handles))
    _flush()  # what the program printed: this process ends by a kill
    if not ok:
        write_frame(answers, ("program", False, code), _no_handles)
        os._exit(code)
    names = {}
    for name, value in list(namespace.items()):
        if type(name) is str and not name.startswith("__") and type(value) is not type(sys):
            try:
                dumps(value, handle)
                names[name] = value
            except BaseException:  # an object the program made unreadable: not offered to the tests
                pass
    write_frame(answers, ("program", True, names), handle)
    while True:
        try:
            request = read_frame(requests, handles.__getitem__)
        except ProgramGone:
            os._exit(0)
        try:
            answer = dumps(("ok", _ANSWERS[request[0]](request[1], request[2])), handle)
        except BaseException as err:  # what the program raised, or a result that cannot travel
            answer = dumps(_raised(err, describe), _no_handles)
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
    "list": lambda obj, _: list(obj),
    "str": lambda obj, _: str(obj),
    "repr": lambda obj, _: repr(obj),
    "int": lambda obj, _: int(obj),
    "float": lambda obj, _: float(obj),
    "await": lambda obj, _: __import__("asyncio").run(obj),
}


def _raised(err: BaseException, describe) -> tuple:
    """``("raise", builtin class name, line)``: the nearest builtin class of ``err`` (what the
    tests can catch) and its line as the runner describes it."""
    try:
        base = next(c for c in type(err).__mro__ if c.__module__ == "builtins" and issubclass(c, BaseException))
        return ("raise", base.__name__, str.__str__(describe(err)))
    except BaseException:
        return ("raise", "Exception", "the program's exception could not be reported")


# -- the judge --------------------------------------------------------------------------------

class Remote:
    """A program object that stays in the program's process (module docstring)."""

    __slots__ = ("_ref", "_ask")

    def __init__(self, ref: int, ask):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_ask", ask)

    def __call__(self, *args, **kwargs):
        return self._ask("call", self._ref, (args, kwargs))

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
        return iter(_typed(self._ask("list", self._ref, None), list, "iter()"))

    def __contains__(self, item) -> bool:  # compared here, not by the program
        return item in list(self)

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


def _typed(value, kind: type, what: str):
    if type(value) is not kind:
        raise TypeError(f"{what} of a program object gave {type(value).__name__}, not {kind.__name__}")
    return value


class Judge:
    """The judge's end of the pipes: asks, and rebuilds answers (raising what the program raised)."""

    def __init__(self, requests: int, answers: int):
        self.requests, self.answers = requests, answers
        self.remotes: dict[int, Remote] = {}
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
        return self.answer(message)

    def answer(self, message):
        if message[0] == "ok":
            return message[1]
        if message[0] == "raise":
            import builtins

            cls = getattr(builtins, str(message[1]), None)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                cls = Exception
            line = str(message[2])
            text = line[len(cls.__name__) + 2:] if line.startswith(cls.__name__ + ": ") else line
            try:
                err = cls(text)
            except BaseException:  # a builtin that takes other arguments (UnicodeError's kin)
                err = Exception(line)
            raise err
        raise ValueError(f"the program's process answered {str(message[0])[:40]!r}")


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
        while first[0] == "memory":
            memory()
            first = read_frame(to_judge, judge.remote)
    except ProgramGone:
        return _program_ended(pid)
    if not first[1]:  # the program failed: the runner's reporting as if it had run here
        send("program", False)
        return _program_ended(pid)
    send("program", True)
    tests = type(sys)("__main__")
    tests.__dict__.update(first[2])
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
