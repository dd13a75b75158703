"""The first code that runs inside the sandbox (standard library only; copied into each
execution's input directory, never imported by the host).

It reads the nonce from stdin, sets the resource limits every later process inherits, then
runs /in/program.py and each ``test_*`` of /in/tests.py in one namespace, and reports on the
result pipe (fd given in argv): one JSON line per event, each carrying the nonce. The program
runs in this interpreter, so a program that digs into this module's frames could forge the
report: the nonce stops printing or blind writes to a file descriptor, not introspection.
"""

import ast
import json
import os
import resource
import sys
import traceback

ERROR_CHARS = 500
CHANNEL: list = []  # the open result pipe, for the report of the runner's own failure


def main() -> int:
    fd, limits = int(sys.argv[1]), json.loads(sys.argv[2])
    nonce = sys.stdin.readline().strip()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.set_inheritable(fd, False)  # exec'd children do not get the channel
    out = os.fdopen(fd, "w", buffering=1)
    CHANNEL.append((out, nonce))
    memory_line = json.dumps({"nonce": nonce, "event": "memory"}) + "\n"

    def send(event: str, **fields) -> None:
        out.write(json.dumps({"nonce": nonce, "event": event, **fields}) + "\n")

    cpu = int(limits["cpu_s"] + 0.999)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    send("start")

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}

    def run_source(path: str, label: str) -> tuple[bool, str | None, int]:
        """(ran cleanly, the exception line, exit code) of exec-ing ``path`` in the namespace."""
        try:
            with open(path, "rb") as f:
                source = f.read().decode("utf-8")
            code = compile(source, path, "exec")
            exec(code, namespace)
            return True, None, 0
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
            if code == 0:
                return True, None, 0
            return False, f"SystemExit: {err.code}", code
        except MemoryError:
            out.write(memory_line)
            print_error(sys.exc_info()[1])
            return False, "MemoryError", 1
        except UnicodeDecodeError as err:
            print(f"{label} is not valid UTF-8: {err}", file=sys.stderr)
            return False, f"UnicodeDecodeError: {err}", 1
        except BaseException as err:  # the program's error, whatever it is
            print_error(err)
            return False, describe(err), 1

    ok, error, code = run_source("/in/program.py", "the program")
    if not ok:
        send("program", ok=False, error=error)
        sys.stdout.flush()
        return code
    send("program", ok=True, error=None)
    if not os.path.exists("/in/tests.py"):
        send("done")
        return 0
    names = test_names("/in/tests.py")
    ok, error, _ = run_source("/in/tests.py", "the tests")
    if not names or not ok:  # the whole source is one test, or its top level failed
        for name in names or ["tests"]:
            send("test", name=name, passed=ok, error=error)
        send("done")
        return 0 if ok else 1
    failed = 0
    for name in names:
        passed, error = run_test(namespace.get(name), memory_line, out)
        failed += not passed
        send("test", name=name, passed=passed, error=error)
    send("done")
    return 1 if failed else 0


def test_names(path: str) -> list[str]:
    """Top-level ``test_*`` functions of the tests, in order; [] when unparsable (the exec
    that follows reports the error)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read().decode("utf-8"))
    except (SyntaxError, ValueError, UnicodeDecodeError, MemoryError, RecursionError):
        return []
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name.startswith("test_")]
    return list(dict.fromkeys(names))


def run_test(fn, memory_line: str, out) -> tuple[bool, str | None]:
    if not callable(fn):
        return False, "TypeError: not a function after the tests ran"
    try:
        result = fn()
        if hasattr(result, "__await__"):
            import asyncio

            asyncio.run(result)
        return True, None
    except MemoryError:
        out.write(memory_line)
        return False, "MemoryError"
    except BaseException as err:
        return False, describe(err)


def print_error(err: BaseException) -> None:
    """The traceback to stderr, the runner's own frames left out."""
    tb = err.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(err), err, tb)


def describe(err: BaseException) -> str:
    """The exception line; a bare AssertionError names the failing source line."""
    line = traceback.format_exception_only(type(err), err)[-1].strip()
    if isinstance(err, AssertionError) and not str(err):
        frames = traceback.extract_tb(err.__traceback__)
        if frames and frames[-1].line:
            line = f"AssertionError: {frames[-1].line.strip()}"
    return line[:ERROR_CHARS]


if __name__ == "__main__":
    try:
        status = main()
    except BaseException as err:  # the runner itself failed: the host reports sandbox_error
        traceback.print_exc()
        for out, nonce in CHANNEL:
            out.write(json.dumps({"nonce": nonce, "event": "runner_error", "error": repr(err)}) + "\n")
            out.flush()
        status = 70
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
