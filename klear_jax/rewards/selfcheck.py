"""Hostile probes against the code-reward sandbox on this host: what holds?

    python -m klear_jax.rewards.selfcheck              # a table; exit status 1 if anything fails
    python -m klear_jax.rewards.selfcheck --json       # the same as JSON
    python -m klear_jax.rewards.selfcheck --overhead 50   # ms per run: full isolation vs
                                                          # without cgroup + seccomp + keyring

Each probe is a program scored by CodeScorer, as the RL loop would, and prints the
expected answer only if its attack worked. A probe holds when
  - it scores what it earned (0 for an attack, full for the benign /dev/stdout probe),
  - a correct program scored right after gets full reward,
  - nothing of the run is left: no process in one of this trainer's run cgroups or owned
    by a slot uid, no run cgroup directory, no file of a slot uid in /tmp or /dev/shm,
  - for the probes that try to pin memory: the memory held for the sandbox's runs during
    the attack (its cgroup group, which also keeps whatever a dead run left charged;
    sampled every 5 ms, peak minus the level just before) stays within memory.max +
    MARGIN_MB, and after the run it is back within MARGIN_MB. The host-wide figure
    (MemTotal - MemAvailable, same sampling) is reported too, but not judged: other
    processes on a shared host move it by hundreds of MB.
The tests run the same probes as root and as an unprivileged user with a delegated cgroup.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import secrets
import statistics
import sys
import threading
import time

from klear_jax.rewards import keyring
from klear_jax.rewards.cgroup import BASE
from klear_jax.rewards.code import CodeRewardConfig, CodeScorer
from klear_jax.rewards.sandbox import Sandbox, SandboxConfig
from klear_jax.rewards.seccomp import CLONE, CLONE3, DENY

MARGIN_MB = 64
CONFIG = SandboxConfig(timeout_s=8.0, memory_mb=256, num_slots=2, max_output_bytes=1 << 16)
BENIGN = ("<think>x</think>\n```python\nprint(sum(map(int, input().split())))\n```",
          {"inputs": ["2 3\n"], "outputs": ["5\n"]})
_ARCH_COL = 1 if platform.machine() in ("aarch64", "arm64") else 0


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    item: str           # what it attacks
    code: str           # the program; call-based when tests has fn_name
    tests: dict
    expect: float = 0.0
    pins_memory: bool = False


def _stdio(expected: str) -> dict:
    return {"inputs": [""], "outputs": [expected]}


def _nr(name: str) -> int:
    """This host's syscall number for `name`."""
    return {**DENY, "clone": CLONE, "clone3": CLONE3}[name][_ARCH_COL]


_CTYPES = ("import ctypes, errno, os, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.syscall.restype = ctypes.c_long\n"
           "def sc(nr, *a):\n    r = libc.syscall(nr, *a)\n    return r, ctypes.get_errno()\n")


def probes(key_serial: int = 0) -> list[Probe]:
    """The probe catalogue; `key_serial` is a key planted in the caller's session keyring."""
    return [
        Probe("fork_memory", "1: memory is limited per run, not per process", """
import os, time
N = 8
r, w = os.pipe()
for _ in range(N):
    if os.fork() == 0:
        try:
            x = b"\\1" * (160 << 20)          # 160 MB, touched, under RLIMIT_AS
            os.write(w, b"y")
        except MemoryError:
            pass
        time.sleep(1)
        os._exit(0)
os.close(w)
got = b""
while True:
    c = os.read(r, 64)
    if not c:
        break
    got += c
    if len(got) == N:
        break
time.sleep(0.5)
print("ok" if len(got) == N else len(got))
""", _stdio("ok"), pins_memory=True),
        Probe("memfd_flood", "1: memfd pages are charged to the run", """
import os, signal, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
total, fds, chunk = 0, [], b"\\1" * (15 << 20)
try:
    while total < (900 << 20):
        fd = os.memfd_create("x")
        fds.append(fd)
        os.write(fd, chunk)
        total += len(chunk)
except OSError:
    pass
time.sleep(1)
print("ok" if total >= (900 << 20) else total >> 20)
""", _stdio("ok"), pins_memory=True),
        Probe("fork_bomb", "1: pids limit per run", """
import os, time
n = 0
try:
    while n < 500:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    pass
print("ok" if n >= 500 else n)
""", _stdio("ok")),
        Probe("daemon", "1: the run is killed as a unit", """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
    os._exit(0)
print("no")
""", _stdio("ok")),
        Probe("userns_tmpfs", "2: no new namespaces (a private tmpfs outside every limit)",
              _CTYPES + f"""
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x20000
r, e = sc({_nr("unshare")}, CLONE_NEWUSER | CLONE_NEWNS)
if r != 0:
    print(errno.errorcode.get(e, e))
else:
    print("ok", flush=True)                # escaped; now pin memory outside every limit
    try:
        uid, gid = os.getuid(), os.getgid()   # (overflow ids until mapped)
        for f, v in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid),
                     ("gid_map", "0 %d 1" % gid)):
            with open("/proc/self/" + f, "w") as fh:
                fh.write(v)
        os.makedirs("/tmp/m", exist_ok=True)
        libc.mount(b"none", b"/tmp/m", b"tmpfs", 0, b"size=2g")
        for i in range(64):
            with open("/tmp/m/fill%d" % i, "wb") as fh:
                fh.write(b"\\1" * (8 << 20))
    except OSError:
        pass
    time.sleep(1)
""", _stdio("ok"), pins_memory=True),
        Probe("seccomp", "2: namespaces, keyrings, io_uring, ptrace, process_vm_* refused",
              _CTYPES + f"""
escaped = []
if sc({_nr("unshare")}, 0x10000000)[0] == 0:
    escaped.append("unshare")
r, e = sc({_nr("clone")}, 0x10000000 | 17, 0, 0, 0, 0)   # like fork, in a new user ns
if r == 0:
    os._exit(0)
if r > 0:
    os.waitpid(r, 0)
    escaped.append("clone(CLONE_NEWUSER)")
if sc({_nr("clone3")}, 0, 0)[1] != errno.ENOSYS:
    escaped.append("clone3")
if sc({_nr("keyctl")}, 0, -3, 1)[0] >= 0:
    escaped.append("keyctl")
if sc({_nr("add_key")}, b"user", b"k", b"v", 1, -4)[0] >= 0:
    escaped.append("add_key")
params = ctypes.create_string_buffer(120)
if sc({_nr("io_uring_setup")}, 4, params)[0] >= 0:
    escaped.append("io_uring_setup")
if sc({_nr("process_vm_readv")}, os.getpid(), 0, 0, 0, 0, 0)[0] == 0:
    escaped.append("process_vm_readv")
if sc({_nr("userfaultfd")}, 1)[0] >= 0:
    escaped.append("userfaultfd")
if sc({_nr("ptrace")}, 0, 0, 0, 0)[0] == 0:
    escaped.append("ptrace")
print("ok" if escaped else "refused")
print(*escaped, file=sys.stderr)
""", _stdio("ok")),
        Probe("trainer_keyring", "3: the trainer's session keyring is out of reach",
              _CTYPES + f"""
import struct
buf = ctypes.create_string_buffer(4096)
n, _ = sc({_nr("keyctl")}, 11, -3, buf, 4096)           # the session keyring's key list
serials = list(struct.unpack("%di" % (n // 4), buf.raw[:n - n % 4])) if n > 0 else []
for s in serials + [{key_serial}]:                      # ... and the planted key's serial
    n, _ = sc({_nr("keyctl")}, 11, s, buf, 4096)
    if n > 0 and buf.raw.startswith(b"klear-"):
        print(buf.raw[:n].decode("latin-1"))
        break
else:
    print("no")
""", _stdio("")),   # the planted token, filled in by run()
        Probe("inode_flood", "4: tmpfs inodes are charged to the run", """
import os, time
n = 0
try:
    while n < 400000:
        os.close(os.open("/tmp/%0200d" % n, os.O_CREAT | os.O_WRONLY, 0o600))
        n += 1
except OSError:
    pass
time.sleep(1)
print("ok" if n >= 400000 else n)
""", _stdio("ok"), pins_memory=True),
        Probe("dev_stdout", "6: a correct program writing through /dev/stdout scores full", """
import os
with open("/dev/stdout", "w") as f:
    f.write("5\\n")
with open("/dev/stderr", "w") as f:
    f.write("log line\\n")
os.write(os.open("/dev/stderr", os.O_WRONLY), b"more log\\n")
""", {"inputs": ["2 3\n"], "outputs": ["5\n"]}, expect=1.0),
        Probe("huge_int_result", "5: a huge int result fails one test, not the batch",
              "def f(x):\n    return 10 ** 4000\n",
              {"fn_name": "f", "inputs": [[1]], "outputs": [1.5]}),
        Probe("snan_stdout", "5: an sNaN token fails one test, not the batch",
              "print('sNaN')", _stdio("1")),
        Probe("deep_json_result", "5: a very deep JSON result fails one test, not the batch",
              "import __main__, os\nos.write(1, (__main__._nonce + ' ' + '[' * 20000 + "
              "']' * 20000 + '\\n').encode())\nos._exit(0)\ndef f(x):\n    return 1\n",
              {"fn_name": "f", "inputs": [[1]], "outputs": [[]]}),
        Probe("nan_result", "5: NaN is never equal", "def f(x):\n    return float('nan')\n",
              {"fn_name": "f", "inputs": [[1]], "outputs": ["NaN"]}),
    ]


# ------------------------------------------------------------------------------ measuring
def _host_used_mb() -> float:
    vals = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                vals[k] = int(v.split()[0])
    return (vals["MemTotal"] - vals["MemAvailable"]) / 1024


class _MemSampler:
    """Peak of `read()` (MB) while active, relative to just before."""

    def __init__(self, read):
        self.read = read

    def __enter__(self):
        self.base = statistics.median(self.read() for _ in range(3))
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.read())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.delta_mb = self.peak - self.base
        self.after_mb = self.read() - self.base


def leftovers(sandbox: Sandbox) -> tuple[list, list]:
    """(stray processes, stray files/dirs) of this sandbox's runs."""
    procs, files = [], []
    tag = f"{BASE}/{sandbox.cgroups.name}/" if sandbox.cgroups else None
    c = sandbox.cfg
    uids = range(c.uid_base, c.uid_base + c.uid_count) if sandbox.mode == "bwrap-root" else ()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cgroup") as f:
                    mine = tag is not None and tag in f.read()
                with open(f"/proc/{name}/status") as f:
                    uid = int(next(ln for ln in f if ln.startswith("Uid:")).split()[1])
            except (OSError, StopIteration):
                continue
            if mine or uid in uids:
                procs.append(int(name))
    if sandbox.cgroups:
        for g in sandbox.cgroups.groups:
            files += [os.path.join(g, d) for d in os.listdir(g)
                      if os.path.isdir(os.path.join(g, d))]
    if uids:
        for root in ("/tmp", "/dev/shm"):
            for e in os.scandir(root):
                try:
                    if e.stat(follow_symlinks=False).st_uid in uids:
                        files.append(e.path)
                except OSError:
                    pass
    return sorted(set(procs)), files


def run(scorer: CodeScorer, probe: Probe, token: str = "") -> dict:
    """Scores `probe` then a benign program; what happened and whether it all held."""
    tests = probe.tests
    if probe.name == "trainer_keyring":
        tests = _stdio(token)
    resp = f"<think>x</think>\n```python\n{probe.code}\n```"
    limit_mb = scorer.cfg.sandbox.memory_mb
    cg = scorer.sandbox.cgroups
    t0 = time.monotonic()
    with _MemSampler(lambda: cg.memory_usage() / 2 ** 20 if cg else 0.0) as held, \
            _MemSampler(_host_used_mb) as host:
        (score,) = scorer.score_batch_detailed([resp], [tests])
    wall = time.monotonic() - t0
    benign = scorer.score_batch(*([x] for x in BENIGN))[0]
    procs, files = leftovers(scorer.sandbox)
    out = {"probe": probe.name, "item": probe.item, "reward": score.reward,
           "expect": probe.expect, "failures": score.failures, "benign": benign,
           "stray_procs": procs, "stray_files": files, "held_mb": round(held.delta_mb, 1),
           "held_after_mb": round(held.after_mb, 1), "host_mb": round(host.delta_mb, 1),
           "limit_mb": limit_mb, "pins_memory": probe.pins_memory, "wall_s": round(wall, 2)}
    why = []
    if score.reward != probe.expect:
        why.append(f"reward {score.reward} (earned: {probe.expect})")
    if benign != 1.0:
        why.append(f"a benign program right after scored {benign}")
    if procs or files:
        why.append(f"left behind: processes {procs[:5]}, files {files[:5]}")
    if cg is None:
        why.append("no run cgroup: memory is not limited per run")
    elif probe.pins_memory and held.delta_mb > limit_mb + MARGIN_MB:
        why.append(f"held +{held.delta_mb:.0f} MB > memory.max {limit_mb} + {MARGIN_MB}")
    elif probe.pins_memory and held.after_mb > MARGIN_MB:
        why.append(f"still held after the run: +{held.after_mb:.0f} MB")
    out["holds"], out["why"] = not why, "; ".join(why)
    return out


def run_all(cfg: SandboxConfig = CONFIG, names=None) -> tuple[Sandbox, list[dict]]:
    token = "klear-" + secrets.token_hex(8)
    serial = keyring.add_key("klear-selfcheck", token.encode())
    with CodeScorer(CodeRewardConfig(sandbox=cfg)) as scorer:
        results = [run(scorer, p, token) for p in probes(serial)
                   if names is None or p.name in names]
        return scorer.sandbox, results


def overhead(n: int, cfg: SandboxConfig = CONFIG) -> dict:
    """Mean / median ms of one `pass` run: full isolation vs no cgroup, seccomp or fresh
    keyring (interleaved, same Sandbox)."""
    sb = Sandbox(cfg)
    cg, sec, call = sb.cgroups, sb.seccomp, keyring.call
    times = {"full": [], "without cgroup+seccomp+keyring": []}
    try:
        for i in range(2 * n):
            full = i % 2 == 0
            sb.cgroups, sb.seccomp = (cg, sec) if full else (None, None)
            keyring.call = call if full else (lambda fn: fn())
            t = time.perf_counter()
            assert sb.run("pass").ok
            times["full" if full else "without cgroup+seccomp+keyring"].append(
                (time.perf_counter() - t) * 1e3)
    finally:
        sb.cgroups, sb.seccomp, keyring.call = cg, sec, call
    return {k: {"mean_ms": round(statistics.mean(v), 2), "median_ms": round(statistics.median(v), 2)}
            for k, v in times.items()} | {"mode": sb.mode, "cgroups": cg.describe() if cg else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--probes", default="", help="comma-separated probe names (default: all)")
    p.add_argument("--overhead", type=int, default=0, metavar="N",
                   help="measure per-run overhead over N runs each instead")
    a = p.parse_args(argv)
    from klear_jax.rewards.sandbox import SandboxUnavailable
    try:
        if a.overhead:
            print(json.dumps(overhead(a.overhead), indent=1))
            return 0
        sb, results = run_all(names=set(a.probes.split(",")) if a.probes else None)
    except SandboxUnavailable as e:
        print(json.dumps({"error": str(e)}) if a.json else f"sandbox unavailable: {e}")
        return 1
    if a.json:
        print(json.dumps({"mode": sb.mode, "cgroups": sb.cgroups.describe() if sb.cgroups
                          else None, "results": results}))
    else:
        print(f"sandbox mode {sb.mode}; cgroups: "
              f"{sb.cgroups.describe() if sb.cgroups else 'none'}")
        for r in results:
            mem = (f", held +{r['held_mb']:.0f} MB (memory.max {r['limit_mb']}; host-wide "
                   f"+{r['host_mb']:.0f})") if r["pins_memory"] else ""
            print(f"{'holds ' if r['holds'] else 'FAILS '} {r['probe']:<17} {r['item']}"
                  f"{mem}{'' if r['holds'] else '  <- ' + r['why']}")
        print("all probes hold" if all(r["holds"] for r in results)
              else "SOME PROBES FAIL: do not train on code with this host")
    return 0 if all(r["holds"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
