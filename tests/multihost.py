"""Run a real entry point as N JAX processes on this machine, the way a pod runs it on N hosts.

    with MultiHost(cli_args("klear_jax.sft", "configs/sft_tiny.py", {"workdir": w}),
                   num_processes=2, devices_per_process=4, logs=tmp_path / "logs") as job:
        job.wait_until(has_lines(w + "/metrics.jsonl", 2))  # False if a process exited first
        job.signal(1, signal.SIGTERM)                  # one "host" only
        results = job.wait()                           # list[ProcResult], by process id

Every process gets what a pod host gets from its environment (docs/tpu.md maps the two):
KLEAR_COORDINATOR = 127.0.0.1:<free port> (process 0 serves the JAX coordination service
there, bound to loopback only), KLEAR_NUM_PROCESSES = N, KLEAR_PROCESS_ID = i, plus
JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_process>,
so 2 x 4 fake CPU devices form the same 8-device global mesh as the single-process tests.

No test can hang on it: each process runs in its own session (process group) and is killed
with its whole group (SIGKILL) when the overall ``timeout`` passes, when the ``with`` block
exits, or ``peer_grace`` seconds after another process of the job has died with an error
(JAX's own failure detection should have stopped it by then; ``ProcResult.killed`` says the
harness had to). On Linux each process also gets SIGKILL when the test process itself dies
(PR_SET_PDEATHSIG), so a killed pytest leaves nothing running. Outputs (stdout + stderr, one
file per process) are read back into ``ProcResult.output``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# `python -c LAUNCHER ARGS...`: asks Linux for SIGKILL when the test process dies
# (PR_SET_PDEATHSIG = 1; kept across exec), exits if it already has, then execs `python ARGS`.
# A preexec_fn would do the same but makes subprocess fork() a multithreaded (JAX) process.
LAUNCHER = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if os.getppid() != int(os.environ["MULTIHOST_PARENT_PID"]):
        os._exit(70)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def process_env(process_id: int, num_processes: int, coordinator: str, devices: int,
                extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of process ``process_id``: this one's, with the JAX / klear_jax
    multi-process variables set and any inherited fake-device count replaced."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags), KLEAR_COORDINATOR=coordinator,
               KLEAR_NUM_PROCESSES=str(num_processes), KLEAR_PROCESS_ID=str(process_id),
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


@dataclasses.dataclass
class ProcResult:
    """How one process of a job ended."""
    process_id: int
    returncode: int | None   # negative: killed by that signal
    output: str              # stdout and stderr, interleaved
    killed: bool             # True if the harness had to kill it (timeout / lost peer)
    exited_at: float | None  # time.monotonic() when it was seen gone

    def tail(self, n: int = 4000) -> str:
        return f"--- process {self.process_id} (rc={self.returncode}, killed={self.killed}):\n" \
               + self.output[-n:]


class MultiHost:
    """N processes of ``python ARGS...`` forming one JAX job over a loopback coordinator.

    args: after ``python`` (e.g. cli_args(...), or ["-c", CODE, ...]); logs: a directory for
    process<i>.log (default a new temporary one); env: added to every process's environment;
    timeout: seconds for the whole job; peer_grace: seconds the others may outlive a process
    that died with an error; cwd: the repository root by default (``-m klear_jax...``).
    """

    def __init__(self, args: Sequence[str], num_processes: int = 2, devices_per_process: int = 4,
                 logs: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 timeout: float = 900.0, peer_grace: float = 150.0, cwd: str | os.PathLike = ROOT):
        self.args, self.n = list(args), num_processes
        self.timeout, self.peer_grace = timeout, peer_grace
        self.logs = Path(logs) if logs else Path(tempfile.mkdtemp(prefix="multihost_"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self.coordinator = f"{LOOPBACK}:{free_port()}"
        self.procs: list[subprocess.Popen] = []
        self._files, self._killed, self._exited = [], set(), {}
        self.started = time.monotonic()
        try:
            for i in range(num_processes):
                f = open(self.logs / f"process{i}.log", "w")
                self._files.append(f)
                penv = process_env(i, num_processes, self.coordinator, devices_per_process, env)
                penv["MULTIHOST_PARENT_PID"] = str(os.getpid())
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", LAUNCHER, *self.args], cwd=cwd, stdout=f,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    env=penv))
        except BaseException:
            self.kill_all()
            raise

    # ------------------------------------------------------------------ control
    def __enter__(self) -> "MultiHost":
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def signal(self, process_id: int, sig: int) -> None:
        """Sends ``sig`` to one process (not its group: as the TPU runtime signals a host)."""
        self.procs[process_id].send_signal(sig)

    def kill_all(self) -> None:
        """SIGKILLs the group of every process still running, then reaps them."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self._killed.add(i)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover (SIGKILL cannot be ignored)
                pass
        for f in self._files:
            f.close()

    def _poll(self) -> None:
        """Notes exits; enforces the overall timeout and the grace after a peer's death."""
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if i not in self._exited and p.poll() is not None:
                self._exited[i] = now
        failed = [t for i, t in self._exited.items() if self.procs[i].returncode != 0]
        if now - self.started > self.timeout or (failed and now - min(failed) > self.peer_grace):
            self.kill_all()
            for i in range(self.n):
                self._exited.setdefault(i, now)

    def running(self) -> bool:
        self._poll()
        return len(self._exited) < self.n

    def wait_until(self, predicate: Callable[[], bool], poll: float = 0.2) -> bool:
        """Polls ``predicate`` until it holds (True) or any process has exited (False)."""
        while True:
            if predicate():
                return True
            self._poll()
            if self._exited:
                return False
            time.sleep(poll)

    def wait(self, poll: float = 0.2) -> list[ProcResult]:
        """Waits for every process (enforcing timeout / peer_grace); their results by id."""
        while self.running():
            time.sleep(poll)
        self.kill_all()  # closes the log files; nothing is left running
        return [ProcResult(i, p.returncode, (self.logs / f"process{i}.log").read_text(
            errors="replace"), i in self._killed, self._exited.get(i))
            for i, p in enumerate(self.procs)]


def cli_args(module: str, config: str, overrides: dict | None = None) -> list[str]:
    """``-m MODULE --config=CONFIG --config.KEY=VALUE...``: a klear_jax entry point's argv."""
    return ["-m", module, f"--config={config}"] + [
        f"--config.{k}={v}" for k, v in (overrides or {}).items()]


def cache_env(xla_cache: str) -> dict[str, str]:
    """Env for a shared persistent compilation cache (process 0 writes, the others read)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(xla_cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


# `python -c AUDITED DIR PRELUDE -m MODULE ARGS...`: runs MODULE as __main__ (its real entry
# point) after executing PRELUDE (Python code that may patch things and add to `report`);
# a process other than 0 records every file it opens for writing and every directory or file
# it creates, renames or removes under DIR (absolute paths), as report["writes"]. At exit the
# report is printed as one line: "AUDIT <json>".
AUDITED = """
import atexit, json, os, runpy, sys
under, prelude, flag, module = sys.argv[1:5]
assert flag == "-m", sys.argv
report = {"writes": []}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def audit(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and set(mode) & set("wax+")) or (flags or 0) & WRITE
    elif event in ("os.mkdir", "os.rename", "os.remove", "os.rmdir"):
        path, writing = args[0], True
    else:
        return
    if writing and isinstance(path, (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(path))
        if path.startswith(under):
            report["writes"].append([event, path])

if os.environ.get("KLEAR_PROCESS_ID", "0") != "0":
    sys.addaudithook(audit)
exec(prelude)
atexit.register(lambda: print("AUDIT " + json.dumps(report), flush=True))
sys.argv = [module] + sys.argv[5:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def audited(args: Sequence[str], under: str | os.PathLike, prelude: str = "") -> list[str]:
    """``args`` (``-m MODULE ...``, e.g. cli_args(...)) run under AUDITED: read the report
    back with ``audit_report``."""
    return ["-c", AUDITED, os.path.abspath(under), prelude, *args]


def audit_report(result: ProcResult) -> dict:
    """The report an AUDITED process printed at exit (``writes`` and whatever its prelude
    added)."""
    lines = [ln for ln in result.output.splitlines() if ln.startswith("AUDIT ")]
    assert len(lines) == 1, result.tail()
    return json.loads(lines[0][len("AUDIT "):])


def has_lines(path: str | os.PathLike, n: int) -> Callable[[], bool]:
    """A wait_until predicate: ``path`` (e.g. a metrics.jsonl being appended to) holds at
    least ``n`` complete lines."""
    def check() -> bool:
        try:
            with open(path) as f:
                return f.read().count("\n") >= n
        except FileNotFoundError:
            return False
    return check


def describe(results: Sequence[ProcResult], n: int = 4000) -> str:
    """Every process's exit status and output tail, for assertion messages."""
    return "\n".join(r.tail(n) for r in results)


def sigterm_one_process(job: "MultiHost", metrics: str | os.PathLike, rows_first: int) -> int:
    """Once ``metrics`` holds ``rows_first`` rows, SIGTERMs process 1 alone; asserts every
    process exits 0 after saving the same step (and nothing after it) and returns that
    step."""
    started = job.wait_until(has_lines(metrics, rows_first))
    assert started, describe(job.wait())
    job.signal(1, signal.SIGTERM)
    results = job.wait()
    assert all(r.returncode == 0 and not r.killed for r in results), describe(results)
    said = [re.findall(r"SIGTERM: saved a checkpoint at step (\d+)", r.output) for r in results]
    assert len(said[0]) == 1 and all(s == said[0] for s in said), said
    step = int(said[0][0])
    with open(metrics) as f:  # (the harness imports neither jax nor klear_jax)
        assert [json.loads(line)["step"] for line in f] == list(range(1, step + 1))
    return step


def run_job(args: Sequence[str], **kw) -> list[ProcResult]:
    """Runs a job to completion and asserts that every process exited 0."""
    with MultiHost(args, **kw) as job:
        results = job.wait()
    assert all(r.returncode == 0 for r in results), describe(results)
    return results
