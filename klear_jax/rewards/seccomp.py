"""The sandbox's seccomp filter: classic BPF, generated here, handed to `bwrap --seccomp FD`.

It refuses the kernel surface a scored program never needs and an escape would use:

    new namespaces      unshare, setns, clone with any CLONE_NEW* flag; clone3 gets ENOSYS
                        so glibc falls back to clone, whose flags a filter can see (as Flatpak)
    mounts              mount, umount2, pivot_root, chroot and the new mount API
                        (fsopen, fsconfig, fsmount, fspick, move_mount, open_tree[_attr],
                        mount_setattr)
    keyrings            add_key, request_key, keyctl
    io_uring, userfaultfd, bpf, perf_event_open
    other processes     ptrace, process_vm_readv/writev, pidfd_getfd, kcmp
    the machine         kexec_load, kexec_file_load, init/finit/delete_module, reboot,
                        swapon/off, acct, quotactl, syslog, open_by_handle_at,
                        name_to_handle_at, lookup_dcookie

Everything else is allowed. Refused calls fail with EPERM (ENOSYS for clone3), so a
program sees an ordinary error; a syscall from another ABI (i386 or x32 on x86_64) kills
the process, since its numbers differ from the ones checked here.

    program = filter_bytes()            # for the host's arch (x86_64 or aarch64)
"""
from __future__ import annotations

import errno
import platform
import struct

# Syscall numbers: name -> (x86_64, aarch64) (asm/unistd_64.h, asm-generic/unistd.h).
DENY = {
    "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "userfaultfd": (323, 282), "bpf": (321, 280), "perf_event_open": (298, 241),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89), "quotactl": (179, 60),
    "syslog": (103, 116), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "lookup_dcookie": (212, 18),
}
CLONE = (56, 220)          # flags are the first argument on both arches
CLONE3 = (435, 435)
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (NEWTIME, 0x80,
# is only valid for clone3/unshare: in clone's flags it is part of the exit signal).
CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000
ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}   # AUDIT_ARCH_*
X32_BIT = 0x40000000

# Classic BPF opcodes and seccomp return values.
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_KILL_PROCESS, _ALLOW = 0x80000000, 0x7FFF0000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16      # struct seccomp_data (little endian)


def _errno(e: int) -> int:
    return 0x00050000 | e


def _ins(code, k, jt=0, jf=0):
    return (code, jt, jf, k)


def program(arch: str | None = None) -> list[tuple]:
    """The filter as (code, jt, jf, k) instructions for `arch` (default: this host's)."""
    arch = arch or platform.machine()
    if arch == "arm64":
        arch = "aarch64"
    if arch not in ARCHES:
        raise ValueError(f"seccomp filter: unsupported architecture {arch!r} "
                         f"(supported: {', '.join(ARCHES)})")
    col, audit = ARCHES[arch]
    eperm, ret_allow = _ins(_RET_K, _errno(errno.EPERM)), _ins(_RET_K, _ALLOW)
    p = [_ins(_LD_W_ABS, _OFF_ARCH),
         _ins(_JEQ_K, audit, 1, 0),
         _ins(_RET_K, _KILL_PROCESS),
         _ins(_LD_W_ABS, _OFF_NR)]
    if arch == "x86_64":      # x32 syscalls alias the 64-bit ones with bit 30 set
        p += [_ins(_JGE_K, X32_BIT, 0, 1), _ins(_RET_K, _KILL_PROCESS)]
    for nr in sorted({v[col] for v in DENY.values()}):
        p += [_ins(_JEQ_K, nr, 0, 1), eperm]
    p += [_ins(_JEQ_K, CLONE3[col], 0, 1), _ins(_RET_K, _errno(errno.ENOSYS)),
          _ins(_JEQ_K, CLONE[col], 0, 3),
          _ins(_LD_W_ABS, _OFF_ARG0),
          _ins(_JSET_K, CLONE_NS_FLAGS, 0, 1), eperm,
          ret_allow]
    return p


def filter_bytes(arch: str | None = None) -> bytes:
    """The filter as `struct sock_filter[]` bytes, what `bwrap --seccomp FD` reads."""
    return b"".join(struct.pack("=HBBI", *ins) for ins in program(arch))
