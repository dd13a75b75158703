"""Escape attempts against the real bubblewrap sandbox: each must end bounded, structured and
without a trace on the host. Every case has a short timeout."""

from __future__ import annotations

import os
import platform
import secrets
import signal
import socket
import subprocess
import threading
import time

import pytest

from astraflow.sandbox import Sandbox, SandboxConfig

from .conftest import none_left, sandbox_processes

LIMITS = dict(timeout_s=3.0, cpu_s=2.0, memory_mb=256, max_processes=16, max_output_bytes=4096)


@pytest.fixture(scope="module")
def sb():
    return Sandbox(SandboxConfig(**LIMITS))


def test_an_infinite_loop_times_out(sb):
    """Killed by the host at the call's 1 s wall-clock deadline (bubblewrap ends by SIGKILL: a negative
    exit code), which comes before the loop can spend its 2 s of CPU (the runner's 128 + SIGXCPU)."""
    r = sb.run("while True:\n    pass\n", timeout_s=1.0)
    assert r.status == "timeout" and r.exit_code == -signal.SIGKILL, (r.status, r.exit_code)


def test_the_cpu_limit_stops_a_spinning_program_before_the_wall_clock():
    """The runner's exit code says the CPU limit ended it; the host's kill at the 20 s deadline
    would read -SIGKILL."""
    r = Sandbox(SandboxConfig(**{**LIMITS, "cpu_s": 1.0, "timeout_s": 20})).run("while True:\n    pass\n")
    assert r.status == "timeout" and r.exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL), r.exit_code


def test_sleeping_past_the_deadline_times_out():
    """The call's 1 s deadline, not the sandbox's 120 s one, ends a program that would wake and
    print after 30 s."""
    r = Sandbox(SandboxConfig(**{**LIMITS, "timeout_s": 120})).run(
        "import time\ntime.sleep(30)\nprint('woke')\n", timeout_s=1.0)
    assert r.status == "timeout" and r.exit_code == -signal.SIGKILL and "woke" not in r.stdout, r


def test_a_fork_bomb_stays_under_the_process_limit(sb):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    token = "/in/runner.py"  # in the argv of bubblewrap and of every process of the execution
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(sandbox_processes(token, parent=os.getpid())))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = sb.run(bomb, timeout_s=1.5)
    finally:
        done.set()
        watcher.join()
    assert r.status == "timeout"
    # the limit counts the sandbox's init and the program's processes; bubblewrap's own
    # process outside the namespaces comes on top
    assert 0 < peak[0] <= LIMITS["max_processes"] + 1, peak[0]
    assert none_left(token), sandbox_processes(token)


def test_fork_fails_past_the_limit(sb):
    prog = ("import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
            "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError as err:\n"
            "    print('refused after', n, type(err).__name__)\n")
    r = sb.run(prog, timeout_s=3)
    assert "refused after" in r.stdout and int(r.stdout.split()[2]) < LIMITS["max_processes"]


@pytest.mark.parametrize("prog", ["x = bytearray(1 << 30)\n",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))\n"])
def test_a_memory_hog_gets_status_memory(sb, prog):
    r = sb.run(prog)
    assert r.status == "memory", (r.status, r.stderr[-300:])


def test_huge_output_is_cut_and_killed(sb):
    r = sb.run("while True:\n    print('x' * 1000)\n")
    assert r.status == "output_limit"
    assert len(r.stdout.encode()) + len(r.stderr.encode()) <= LIMITS["max_output_bytes"]


def test_files_outside_the_scratch_directory_are_not_there(sb, tmp_path, monkeypatch):
    secret = secrets.token_hex(8)
    run_dir, home = tmp_path / "run", tmp_path / "home"
    (run_dir).mkdir()
    (run_dir / "config.yaml").write_text(secret)
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(secret)
    monkeypatch.setenv("HOME", str(home))
    paths = [str(run_dir / "config.yaml"), str(home / ".ssh" / "id_rsa"), "/etc/shadow",
             "/etc/passwd", "/root/.bashrc", os.path.expanduser("~/.ssh/id_rsa")]
    prog = ("import os\nfor p in %r:\n    try:\n        print('READ', p, open(p).read())\n"
            "    except OSError as err:\n        print('DENIED', p, type(err).__name__)\n"
            "print(sorted(os.listdir('/')))\n" % (paths,))
    r = sb.run(prog)
    assert r.status == "ok" and secret not in r.stdout and "READ" not in r.stdout, r.stdout
    assert "'root'" not in r.stdout and "'home'" not in r.stdout and "'etc'" in r.stdout


def test_writes_outside_the_scratch_directory_do_not_reach_the_host(sb, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    name = "escape-" + secrets.token_hex(6)
    targets = [str(run_dir / name), f"/tmp/{name}", f"/usr/{name}", f"/in/{name}", f"/{name}"]
    prog = ("for p in %r:\n    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
            "    except OSError as err:\n        print('DENIED', p, type(err).__name__)\n"
            "open('scratch-file', 'w').write('mine')\nprint(open('scratch-file').read())\n" % (targets,))
    r = sb.run(prog)
    assert r.status == "ok" and r.stdout.rstrip().endswith("mine"), r.stdout
    for t in targets:
        assert not os.path.exists(t), t
    assert not os.path.exists(os.path.join(os.getcwd(), "scratch-file"))


def test_the_nodes_environment_is_not_visible(sb, monkeypatch):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("ASTRAFLOW_TEST_SECRET", secret)
    prog = ("import os\nprint(dict(os.environ))\nfor p in ('/proc/self/environ', '/proc/1/environ'):\n"
            "    try:\n        print(open(p, 'rb').read())\n    except OSError as err:\n        print(err)\n")
    r = sb.run(prog)
    assert r.status == "ok" and secret not in r.stdout and "ASTRAFLOW_TEST_SECRET" not in r.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the system call numbers below are x86_64's")
def test_the_nodes_keyring_is_out_of_reach(sb):
    """The execution starts in the session keyring of the thread that runs it: the keys there
    (Kerberos tickets, AFS tokens) must not be readable, nor any keyring call possible."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    secret, found = secrets.token_hex(8), {}

    def run_in_a_keyring_of_its_own():  # credentials are per thread: the test process's are untouched
        assert libc.syscall(250, 1, None) > 0  # keyctl(KEYCTL_JOIN_SESSION_KEYRING): a new anonymous one
        assert libc.syscall(248, b"user", b"astraflow-test", secret.encode(), 16, -3) > 0  # add_key to it
        found["r"] = sb.run("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                            "buf = ctypes.create_string_buffer(64)\n"
                            "key = libc.syscall(250, 10, -3, b'user', b'astraflow-test', 0)\n"  # KEYCTL_SEARCH
                            "print('search', key, ctypes.get_errno())\n"
                            "print('read', libc.syscall(250, 11, key, buf, 64), buf.value)\n"  # KEYCTL_READ
                            "print('session', libc.syscall(250, 0, -3, 0), ctypes.get_errno())\n"
                            # bubblewrap's init (pid 1) holds the keyring without the filter: no ptrace
                            "print('ptrace', libc.syscall(101, 16, 1, 0, 0), ctypes.get_errno())\n"
                            # nor a watchpoint on another process of the execution (perf_event_open)
                            "print('perf', libc.syscall(298, None, 1, -1, -1, 0), ctypes.get_errno())\n")

    thread = threading.Thread(target=run_in_a_keyring_of_its_own)
    thread.start()
    thread.join()
    r = found["r"]
    assert r.status == "ok" and secret not in r.stdout, r
    assert "search -1 1\n" in r.stdout and "session -1 1\n" in r.stdout, r.stdout  # EPERM
    assert "ptrace -1 1\n" in r.stdout and "perf -1 1\n" in r.stdout, r.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the system call numbers below are x86_64's")
def test_memory_held_in_system_v_shared_memory_is_refused(sb):
    """A System V segment outlives every mapping of it, outside any address space: a process could
    attach, fill and detach one after another, holding without bound. shmget fails with EPERM."""
    prog = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "held = 0\nfor _ in range(8):\n"
            "    sid = libc.syscall(29, 0, 16 << 20, 0o1600)\n"  # shmget(IPC_PRIVATE, IPC_CREAT | 0600)
            "    if sid < 0:\n        print('shmget', sid, ctypes.get_errno())\n        break\n"
            "    p = libc.shmat(sid, None, 0)\n    ctypes.memset(p, 1, 16 << 20)\n"
            "    libc.shmdt(ctypes.c_void_p(p))\n    held += 16\nprint('held', held)\n")
    r = Sandbox(SandboxConfig(**{**LIMITS, "memory_mb": 64})).run(prog)
    assert r.status == "ok", r.stderr
    assert "shmget -1 1\n" in r.stdout and "held 0\n" in r.stdout, r.stdout  # EPERM: nothing held


def test_no_network_not_even_the_hosts_loopback(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    prog = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=1)\n"
            "    print('CONNECTED')\nexcept OSError as err:\n    print('REFUSED', err)\n" % port)
    try:
        r = sb.run(prog)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert r.status == "ok" and "REFUSED" in r.stdout and "CONNECTED" not in r.stdout


def test_signals_cannot_reach_the_parent_or_host_processes(sb):
    bystander = subprocess.Popen(["sleep", "30"], **({"user": 65534} if os.geteuid() == 0 else {}))
    try:
        prog = ("import os, signal\nfor pid in [os.getppid(), %d, %d] + list(range(1, 4096)):\n"
                "    if pid != os.getpid():\n        try:\n            os.kill(pid, signal.SIGKILL)\n"
                "        except OSError:\n            pass\nprint('still here')\n" % (os.getpid(), bystander.pid))
        r = sb.run(prog)
        assert r.status in ("ok", "failure", "sandbox_error"), r  # it ended: not killed at its deadline
        assert bystander.poll() is None  # a host process of the sandbox's own uid survives
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("ending", ["", "import time\ntime.sleep(60)\n"])
def test_a_daemon_does_not_outlive_the_execution(sb, ending):
    token = "daemon-" + secrets.token_hex(6)
    prog = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        fd = os.open('/dev/null', os.O_RDWR)\n        for i in (0, 1, 2):\n            os.dup2(fd, i)\n"
            "        os.execv(sys.executable, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.05)', %r])\n"
            "    os._exit(0)\nimport time\ntime.sleep(0.3)\n" % token) + ending
    r = sb.run(prog, timeout_s=1.5)
    assert r.status == ("ok" if not ending else "timeout"), (r.status, r.stderr)
    assert none_left(token), sandbox_processes(token)


def test_a_program_that_is_not_utf8_fails(sb):
    r = sb.run(b"print('caf\xe9')\n\xff\xfe")
    assert r.status == "failure" and "UTF-8" in r.stderr


@pytest.mark.parametrize("surrogate", ["\ud800", "\udc80"])
def test_a_program_with_a_lone_surrogate_fails_as_not_utf8(sb, surrogate):
    """A str that is no UTF-8 text (a lone surrogate) is the program's failure, not an exception out of run."""
    r = sb.run(f"def f():\n    return '{surrogate}'\n", "def test_f():\n    assert f()\n")
    assert r.status == "failure" and "UTF-8" in r.stderr and not r.tests[0].passed, r


def test_a_program_that_is_not_python_fails(sb):
    r = sb.run("def f(:\n    return\n", "def test_f():\n    assert f()\n")
    assert r.status == "failure" and "SyntaxError" in r.stderr
    assert [(t.name, t.passed, t.error) for t in r.tests] == [("test_f", False, "not run: the program failed")]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGXCPU"])
def test_a_program_that_kills_itself_early_fails_rather_than_timing_out(sb, sig):
    """Killed by a signal of the CPU limit long before it could have used its CPU time: not a timeout."""
    r = sb.run(f"import os, signal\nos.kill(os.getpid(), signal.{sig})\n", "def test_a():\n    pass\n")
    assert r.status == "failure" and r.exit_code == 128 + getattr(signal, sig), (r.status, r.exit_code)


def test_memory_held_in_files_is_bounded(sb):
    """A memfd lives outside the address-space limit and the tmpfs sizes: the file-size limit
    bounds each file, the descriptor limit how many a process holds."""
    prog = ("import os\nfd = os.memfd_create('x')\nchunk = b'x' * (1 << 20)\nn = 0\ntry:\n"
            "    for _ in range(96):\n        os.write(fd, chunk)\n        n += 1\nexcept OSError as err:\n"
            "    print('stopped at', n, err.errno)\nfds = []\ntry:\n    for _ in range(10000):\n"
            "        fds.append(os.memfd_create('y'))\nexcept OSError as err:\n"
            "    print('files', len(fds), err.errno)\n")
    r = Sandbox(SandboxConfig(**{**LIMITS, "memory_mb": 64, "scratch_mb": 32})).run(prog)
    assert r.status == "ok", r.stderr
    assert "stopped at 32 27" in r.stdout and "files" in r.stdout, r.stdout  # EFBIG past scratch_mb
    assert int(r.stdout.split("files")[1].split()[0]) < 64, r.stdout
