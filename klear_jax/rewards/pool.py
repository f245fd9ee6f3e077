"""A pool of worker processes with a hard deadline per item.

Used for checks that may hang or crash the interpreter (math-verify runs sympy under
signal alarms, which only work in a process's main thread and do not always fire).
Each worker runs the function in its main thread; the parent never blocks on a worker
longer than the item's deadline: a late worker is SIGKILLed and replaced, a crashed one is
replaced, and the item gets `default`. Workers are fresh interpreters (never fork: JAX
in the parent does not survive it) that import the function once (and call its
``worker_warm_up`` attribute, when it has one), then report ready before they get work, so
the import time never counts against an item's deadline.

    pool = DeadlinePool("klear_jax.rewards.math:verify_answer", num_workers=2, deadline_s=10)
    pool.map([(response, gold), ...], default=False) -> [bool, ...]
    pool.close()

`map` is thread-safe (callers are served one batch at a time).
"""
from __future__ import annotations

import atexit
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait as mp_wait

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker_main(conn, fn_path: str) -> None:
    fn = _resolve(fn_path)
    warm_up = getattr(fn, "worker_warm_up", None)
    if warm_up is not None:  # lazy imports / first-call caches, before the deadline clock runs
        warm_up()
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        try:
            conn.send(("ok", fn(*msg)))
        except Exception as e:  # a failing check is a result, not a dead worker
            conn.send(("err", f"{type(e).__name__}: {e}"))


class Closing:
    """``with obj:`` closes ``obj`` on exit; subclasses define ``close()``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SharedPerConfig:
    """One long-lived scorer per (hashable) config, built on first use and closed at
    interpreter exit: what ``math_reward`` / ``code_reward`` use so single calls don't pay
    pool start-up each time."""

    def __init__(self, factory, default_config):
        self._factory, self._default_config = factory, default_config
        self._scorers: dict = {}
        self._lock = threading.Lock()

    def get(self, cfg=None):
        cfg = cfg or self._default_config()
        with self._lock:
            if cfg not in self._scorers:
                if not self._scorers:
                    atexit.register(self.close_all)
                self._scorers[cfg] = self._factory(cfg)
            return self._scorers[cfg]

    def close_all(self) -> None:
        with self._lock:
            for s in self._scorers.values():
                s.close()
            self._scorers.clear()


class _Worker:
    """A fresh interpreter (`python -c`, not multiprocessing's spawn, so a parent run from
    stdin or a notebook needs no __main__ guard) talking over a socketpair Connection."""

    def __init__(self, fn_path: str):
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PKG_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        code = (f"from multiprocessing.connection import Connection\n"
                f"from klear_jax.rewards.pool import _worker_main\n"
                f"_worker_main(Connection({fd}), {fn_path!r})\n")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(fd,), env=env,
                                         stdin=subprocess.DEVNULL)
        finally:
            child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.ready = False
        self.started = time.monotonic()
        self.item = None        # (index, deadline) while busy

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


class DeadlinePool(Closing):
    def __init__(self, fn_path: str, num_workers: int = 2, deadline_s: float = 10.0,
                 start_timeout_s: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"DeadlinePool num_workers must be >= 1, got {num_workers}")
        _resolve(fn_path)  # fail here, with the name, rather than in every worker
        self.fn_path = fn_path
        self.num_workers = num_workers
        self.deadline_s = deadline_s
        self.start_timeout_s = start_timeout_s
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.stats = {"timeouts": 0, "crashes": 0, "errors": 0}

    def _spawn(self) -> _Worker:
        w = _Worker(self.fn_path)
        self._workers.append(w)
        return w

    def _replace(self, w: _Worker) -> None:
        self._workers.remove(w)
        w.kill()
        self._spawn()

    def map(self, items: list[tuple], default=None, deadline_s: float | None = None) -> list:
        """fn(*item) for every item, in order; `default` for items that raise, crash their
        worker or pass their deadline."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        results = [default] * len(items)
        with self._lock:
            while len(self._workers) < self.num_workers:
                self._spawn()
            pending = list(range(len(items)))[::-1]
            done = 0
            while done < len(items):
                now = time.monotonic()
                for w in list(self._workers):
                    if w.ready and w.item is None and pending:
                        i = pending.pop()
                        try:
                            w.conn.send(items[i])
                            w.item = (i, now + deadline_s)
                        except (OSError, ValueError):
                            pending.append(i)
                            self.stats["crashes"] += 1
                            self._replace(w)
                live = [w for w in self._workers if not w.ready or w.item is not None]
                timeouts = [w.item[1] for w in live if w.item is not None]
                timeouts += [w.started + self.start_timeout_s for w in live if not w.ready]
                wait_s = max(0.0, min(timeouts) - time.monotonic()) if timeouts else 0.1
                ready = mp_wait([w.conn for w in live], timeout=wait_s)
                by_conn = {w.conn: w for w in live}
                for conn in ready:
                    w = by_conn[conn]
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        if w.item is not None:
                            done += 1
                        elif not w.ready:
                            raise RuntimeError(f"pool worker for {self.fn_path} died at start "
                                               f"(exit code {w.proc.poll()})")
                        self.stats["crashes"] += 1
                        self._replace(w)
                        continue
                    if kind == "ready":
                        w.ready = True
                        continue
                    i, _ = w.item
                    w.item = None
                    done += 1
                    if kind == "ok":
                        results[i] = value
                    else:
                        self.stats["errors"] += 1
                now = time.monotonic()
                for w in list(self._workers):
                    if w.item is not None and now >= w.item[1]:
                        done += 1
                        self.stats["timeouts"] += 1
                        self._replace(w)
                    elif not w.ready and now >= w.started + self.start_timeout_s:
                        raise RuntimeError(f"pool worker for {self.fn_path} did not start "
                                           f"within {self.start_timeout_s} s")
        return results

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                try:
                    w.conn.send(None)
                except (OSError, ValueError):
                    pass
            for w in self._workers:
                try:
                    w.proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
                w.kill()
            self._workers = []
