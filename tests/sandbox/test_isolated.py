"""Isolated tests (``sandbox.isolate_tests``, the default) on the real sandbox: the cheats a
policy can learn against tests that run in its program's interpreter pass there and fail here,
and so does a report forged on the judge's own pipe; honest programs (functions, classes,
generators, coroutines, exceptions of their own, containers changed in place, named tuples,
every plain type) pass alike; a program's end, limits and output mid-test read as they do in
one process; and the wire between the two processes refuses what it cannot carry."""

from __future__ import annotations

import math

import pytest

from astraflow.sandbox import Sandbox, SandboxConfig
from astraflow.sandbox import wire

LIMITS = dict(timeout_s=3.0, cpu_s=2.0, memory_mb=256, max_processes=16, max_output_bytes=4096)
#: what the cheats fool: a comparison, and a truth test (passed honestly by a truthy plain value)
TESTS = "def test_add():\n    assert add(2, 2) == 4\n\ndef test_truth():\n    assert add(1, 1)\n"
#: tests of the kind a cheat needs, where TESTS would not do
CHEAT_TESTS = {
    "builtins shadowed by the program's globals": "def test_add():\n    for i in range(3):\n"
                                                  "        assert add(i, i) == 2 * i\n"
                                                  "    assert all([add(1, 1) == 2])\n",
    "StopIteration ending the tests' iteration": "def test_add():\n    assert all(map(lambda c: add(*c) == sum(c), "
                                                 "[(1, 1), (2, 5)]))\n",
    "a StopIteration of its own ending the tests' iteration": "def test_add():\n    assert all(map(lambda c: "
                                                              "add(*c) == sum(c), [(1, 1), (2, 5)]))\n",
}


@pytest.fixture(scope="module")
def isolated():
    return Sandbox(SandboxConfig(**LIMITS))


@pytest.fixture(scope="module")
def shared():
    return Sandbox(SandboxConfig(**LIMITS, isolate_tests=False))


CHEATS = {
    "an object equal to everything": "class E:\n    def __eq__(self, o):\n        return True\n\n"
                                     "def add(a, b):\n    return E()\n",
    "an int subclass equal to everything": "class I(int):\n    def __eq__(self, o):\n        return True\n"
                                           "    __hash__ = int.__hash__\n\ndef add(a, b):\n    return I(7)\n",
    "builtins shadowed by the program's globals": "def add(a, b):\n    return 0\n\n"
                                                  "range = lambda *a: ()\nall = lambda *a: True\n",
    "StopIteration ending the tests' iteration": "def add(a, b):\n    raise StopIteration\n",
    "a StopIteration of its own ending the tests' iteration": "class Done(StopIteration):\n    pass\n\n"
                                                              "def add(a, b):\n    raise Done\n",
    "the tests read and answered": "import re\nsrc = open('/in/tests.py').read()\n"
                                   "ANS = {(int(a), int(b)): int(c) for a, b, c in "
                                   "re.findall(r'add\\((\\d+), (\\d+)\\) == (\\d+)', src)}\n"
                                   "def add(a, b):\n    return ANS.get((a, b), 1)\n",
}


@pytest.mark.parametrize("cheat", list(CHEATS))
def test_a_cheat_that_passes_shared_tests_fails_isolated_ones(isolated, shared, cheat):
    tests = CHEAT_TESTS.get(cheat, TESTS)
    assert shared.run(CHEATS[cheat], tests).status == "ok"  # what a policy would be rewarded for
    r = isolated.run(CHEATS[cheat], tests)
    assert r.status == "failure" and not r.tests[0].passed, r


HONEST = ("import asyncio\n"
          "class Stack:\n    def __init__(self):\n        self.items = []\n"
          "    def push(self, v):\n        self.items.append(v)\n    def pop(self):\n        return self.items.pop()\n"
          "    def __len__(self):\n        return len(self.items)\n    def __str__(self):\n"
          "        return f'Stack{self.items}'\n"
          "class Negative(ValueError):\n    pass\n"
          "def root(x):\n    if x < 0:\n        raise Negative(f'{x} < 0')\n    return x ** 0.5\n"
          "def evens(n):\n    yield from range(0, n, 2)\n"
          "async def later(v):\n    await asyncio.sleep(0)\n    return v\n"
          "def echo(*a, **k):\n    print('echo', a, k)\n    return a, k\n"
          "LIMIT = 10 ** 30\n"
          "import collections, math\nPoint = collections.namedtuple('Point', 'x y')\n"
          "def origin():\n    return Point(0, 0)\n"
          "def sort_in_place(xs, seen=None):\n    xs.sort()\n    if seen is not None:\n        seen['n'] = len(xs)\n"
          "def count_up():\n    n = 0\n    while True:\n        yield n\n        n += 1\n"
          "def lookup(d, k):\n    return d[k]\n"
          "import statistics\nclass AppError(Exception):\n    pass\nclass NotFound(AppError):\n    pass\n"
          "Missing = NotFound\ndef find(k):\n    raise NotFound(k)\ndef mean(xs):\n    return statistics.mean(xs)\n"
          "def total(xs):\n    return sum(xs)\n"
          "import json\nfrom json import JSONDecodeError\nBase = Exception\n"
          "def parse(s):\n    return json.loads(s)\n")
HONEST_TESTS = (
    "import math\n"
    "def test_objects():\n    s = Stack()\n    s.push(1)\n    s.push([2, (3.5, None)])\n"
    "    assert len(s) == 2 and str(s) == 'Stack[1, [2, (3.5, None)]]'\n"
    "    assert s.pop() == [2, (3.5, None)] and s.pop() == 1 and s.items == []\n"
    "def test_exceptions():\n    try:\n        root(-1)\n    except ValueError as e:\n"
    "        assert str(e) == '-1 < 0'\n    else:\n        assert False\n"
    "def test_iteration():\n    assert list(evens(7)) == [0, 2, 4, 6] and 4 in evens(7)\n"
    "async def test_coroutine():\n    assert await later(5) == 5\n"
    "def test_plain_values():\n"
    "    value = ({1: 'a', (2, 3): b'x'}, {1, 2}, frozenset([3]), 2 ** 100, -LIMIT, float('inf'), 1 + 2j,\n"
    "             'snow \\u2603 \\udcff')\n"
    "    args, kwargs = echo(*value, key=[None, True, 0.1])\n"
    "    assert args == value and kwargs == {'key': [None, True, 0.1]}\n"
    "    assert math.isnan(echo(float('nan'))[0][0]) and root(4) == 2.0\n"
    "def test_in_place_and_named():\n    xs, seen = [3, 1, 2], {}\n    sort_in_place(xs, seen=seen)\n"
    "    assert xs == [1, 2, 3] and seen == {'n': 3}\n    assert origin() == (0, 0) and origin().x == 0\n"
    "def test_own_exceptions():\n    try:\n        root(-2)\n    except Negative as e:\n"
    "        assert str(e) == '-2 < 0'\n"
    "    else:\n        assert False\n    try:\n        lookup({}, 'k')\n    except KeyError as e:\n"
    "        assert e.args == ('k',)\n"
    "def test_lazy_iteration():\n    import itertools\n    g = count_up()\n    assert next(g) == 0 and next(g) == 1\n"
    "    assert list(itertools.islice(count_up(), 3)) == [0, 1, 2]\n"
    "def test_the_programs_modules():\n    assert math.floor(2.5) == 2\n"
    "def test_exception_classes():\n    import statistics\n    for catch in (AppError, NotFound, Missing):\n"
    "        try:\n            find('k')\n        except catch as e:\n            assert e.args == ('k',)\n"
    "    try:\n        mean([])\n    except statistics.StatisticsError:\n        pass\n"
    "    else:\n        assert False\n"
    "def test_standard_exception_classes():\n    import json\n"
    "    for catch in (json.JSONDecodeError, JSONDecodeError, Base, ValueError):\n"
    "        try:\n            parse('{')\n        except catch:\n            pass\n"
    "        else:\n            assert False\n"
    "def test_ranges_and_generators():\n    assert total(range(4)) == 6 and total(x * x for x in range(3)) == 5\n")


@pytest.mark.parametrize("mode", ["isolated", "shared"])
def test_an_honest_program_passes_either_way(isolated, shared, mode):
    r = (isolated if mode == "isolated" else shared).run(HONEST, HONEST_TESTS)
    assert r.status == "ok", (r.tests, r.stderr)
    assert r.stdout.count("echo") == 2  # the program's output during the tests reaches the result


def test_a_report_forged_on_the_judges_pipe_gives_the_tests_no_name_they_did_not_define(isolated):
    """The program's process is a fork of the judge: it can reach the function that writes its
    report and add names to it (here ``__name__``, which would skip the tests' checks)."""
    forger = ("import sys\ndef add(a, b):\n    return 0\n_f = sys._getframe()\n"
              "while _f.f_code.co_name != 'serve':\n    _f = _f.f_back\n_J = _f.f_globals\n_orig = _J['write_frame']\n"
              "def _wf(fd, msg, handle):\n    if type(msg) is tuple and msg[:2] == ('program', True):\n"
              "        msg[2].update(__name__='not_main', __builtins__={'all': lambda *a: True}, len=lambda x: 0)\n"
              "    return _orig(fd, msg, handle)\n_J['write_frame'] = _wf\n")
    r = isolated.run(forger, "def check(candidate):\n    assert candidate(2, 2) == 4\n\n"
                             "if __name__ == '__main__':\n    check(add)\n")
    assert r.status == "failure" and r.tests[0].error == "AssertionError: assert candidate(2, 2) == 4", r


def test_the_program_cannot_raise_keyboard_interrupt_in_the_tests_own_code(isolated):
    """A SIGINT sent to the judge (the same user) would raise KeyboardInterrupt wherever its tests
    are, outside any call to the program: here in a step they guard with a broad ``except``."""
    program = ("import os, signal, time\ndef add(a, b):\n    judge = os.getppid()\n    if a == 0 and os.fork() == 0:\n"
               "        time.sleep(0.2)\n        os.kill(judge, signal.SIGINT)\n        os._exit(0)\n    return 0\n")
    tests = ("import time\n\ndef test_a():\n    add(0, 0)\n    try:\n        time.sleep(1)  # the tests' own work\n"
             "    except BaseException:\n        return\n    assert add(2, 2) == 4\n")
    r = isolated.run(program, tests, timeout_s=5)
    assert r.status == "failure" and r.tests[0].error == "AssertionError: assert add(2, 2) == 4", r


def test_the_judge_imports_no_module_the_program_names_outside_a_short_list(isolated):
    """``unittest.__main__`` imported in the judge would run unittest's discovery there, which
    imports the program's files from the scratch directory (here one that reports a pass)."""
    payload = ("import os, sys\nf = sys._getframe()\nwhile f.f_code.co_name != 'run_isolated':\n    f = f.f_back\n"
               "L = f.f_locals\nL['send']('program', True)\nfor n in L['names']:\n"
               "    L['send']('test', (n, True, None))\n"
               "L['send']('done')\nos._exit(0)\n")
    program = (f"import sys\nopen('/sandbox/test_zz_judge.py', 'w').write({payload!r})\n"
               "m = type(sys)('unittest.__main__')\n\ndef add(a, b):\n    return a - b\n")
    r = isolated.run(program, TESTS)
    assert r.status == "failure" and not r.tests[0].passed, r


def test_a_failing_assert_is_quoted_and_a_callback_is_refused_by_name(isolated):
    r = isolated.run("def add(a, b):\n    return a - b\n\ndef apply(f, x):\n    return f(x)\n",
                     "def test_add():\n    assert add(2, 2) == 4\n\n"
                     "def test_apply():\n    assert apply(abs, -1) == 1\n")
    add, apply = r.tests
    assert add.error == "AssertionError: assert add(2, 2) == 4"
    assert "TypeError" in apply.error and "sandbox.isolate_tests" in apply.error


def test_the_program_sees_neither_the_tests_file_nor_their_source(isolated):
    probe = ("import gc, os\nprint(sorted(os.listdir('/in')))\n"
             "print('held', any('SECRET' in o for o in gc.get_objects() if isinstance(o, str)))\n")
    r = isolated.run(probe, "def test_a():\n    assert 'SECRET'\n")
    assert r.status == "ok" and "tests.py" not in r.stdout and "held False" in r.stdout, r.stdout


@pytest.mark.parametrize("body, status", [
    ("import os\n    os._exit(0)", "failure"), ("while True:\n        pass", "timeout"),
    ("return bytearray(1 << 30)", "memory"), ("import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)", "failure"),
])
def test_a_program_that_ends_or_hits_a_limit_inside_a_test_reads_as_in_one_process(body, status):
    program, tests = f"def f():\n    {body}\n", "def test_a():\n    f()\n\ndef test_b():\n    pass\n"
    # the CPU limit first, however loaded the machine; where the program ends itself, one no run reaches
    limits = {**LIMITS, "timeout_s": 60.0, "cpu_s": 1.0 if status == "timeout" else 30.0}
    one = Sandbox(SandboxConfig(**limits, isolate_tests=False)).run(program, tests)
    two = Sandbox(SandboxConfig(**limits)).run(program, tests)
    assert one.status == two.status == status and one.tests == two.tests, (one, two)
    assert one.exit_code == two.exit_code


def test_the_wire_round_trips_plain_values_and_refuses_the_rest():
    values = [None, True, 0, -(1 << 70), 1.5, -0.0, math.inf, 2 - 3j, "", "\udcff", b"\x00", [1, (2,)],
              {(1, "a"): {2}}, frozenset({b"z"}), ()]
    handles = []
    data = wire.dumps((values, object()), lambda x: handles.append(x) or 7)
    back = wire.loads(data, lambda ref: ("remote", ref))
    assert back[0] == values and back[1] == ("remote", 7) and len(handles) == 1
    nested = []
    for _ in range(wire.MAX_DEPTH + 5):
        nested = [nested]
    with pytest.raises(ValueError, match="nested"):
        wire.dumps(nested, lambda x: 0)
    forged = b"n" + wire.dumps(("Point", (object(),), (1,)), lambda x: 5)  # a field name that is a handle
    for bad in (b"q", b"s99;ab", b"l2;N", b"NN", b"i12", b"d1;N", b"l" + b"l1;" * 200 + b"N", forged):
        with pytest.raises((ValueError, IndexError)):
            wire.loads(bad, lambda ref: ref)


def test_a_sandbox_interpreter_of_other_bytecode_compiles_the_judge_itself(monkeypatch):
    """The host hands over the judge compiled only when the probe says the sandbox interpreter
    reads its bytecode; else the source, which the runner compiles."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "MAGIC_NUMBER", b"\x00\x00\r\n")  # as if the host were another Python
    r = Sandbox(SandboxConfig(**LIMITS)).run(CHEATS["an object equal to everything"], TESTS)
    assert r.status == "failure" and "no truth value" in r.tests[1].error, r


def test_iteration_threads_and_argument_kinds_behave_as_in_one_process(isolated, shared):
    """A generator that raises after some items gives those items first; calls from several
    threads of the tests each get their own answer; views and builtin iterators cross as lists;
    an iterator the tests read ahead of is refused with the fix rather than handed over short."""
    program = ("def g():\n    yield 1\n    yield 2\n    raise ValueError('x')\n"
               "def nums():\n    return iter(range(10))\ndef rest(it):\n    return list(it)\n"
               "def sq(x):\n    return x * x\ndef total(xs):\n    return sum(xs)\n")
    tests = ("def test_gen():\n    got = []\n    try:\n        for x in g():\n            got.append(x)\n"
             "    except ValueError:\n        got.append('raised')\n    assert got == [1, 2, 'raised']\n"
             "def test_threads():\n    from concurrent.futures import ThreadPoolExecutor\n"
             "    with ThreadPoolExecutor(4) as ex:\n"
             "        assert list(ex.map(sq, range(40))) == [i * i for i in range(40)]\n"
             "def test_views():\n    d = {'a': 1, 'b': 2}\n"
             "    assert total(d.values()) == 3 and total(map(int, '123')) == 6\n"
             "    assert total(xs=iter([4])) == 4\n")
    for sb in (isolated, shared):
        r = sb.run(program, tests)
        assert r.status == "ok", r.tests
    r = isolated.run(program, "def test_a():\n    it = nums()\n    next(it)\n    next(it)\n    rest(it)\n")
    assert "list(it)" in r.tests[0].error, r.tests
