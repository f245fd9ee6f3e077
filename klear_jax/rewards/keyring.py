"""A fresh, empty session keyring for every sandbox run, without touching the trainer's.

A child inherits its parent's session keyring, and a process possesses every key in it
(whatever its uid), so a sandbox started straight from the trainer could read the
trainer's tokens. The session keyring is part of a thread's credentials: `call` runs a
whole sandbox run (start, supervise, reap) in a throwaway thread that first joins a new
anonymous session keyring, so the child (and everything it runs) holds only that empty
keyring while every trainer thread keeps its own. The thread lives until the child is
reaped: bwrap's --die-with-parent is a parent-death signal, which fires when the THREAD
that started the child exits. The seccomp filter also refuses all keyring calls; this
keeps the sandbox away from the trainer's keys even so.

add_key / read_key are what the self-check and the tests use to plant and look for a key.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading

_NR = {"x86_64": {"add_key": 248, "keyctl": 250}, "aarch64": {"add_key": 217, "keyctl": 219}}
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_READ = 0, 1, 11
KEY_SPEC_SESSION_KEYRING = -3

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(name: str, *args) -> int:
    arch = platform.machine()
    nr = _NR.get("aarch64" if arch == "arm64" else arch)
    if nr is None:
        raise OSError(f"keyring: unsupported architecture {arch!r}")
    r = _libc.syscall(ctypes.c_long(nr[name]), *args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")
    return r


def join_fresh_session_keyring() -> int:
    """The calling THREAD joins a new anonymous session keyring; returns its serial."""
    return _syscall("keyctl", ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))


def session_keyring_id() -> int:
    return _syscall("keyctl", ctypes.c_long(KEYCTL_GET_KEYRING_ID),
                    ctypes.c_long(KEY_SPEC_SESSION_KEYRING), ctypes.c_long(1))


def add_key(description: str, payload: bytes) -> int:
    """Adds a "user" key to the calling thread's session keyring; returns its serial."""
    return _syscall("add_key", b"user", description.encode(), payload,
                    ctypes.c_size_t(len(payload)), ctypes.c_long(KEY_SPEC_SESSION_KEYRING))


def read_key(serial: int) -> bytes:
    buf = ctypes.create_string_buffer(4096)
    n = _syscall("keyctl", ctypes.c_long(KEYCTL_READ), ctypes.c_long(serial), buf,
                 ctypes.c_long(len(buf)))
    return buf.raw[:min(n, len(buf))]


def call(fn):
    """`fn()` called in a new thread holding a fresh, empty session keyring; returns what
    it returns, raises what it raises. Children must be reaped before `fn` returns."""
    out = {}

    def run():
        try:
            join_fresh_session_keyring()
            out["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="sbx-spawn", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
