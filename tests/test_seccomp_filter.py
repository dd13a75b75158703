"""The sandbox's seccomp program, run by a small classic-BPF interpreter over ``struct
seccomp_data`` (nr, arch): which calls of which ABI it refuses, on every machine it knows."""

from __future__ import annotations

import struct

import pytest

from astraflow.sandbox.bwrap import REFUSED_SYSCALLS, seccomp_filter

EPERM, ALLOW = 0x00050001, 0x7FFF0000
X32 = 0x40000000


def verdict(prog: bytes, nr: int, arch: int) -> int:
    """What the kernel would do with the call: the program's return value."""
    data = struct.pack("iI", nr, arch) + bytes(56)  # nr, arch, instruction_pointer, args
    insns = [struct.unpack("HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # BPF_LD|W|ABS
            acc = struct.unpack_from("I", data, k)[0]
        elif code == 0x06:  # BPF_RET|K
            return k
        elif code in (0x15, 0x25, 0x35, 0x45):  # BPF_JMP|JEQ, JGT, JGE, JSET (K)
            hit = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        elif code == 0x54:  # BPF_ALU|AND|K
            acc &= k
        else:
            raise AssertionError(f"opcode {code:#x} unknown to this interpreter")
        pc += 1


@pytest.mark.parametrize("machine", sorted(REFUSED_SYSCALLS))
def test_the_refused_calls_fail_and_the_others_run(machine):
    arch, calls = REFUSED_SYSCALLS[machine]
    prog = seccomp_filter(machine)
    for nr in calls:
        assert verdict(prog, nr, arch) == EPERM, nr
    for nr in set(range(500)) - set(calls):  # what CPython and the standard library call among them
        assert verdict(prog, nr, arch) == ALLOW, nr
    assert verdict(prog, calls[0], 0x40000003) == EPERM  # another ABI (i386's)
    assert verdict(prog, 0, 0x40000003) == EPERM


def test_no_x32_call_gets_through_on_x86_64():
    """x32's ptrace and process_vm_readv/writev are not the native numbers with bit 30 set."""
    arch, _ = REFUSED_SYSCALLS["x86_64"]
    prog = seccomp_filter("x86_64")
    for nr in (521, 539, 540, 101, 250, 0, 1):  # ptrace, process_vm_readv/writev (x32); the native ones
        assert verdict(prog, X32 | nr, arch) == EPERM, nr


def test_an_unknown_machine_has_no_filter():
    assert seccomp_filter("riscv64") is None


#: calls that hold memory outside every limit of the sandbox: shmget (and ppc64le's ipc), bpf
MEMORY_CALLS = {"x86_64": (29, 321), "aarch64": (194, 280), "ppc64le": (395, 117, 361)}


@pytest.mark.parametrize("machine", sorted(MEMORY_CALLS))
def test_calls_that_hold_memory_outside_the_limits_are_refused(machine):
    arch, _ = REFUSED_SYSCALLS[machine]
    prog = seccomp_filter(machine)
    for nr in MEMORY_CALLS[machine]:
        assert verdict(prog, nr, arch) == EPERM, nr
