"""The first code that runs inside the sandbox (standard library only; copied into each
execution's input directory, never imported by the host).

argv: result fd, CPU seconds, address-space bytes, process count, file-size bytes, the mode
(``isolated`` or ``shared``), then the test names (the host parses them from the tests;
``tests`` alone: the whole source is one test). It reads the nonce from stdin, sets the
resource limits every later process inherits, runs /in/program.py, then the tests and each
named test, and reports on the result pipe: one ``repr((nonce, event, payload))`` line per
event. Imports are kept to the few the success path needs: they are most of an execution's
start-up time.

``isolated`` (with tests): the program runs in a process of its own and the tests here, against
proxies of what it defined (``judge.py``, loaded from the input directory); the tests come on
stdin after the nonce, read once the program's process exists, and only this process holds the
result pipe. ``shared``: the tests (/in/tests.py) run in the program's namespace, in this
interpreter.

The program runs as a ``__main__`` module of its own (``import __main__`` gives it its own
namespace, not this module). In the shared mode the channel and the nonce live only in
``main``'s locals: one that digs through frames or the garbage collector's objects could still
forge the report. The nonce stops printing or blind writes to a file descriptor, not introspection.
The program also shares this interpreter's modules and builtins there, so it can break what the
runner would report with (the recursion limit, ``sys.modules``, a hostile exception class):
reporting resets the recursion limit, uses what was taken before the program ran, falls back to
a plain line, and once the program has run, a failure of the runner is the program's failure.
"""

import os
import resource
import sys

ERROR_CHARS = 500
MAX_FILES = 64  # open descriptors per process: with the file-size limit, bounds the memfds one can hold
RECURSION_LIMIT = sys.getrecursionlimit()
set_recursion_limit = sys.setrecursionlimit  # taken before the program can replace it
safe_repr = repr
#: sources read from no file (the isolated tests, from stdin) by path: an assert's line is quoted from here
SOURCES = {}


def main() -> int:
    fd = int(sys.argv[1])
    isolated, names = sys.argv[6] == "isolated", sys.argv[7:]
    nonce = _read_line(0)
    if not (isolated and names):  # else the tests follow the nonce: the judge reads them
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    os.set_inheritable(fd, False)  # exec'd children do not get the channel
    out = os.fdopen(fd, "w", buffering=1)
    memory_line = repr((nonce, "memory", None)) + "\n"
    ran = []  # not empty once the program's code has started

    def send(event: str, payload=None) -> None:
        set_recursion_limit(RECURSION_LIMIT)
        out.write(safe_repr((nonce, event, payload)) + "\n")

    try:
        return execute(names, isolated, send, out, memory_line, ran)
    except BaseException as exc:
        if ran:  # the program broke what the runner reports with: its failure, not the sandbox's
            _plain_error("the program broke the sandbox runner's reporting")
            return 1
        sys.stderr.write(f"sandbox runner failed: {exc!r}\n")  # the host reports sandbox_error
        send("runner_error", repr(exc)[:ERROR_CHARS])
        out.flush()
        return 70


def flush_output() -> None:
    """What the program printed, out before its process ends (by ``os._exit`` or a kill)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:  # the program replaced or closed it
            pass


def _read_line(fd: int) -> str:
    """One line of ``fd``, read a byte at a time: what follows it is not consumed."""
    line = bytearray()
    while (byte := os.read(fd, 1)) not in (b"", b"\n"):
        line += byte
    return line.decode("ascii").strip()


def _read_tests(fd: int) -> str:
    """The rest of ``fd``: the isolated tests' source (kept in ``SOURCES`` as /in/tests.py)."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    SOURCES["/in/tests.py"] = b"".join(chunks).decode("utf-8-sig")
    return SOURCES["/in/tests.py"]


def execute(names: list, isolated: bool, send, out, memory_line: str, ran: list) -> int:
    """Set the limits, run the program and the tests, report each event through ``send``."""
    isolated = isolated and bool(names)
    cpu_s, memory, nproc, fsize = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    cpu = int(cpu_s + 0.999)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    nproc += isolated  # the judge's own process: the program keeps its count
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    for kind, value in ((resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, MAX_FILES)):
        hard = resource.getrlimit(kind)[1]  # each file (memfds included), open descriptors; never raised
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.argv = ["/in/program.py"]  # as ``python program.py`` gives it: not the runner's arguments (unittest reads them)
    send("start")

    program = type(sys)("__main__")  # the program's own __main__ (a module, without importing types)
    program.__builtins__ = __builtins__
    sys.modules["__main__"] = program
    namespace = program.__dict__

    def report_memory() -> None:
        out.write(memory_line)

    def load(path: str, label: str, exit_ok: bool, memory=report_memory):
        """(the code of ``path``, None), or (None, ``run_source``'s result) where it is no code."""
        try:
            with open(path, "rb") as f:
                source = f.read().decode("utf-8-sig")  # a leading byte-order mark is not code
        except UnicodeDecodeError as err:
            _plain_error(f"{label} is not valid UTF-8: {err}")
            return None, (False, f"UnicodeDecodeError: {err}"[:ERROR_CHARS], 1)
        try:
            ran.append(True)
            return compile(source, path, "exec"), None
        except BaseException as err:  # its syntax error, whatever it is
            set_recursion_limit(RECURSION_LIMIT)
            return None, program_failed(err, memory, exit_ok)

    def run_code(code, exit_ok: bool, memory=report_memory) -> tuple[bool, str | None, int]:
        try:
            exec(code, namespace)
            return True, None, 0
        except BaseException as err:  # the program's error, whatever it is
            set_recursion_limit(RECURSION_LIMIT)
            return program_failed(err, memory, exit_ok)

    def run_source(path: str, label: str, exit_ok: bool) -> tuple[bool, str | None, int]:
        """(ran cleanly, the exception line, exit code) of exec-ing ``path`` in the namespace;
        ``exit_ok``: whether ``SystemExit(0)`` ends it cleanly (the program's, not the tests')."""
        code, failed = load(path, label, exit_ok)
        return failed if code is None else run_code(code, exit_ok)

    if isolated:
        judge = {"__name__": "judge", "__builtins__": __builtins__}
        try:  # compiled by the host when its bytecode is this interpreter's
            with open("/in/judge.bin", "rb") as f:
                code = __import__("marshal").loads(f.read())
        except FileNotFoundError:
            with open("/in/judge.py", "rb") as f:
                code = compile(f.read(), "/in/judge.py", "exec")
        exec(code, judge)

        # compiled before the fork: the program's process only runs it, and one that does not
        # compile needs no process
        program_code, failed = load("/in/program.py", "the program", True)
        if failed is not None:
            send("program", False)
            return failed[2]

        def run_program(memory) -> tuple[bool, int]:
            ok, _, code = run_code(program_code, True, memory)
            return ok, code

        ran.append(True)  # from here a failure of the judge's is the program's doing
        return judge["run_isolated"](names, out.fileno(), namespace, {
            "send": send, "memory": report_memory, "run_program": run_program, "describe": describe,
            "run_test": lambda fn: run_test(fn, report_memory), "read_tests": lambda: _read_tests(0),
            "report_tests": report_tests, "flush": flush_output})

    ok, error, code = run_source("/in/program.py", "the program", True)
    send("program", ok)
    if not ok:
        return code
    if not names:
        send("done")
        return 0
    ok, error, _ = run_source("/in/tests.py", "the tests", False)
    return report_tests(names, ok, error, lambda name: run_test(namespace.get(name), report_memory), send)


def report_tests(names: list, ok: bool, error, run_one, send, gone=lambda: False):
    """Each named test's outcome through ``send``, then "done"; the runner's exit code. ``ok``
    False (the tests' top level failed) or a single ``tests``: each reports that. ``run_one(name)``
    runs one; once ``gone()`` (the program's process ended) None, nothing more reported."""
    if names == ["tests"] or not ok:  # the whole source is one test, or its top level failed
        for name in names:
            send("test", (name, ok, error))
        send("done")
        return 0 if ok else 1
    failed = 0
    for name in names:
        passed, error = run_one(name)
        if gone():
            return None
        failed += not passed
        send("test", (name, passed, error))
    send("done")
    return 1 if failed else 0


def program_failed(err: BaseException, memory, exit_ok: bool) -> tuple[bool, str | None, int]:
    """(ran cleanly, the exception line, exit code) of the program raising ``err``: its
    traceback on stderr, a MemoryError reported; whatever the program broke, never raises.
    A ``SystemExit`` out of the tests is a failure whatever its code: their asserts did not all run."""
    try:
        if isinstance(err, SystemExit) and exit_ok:
            code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
            return (True, None, 0) if code == 0 else (False, f"SystemExit: {err.code}"[:ERROR_CHARS], code)
        if isinstance(err, MemoryError):
            memory()
        print_error(err)
        return False, describe(err), 1
    except BaseException:
        return False, "the program's exception could not be reported", 1


def run_test(fn, memory) -> tuple[bool, str | None]:
    if not callable(fn):
        return False, "TypeError: not a function after the tests ran"
    try:
        result = fn()
        if type(result).__name__ == "coroutine":  # an ``async def`` test (not whatever it returned)
            import asyncio

            asyncio.run(result)
        return True, None
    except BaseException as err:
        set_recursion_limit(RECURSION_LIMIT)
        try:
            if isinstance(err, MemoryError):
                memory()
                return False, "MemoryError"
            return False, describe(err)
        except BaseException:
            return False, "the test's exception could not be reported"


def print_error(err: BaseException) -> None:
    """The traceback to stderr, the runner's own frames left out; the exception line alone
    when the program left ``traceback`` unusable."""
    try:
        import traceback

        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        traceback.print_exception(type(err), err, tb)
    except BaseException:
        _plain_error(describe(err))


def _plain_error(line: str) -> None:
    """``line`` to stderr (the file descriptor, whatever the program made of ``sys.stderr``)."""
    try:
        os.write(2, (line + "\n").encode("utf-8", "replace"))
    except BaseException:
        pass


def describe(err: BaseException) -> str:
    """The exception line (as Python prints it last); a bare AssertionError names the failing
    source line. Built by hand: importing ``traceback`` would cost every failing execution
    more than the rest of the runner. A class or message that raises gives a plain line."""
    try:
        cls = type(err)
        module, qualname = cls.__module__, cls.__qualname__
        plain = type(module) is str and module in ("builtins", "__main__")
        name = qualname if plain else f"{module}.{qualname}"
    except BaseException:
        name = "<exception>"
    try:
        message = str(err)
    except BaseException:
        message = "<exception str() failed>"
    line = f"{name}: {message}" if message else name
    if isinstance(err, AssertionError) and not message:
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        source = _source_line(tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else ""
        if source:
            line = f"AssertionError: {source}"
    return line[:ERROR_CHARS]


def _source_line(path: str, lineno: int) -> str:
    try:
        if path in SOURCES:
            lines = SOURCES[path].splitlines()
        else:
            with open(path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        return lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    except OSError:
        return ""


if __name__ == "__main__":
    try:
        status = main()
    except BaseException as exc:  # before the channel was open: the host reports sandbox_error
        sys.stderr.write(f"sandbox runner failed: {exc!r}\n")
        status = 70
    flush_output()
    os._exit(status)
