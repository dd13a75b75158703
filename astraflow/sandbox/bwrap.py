"""The bubblewrap command line of one execution, and the check that bubblewrap works here.

Only what the interpreter needs is bound, read-only: the system directories, a few files of
/etc, the interpreter and its prefix's ``lib`` when it lives elsewhere (never the whole prefix:
a Python installed with ``--prefix=$HOME`` would show the home directory), and the execution's
input directory. Everything else (the run directory, home directories, /root, /etc/shadow, other
processes, the network) does not exist inside.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

from .config import SandboxConfig

FIX = "install bubblewrap (apt-get install -y bubblewrap), or set sandbox.bwrap to its path"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
             "/etc/localtime", f"/etc/python{sys.version_info.major}.{sys.version_info.minor}",
             "/etc/python3")
# the sandbox's own directories, named so as not to hide where a site installs Python (/scratch, /work)
IN_DIR, SCRATCH = "/in", "/sandbox"
ENV = {"HOME": SCRATCH, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
       "TMPDIR": "/tmp", "PYTHONIOENCODING": "utf-8"}

# bubblewrap itself starts with this, not the node's environment: its init process stays
# pid 1 inside (were /proc mounted, its environment would be readable)
HOST_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


# no /proc (nothing of any process to read, the sandbox's own included) and only these devices,
# not bubblewrap's whole --dev tree: fewer mounts, a smaller surface, a faster start
DEVICES = ("--dev-bind", "/dev/null", "/dev/null", "--ro-bind", "/dev/zero", "/dev/zero",
           "--ro-bind", "/dev/urandom", "/dev/urandom", "--ro-bind", "/dev/random", "/dev/random")


# system calls refused inside, by machine, with its AUDIT_ARCH_*. The keyring calls (add_key,
# request_key, keyctl): an execution starts in the node's session keyring, whose keys (Kerberos
# tickets, AFS tokens) it would possess and so could read, and request_key has the host run
# /sbin/request-key for it. ptrace, process_vm_readv/writev, pidfd_getfd: bubblewrap's init
# (pid 1 inside, the same user) runs without this filter and holds that keyring.
# perf_event_open: a program could watch the memory of the isolated tests' judge (the same user;
# a watchpoint on a value the tests load would tell it the expected answer).
# shmget (and ppc64le's ipc, which multiplexes it): a System V segment outlives its mappings, so a
# process attaching, filling and detaching one after another would hold memory without bound.
# bpf: where the node lets users make maps, their memory is outside every limit here.
REFUSED_SYSCALLS = {"x86_64": (0xC000003E, (248, 249, 250, 101, 310, 311, 438, 298, 29, 321)),
                    "aarch64": (0xC00000B7, (217, 218, 219, 117, 270, 271, 438, 241, 194, 280)),
                    "ppc64le": (0xC0000015, (269, 270, 271, 26, 351, 352, 438, 319, 395, 117, 361))}


def seccomp_filter(machine: str) -> bytes | None:
    """The BPF program bwrap's ``--seccomp`` installs: ``REFUSED_SYSCALLS`` and every call of another
    ABI (32-bit compat, x32) fail with EPERM; None on a machine not in ``REFUSED_SYSCALLS``."""
    if machine not in REFUSED_SYSCALLS:
        return None
    arch, calls = REFUSED_SYSCALLS[machine]
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    refuse, allow = 0x00050000 | errno.EPERM, 0x7FFF0000  # SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW

    def op(code: int, k: int, jt: int = 0) -> bytes:  # struct sock_filter
        return struct.pack("HBBI", code, jt, 0, k)

    # x86_64's x32 calls carry the native arch with bit 30 set in nr, numbered apart (x32's ptrace
    # is 521): refused whole, as the other ABIs are, not matched against the native numbers
    prog = [op(ld, 4), op(jeq, arch, 1), op(ret, refuse),  # seccomp_data.arch
            op(ld, 0), op(jset, 0x40000000, len(calls) + 1)]  # seccomp_data.nr
    prog += [op(jeq, nr, len(calls) - i) for i, nr in enumerate(calls)]
    return b"".join(prog + [op(ret, allow), op(ret, refuse)])


SECCOMP_FILTER = seccomp_filter(platform.machine())


def seccomp_fd() -> int | None:
    """The read end of a pipe holding ``SECCOMP_FILTER`` for ``--seccomp`` (bubblewrap reads it to
    the end and closes it); the caller passes it to bubblewrap and closes it. None without a filter."""
    if SECCOMP_FILTER is None:
        return None
    r, w = os.pipe()
    os.write(w, SECCOMP_FILTER)
    os.close(w)
    return r


class SandboxUnavailable(RuntimeError):
    """Bubblewrap is missing or cannot create its namespaces here; the message names the fix."""


def interpreter(cfg: SandboxConfig) -> str:
    """The real path of the Python run inside: the configured one, else the machine's base
    python3 (never a venv: its packages are not the sandbox's)."""
    if cfg.interpreter:
        found = shutil.which(cfg.interpreter) or cfg.interpreter
    elif Path("/usr/bin/python3").exists():
        found = "/usr/bin/python3"
    else:
        found = str(Path(sys.base_prefix) / "bin" / "python3")
    real = os.path.realpath(found)
    if not os.access(real, os.X_OK):
        raise SandboxUnavailable(f"sandbox interpreter {found} is not an executable: "
                                 "set sandbox.interpreter to a python3 of this machine")
    return real


def bwrap_path(cfg: SandboxConfig) -> str:
    found = shutil.which(cfg.bwrap)
    if not found and os.sep in cfg.bwrap and os.path.isfile(cfg.bwrap):  # there, but not a program it may run
        raise SandboxUnavailable(f"bubblewrap ({cfg.bwrap}) is not executable: give the path of the bwrap program, "
                                 f"or make it executable (chmod +x {cfg.bwrap})")
    if not found:
        raise SandboxUnavailable(f"bubblewrap ({cfg.bwrap}) not found: {FIX}")
    return found


def stage_etc(root: Path) -> str | None:
    """A directory under ``root`` holding copies of ``ETC_FILES`` (what binding each would show:
    a link at their top followed, links inside a directory kept), readable by all, bound as the
    sandbox's /etc in one mount instead of one per file. Named by its content: processes share
    it, a changed /etc gets a new one, and a damaged copy is replaced. None where it cannot be
    made (each file is bound then)."""
    for old in root.glob(".etc-*"):  # a crashed process's half-made copy
        with contextlib.suppress(OSError):
            if time.time() - old.lstat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
    work = root / f".etc-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.mkdir(work, 0o755)
        for f in ETC_FILES:
            if os.path.isdir(f):
                shutil.copytree(f, work / Path(f).name, symlinks=True)
            elif os.path.isfile(f):
                shutil.copyfile(f, work / Path(f).name)
        digest = _digest(work, readable=True)
        final = root / f"etc-{digest}"
        if final.is_dir() and _digest(final) != digest:  # pruned or changed since it was made
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(work, final)
        except OSError:  # another process made it first (the same content)
            shutil.rmtree(work, ignore_errors=True)
        return str(final) if final.is_dir() and _digest(final) == digest else None
    except (OSError, UnicodeError, ValueError):
        shutil.rmtree(work, ignore_errors=True)
        return None


def _digest(top: Path, readable: bool = False) -> str:
    """The names, link targets and file contents under ``top``; ``readable``: made readable by
    all on the way (directories 0755, files 0644)."""
    digest = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(top)):
        if readable:
            os.chmod(d, 0o755)
        for name in sorted(dirs + files):
            path = os.path.join(d, name)
            digest.update(os.path.relpath(path, top).encode() + b"\0")
            if os.path.islink(path):
                digest.update(b"->" + os.readlink(path).encode())
            elif os.path.isfile(path):
                if readable:
                    os.chmod(path, 0o644)
                with open(path, "rb") as fh:
                    digest.update(fh.read())
    return digest.hexdigest()[:24]


def _binds(python: str, etc: str | None = None) -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    if etc is not None:
        args += ["--ro-bind", etc, "/etc"]
    for f in ETC_FILES if etc is None else ():
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    if not any(python.startswith(d + "/") for d in SYSTEM_DIRS):
        args += ["--ro-bind", python, python]  # <prefix>/bin/python3.X, and its standard library:
        for lib in prefix_libs(python):
            args += ["--ro-bind", lib, lib]
    return args


def prefix_libs(python: str) -> list[str]:
    """The ``lib`` directories of the prefix of an interpreter outside the system directories
    (its standard library, its shared libraries); ``SandboxUnavailable`` naming the fix when it is
    no Python prefix, or where the sandbox's own directories would hide it."""
    if python.startswith(("/tmp/", SCRATCH + "/", IN_DIR + "/")):
        top = "/" + python.split("/")[1]
        raise SandboxUnavailable(f"sandbox interpreter {python} is under {top}, which the sandbox replaces with its "
                                 "own: set sandbox.interpreter (or --interpreter) to a python3 installed elsewhere")
    prefix = Path(python).parents[1]
    libs = [str(prefix / d) for d in ("lib", "lib64") if (prefix / d).is_dir() and not (prefix / d).is_symlink()]
    if not any(Path(lib).glob("python3*/os.py") for lib in libs):
        raise SandboxUnavailable(f"sandbox interpreter {python}: no standard library under {prefix}/lib "
                                 "(lib/python3.X/os.py), so it is not the bin/ of a Python installation: set "
                                 "sandbox.interpreter (or --interpreter) to the python3 of one")
    return libs


def sandbox_args(cfg: SandboxConfig, python: str, etc: str | None = None) -> list[str]:
    """bwrap and every option of an execution's sandbox but its seccomp filter and input
    directory: what ``command`` runs and what ``probe`` checks, so an option this bubblewrap
    lacks fails the check. The same for every execution (a ``Sandbox`` builds it once).
    ``etc``: from ``stage_etc``."""
    args = [bwrap_path(cfg), "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    for k, v in ENV.items():
        args += ["--setenv", k, v]
    args += _binds(python, etc)
    args += [*DEVICES,
             "--size", str(cfg.scratch_mb << 20), "--perms", "1777", "--tmpfs", SCRATCH,
             "--size", str(cfg.scratch_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
    return args


def _seccomp(filter_fd: int | None) -> list[str]:
    """bwrap's option installing the filter read from ``filter_fd`` (from ``seccomp_fd``)."""
    return [] if filter_fd is None else ["--seccomp", str(filter_fd)]


def command(cfg: SandboxConfig, base: list[str], python: str, in_dir: str, result_fd: int,
            test_names: list[str], filter_fd: int | None = None) -> list[str]:
    """bwrap argv running the runner on ``in_dir``; the runner reports on ``result_fd``.
    ``base``: ``sandbox_args(cfg, python)``."""
    return [*base, *_seccomp(filter_fd), "--ro-bind", in_dir, IN_DIR, "--chdir", SCRATCH,
            python, "-I", "-S", "-B", f"{IN_DIR}/runner.py", str(result_fd), str(cfg.cpu_s),
            str(cfg.memory_mb << 20), str(cfg.max_processes), str(file_size_limit(cfg)),
            "isolated" if cfg.isolate_tests else "shared", *test_names]


def file_size_limit(cfg: SandboxConfig) -> int:
    """Bytes one file may hold (RLIMIT_FSIZE): a memfd lives in memory outside the address-space
    limit and the tmpfs sizes, so no file may exceed the scratch size or the memory limit."""
    return min(cfg.scratch_mb, cfg.memory_mb) << 20


def sandbox_id(cfg: SandboxConfig) -> int | None:
    """The uid (and gid) executions run as: as root, ``sandbox_uid`` (the kernel does not limit
    root's process count); otherwise None, ourselves."""
    return cfg.sandbox_uid if os.geteuid() == 0 else None


def launcher(cfg: SandboxConfig) -> tuple[list[str], dict]:
    """(argv prefix, Popen keywords) that start bubblewrap as ``sandbox_id``. As root, through
    ``setpriv`` (util-linux) where it is installed: Popen may then start it with ``vfork``,
    while asking Popen itself to change the user makes it copy this whole process (a node
    holding a model: tens of milliseconds per execution)."""
    uid = sandbox_id(cfg)
    if uid is None:
        return [], {}
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"], {}
    return [], {"user": uid, "group": uid, "extra_groups": []}


#: what the start-up probe runs in the sandbox: prints the interpreter's bytecode magic number
MAGIC_SCRIPT = "import importlib.util, sys; sys.stdout.write(importlib.util.MAGIC_NUMBER.hex())"


def probe(cfg: SandboxConfig, etc: str | None = None) -> str:
    """Raise SandboxUnavailable unless bubblewrap can start the interpreter in its namespaces;
    the interpreter's bytecode magic number (hex), which says whether code the host compiled
    runs there."""
    python = interpreter(cfg)
    filter_fd = None
    try:
        filter_fd = seccomp_fd()
        prefix, as_user = launcher(cfg)
        args = [*prefix, *sandbox_args(cfg, python, etc), *_seccomp(filter_fd), "--chdir", SCRATCH,
                python, "-I", "-S", "-c", MAGIC_SCRIPT]
        proc = subprocess.run(args, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, env=HOST_ENV,
                              pass_fds=() if filter_fd is None else (filter_fd,), **as_user)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SandboxUnavailable(f"bubblewrap could not run: {err}: {FIX}") from None
    finally:
        if filter_fd is not None:
            os.close(filter_fd)
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
        if "unknown option" in why[0].lower():
            raise SandboxUnavailable(f"this bubblewrap is too old for the sandbox's options ({why[0]}): it needs "
                                     f"bubblewrap 0.8 or newer; {FIX}")
        if any(m in why[0] for m in ("Can't find source path", "execvp")):  # it ran, the interpreter is out of reach
            raise SandboxUnavailable(
                f"bubblewrap cannot reach the sandbox interpreter {python} ({why[0]}): the sandbox's user must be "
                "able to read it and its installation (not under a private directory such as /root or a home "
                "directory of mode 0700): set sandbox.interpreter (or --interpreter) to such a python3, e.g. "
                "/usr/bin/python3")
        raise SandboxUnavailable(
            f"bubblewrap cannot create a sandbox here ({why[0]}): it needs unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0, "
            f"no AppArmor restriction on bwrap); {FIX}")
    return proc.stdout.decode("ascii", "replace").strip()
