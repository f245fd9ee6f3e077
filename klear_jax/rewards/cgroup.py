"""One cgroup per sandboxed run: a memory limit for the whole run, swap 0, a pids limit,
killed as a unit.

Everything the run allocates is charged to its cgroup, whichever process does it: anonymous
memory of every forked child, its tmpfs and memfd pages, page cache, and kernel objects
such as inodes, dentries and pipe buffers. At the limit the kernel reclaims or OOM-kills
inside that cgroup only, never the trainer.

    cg = Cgroups.detect(memory_bytes=256 << 20, pids_max=40)   # CgroupUnavailable if none
    run = cg.new_run()            # its directories exist, limits set
    ... start the run's first process with its pid written to run.procs_files ...
    run.close()                   # SIGKILL every member, wait, rmdir; run.memory_peak
    cg.close()                    # remove this instance's group

Both cgroup versions:
  v2 (Ubuntu 22.04+/TPU VMs): memory.max, memory.swap.max = 0, memory.oom.group, pids.max,
     cgroup.kill.
  v1 (and hybrid hosts, where memory and pids sit on v1 hierarchies and the cgroup2 mount
     at /sys/fs/cgroup/unified holds neither): memory.limit_in_bytes,
     memory.memsw.limit_in_bytes (swap 0, where swap accounting is on; otherwise
     memory.swappiness 0), pids.max; killed member by member (through pidfds, checking
     membership, so a recycled pid is never hit) until empty.

Run cgroups live in `<parent>/klear_jax.sandbox/<trainer pid>-<k>/r<n>` (one group per
Cgroups instance: `memory_usage()` is what its runs hold, and an optional limit there
caps all its concurrent runs together). The parent is the
trainer's own cgroup (from /proc/self/cgroup), except for root on cgroup v2, where it is
the top of the mounted tree. It must be writable: root, or a delegated cgroup (systemd:
`systemd-run --user --scope -p Delegate=yes -- CMD`; v1: a directory root created and
chowned to the user, with the trainer started inside it). cgroup v2 allows no processes
in a cgroup that passes controllers to children, so when the parent holds processes they
move to `<parent>/klear_jax.main` first: the usual step for the owner of a delegated scope.
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import signal
import time

CONTROLLERS = ("memory", "pids")
BASE = "klear_jax.sandbox"
LEAF = "klear_jax.main"

DELEGATE_HINT = (
    "Run as root, or start the trainer inside a cgroup delegated to your user: on a "
    "systemd host (cgroup v2, e.g. a Cloud TPU VM) `systemd-run --user --scope -p "
    "Delegate=yes -- python -m klear_jax.rl ...` (the user manager must delegate memory "
    "and pids, the default on Ubuntu 22.04+); on cgroup v1 have root create a cgroup in "
    "the memory and pids hierarchies, chown it to you and move your shell into it.")


class CgroupUnavailable(RuntimeError):
    """No usable cgroup for sandbox runs; the message says what is missing and how to fix it."""


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _members(d: str) -> list[int]:
    try:
        return [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
    except OSError:
        return []


@dataclasses.dataclass
class _Tree:
    """One mounted hierarchy holding some of CONTROLLERS, and where our cgroups go in it."""
    version: int
    mount: str
    controllers: tuple
    parent: str = ""

    @property
    def base(self) -> str:
        return os.path.join(self.parent, BASE)


def _mounts() -> list[tuple[str, str, str, set]]:
    """(fstype, mount point, root inside the hierarchy, controllers) of cgroup mounts."""
    out = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if r and r[0] in ("cgroup", "cgroup2"):
            opts = set(r[2].split(",")) if len(r) > 2 else set()
            out.append((r[0], f[4].replace("\\040", " "), f[3], opts))
    return out


def _own_paths() -> tuple[dict, str | None]:
    """({v1 controller: path}, v2 path) of this process, from /proc/self/cgroup."""
    v1, v2 = {}, None
    for line in _read("/proc/self/cgroup").splitlines():
        _, ctrls, path = line.split(":", 2)
        if ctrls == "":
            v2 = path
        for c in ctrls.split(","):
            v1[c] = path
    return v1, v2


def _inside(mount: str, root: str, path: str) -> str:
    """Directory of cgroup `path` under a hierarchy mounted at `mount` showing `root`."""
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    return os.path.join(mount, path.lstrip("/"))


def _find_trees() -> list[_Tree]:
    mounts = _mounts()
    v1_own, v2_own = _own_paths()
    trees, missing = [], []
    for c in CONTROLLERS:
        if any(c in t.controllers for t in trees):
            continue
        v1 = [(m, root) for kind, m, root, opts in mounts if kind == "cgroup" and c in opts]
        if v1:
            m, root = v1[0]
            names = tuple(x for x in CONTROLLERS
                          if any(x in opts for kind, mm, _, opts in mounts if mm == m))
            trees.append(_Tree(1, m, names, _inside(m, root, v1_own.get(c, "/"))))
            continue
        found = False
        for kind, m, root, _ in mounts:
            if kind != "cgroup2":
                continue
            try:
                avail = _read(os.path.join(m, "cgroup.controllers")).split()
            except OSError:
                continue
            if c in avail:
                tree = next((t for t in trees if t.version == 2 and t.mount == m), None)
                if tree is None:
                    parent = m if os.geteuid() == 0 else _inside(m, root, v2_own or "/")
                    trees.append(_Tree(2, m, (c,), parent))
                else:
                    tree.controllers += (c,)
                found = True
                break
        if not found:
            missing.append(c)
    if missing:
        raise CgroupUnavailable(
            f"no cgroup hierarchy with the {' and '.join(missing)} controller is mounted "
            f"(looked in /proc/self/mountinfo), so a sandboxed run's memory and processes "
            f"cannot be limited as a whole. Mount cgroup2 at /sys/fs/cgroup (systemd does) "
            f"or the v1 {'/'.join(missing)} hierarchies.")
    return trees


def _enable_v2(d: str, controllers) -> None:
    """Hand `controllers` to d's children; moves d's processes to d/LEAF when v2 requires."""
    want = " ".join("+" + c for c in controllers)
    have = set(_read(os.path.join(d, "cgroup.subtree_control")).split())
    if set(controllers) <= have:
        return
    avail = set(_read(os.path.join(d, "cgroup.controllers")).split())
    if not set(controllers) <= avail:
        raise CgroupUnavailable(
            f"cgroup v2: {d} does not have the {' and '.join(sorted(set(controllers) - avail))}"
            f" controller (its cgroup.controllers: {' '.join(sorted(avail)) or 'none'}): its "
            f"parent does not delegate it. " + DELEGATE_HINT)
    for _ in range(20):
        try:
            _write(os.path.join(d, "cgroup.subtree_control"), want)
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        leaf = os.path.join(d, LEAF)    # processes may not stay in a cgroup with children
        os.makedirs(leaf, exist_ok=True)
        for pid in _members(d):
            try:
                _write(os.path.join(leaf, "cgroup.procs"), str(pid))
            except OSError as e:
                if e.errno != errno.ESRCH:
                    raise
    raise CgroupUnavailable(f"cgroup v2: could not enable {want} in {d} (processes keep "
                            f"appearing in it)")


class RunCgroup:
    """The cgroups of one run (one per hierarchy); `close()` kills and removes them."""

    def __init__(self, dirs: list[str], versions: list[int]):
        self.dirs = dirs
        self.versions = versions
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]
        self.memory_peak: int | None = None
        self.oom_kills = 0

    def _read_memory_stats(self) -> None:
        for d, v in zip(self.dirs, self.versions):
            for name in ("memory.peak",) if v == 2 else ("memory.max_usage_in_bytes",):
                try:
                    self.memory_peak = int(_read(os.path.join(d, name)))
                except (OSError, ValueError):
                    pass
            for name in ("memory.events", "memory.oom_control"):
                try:
                    for line in _read(os.path.join(d, name)).splitlines():
                        if line.startswith("oom_kill "):
                            self.oom_kills = int(line.split()[1])
                except (OSError, ValueError):
                    pass

    def kill(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process in the run until none is left; True when empty."""
        for d, v in zip(self.dirs, self.versions):
            if v == 2 and os.path.exists(os.path.join(d, "cgroup.kill")):
                try:
                    _write(os.path.join(d, "cgroup.kill"), "1")
                except OSError:
                    pass
        deadline = time.monotonic() + timeout_s
        while True:
            pids = {p for d in self.dirs for p in _members(d)}
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                self._kill_member(pid)
            time.sleep(0.002)

    def _kill_member(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        try:    # the pidfd pins this process: signal it only if it is still ours
            if any(pid in _members(d) for d in self.dirs):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)

    def close(self) -> bool:
        """Kill, record memory_peak / oom_kills, remove the directories; True when removed."""
        self.kill()
        self._read_memory_stats()
        ok = True
        for d in self.dirs:
            for i in range(200):            # members may take a moment to be reaped
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or i == 199:
                        ok = False
                        break
                    self.kill(0.1)
                    time.sleep(0.005)
        return ok


class Cgroups:
    """Makes one RunCgroup per run with the given limits (see module docstring). Its runs
    share a group cgroup, `<base>/<pid>-<n>` (optionally limited as a whole), removed by
    close()."""

    _counter = itertools.count()

    def __init__(self, trees: list[_Tree], memory_bytes: int, pids_max: int):
        self.trees = trees
        self.memory_bytes = memory_bytes
        self.pids_max = pids_max
        self.name = f"{os.getpid()}-{next(self._counter)}"
        self.groups = [os.path.join(t.base, self.name) for t in trees]
        self._runs = itertools.count()

    @classmethod
    def detect(cls, memory_bytes: int, pids_max: int, group_memory_bytes: int = 0) -> "Cgroups":
        """Finds and prepares the hierarchies. `group_memory_bytes` (0: none) also limits
        all runs of this instance together, so concurrent slots cannot take the host's
        memory from the trainer either."""
        trees = _find_trees()
        for t in trees:
            cls._prepare(t)
        self = cls(trees, memory_bytes, pids_max)
        self.remove_stale()
        try:
            for t, g in zip(trees, self.groups):
                os.mkdir(g)
                if t.version == 2:
                    _enable_v2(g, t.controllers)
                if group_memory_bytes and "memory" in t.controllers:
                    _limit_memory(t.version, g, group_memory_bytes)
            self.new_run().close()      # a run cgroup can be made, limited and removed
        except (OSError, CgroupUnavailable) as e:
            self.close()
            raise CgroupUnavailable(f"cannot create a run cgroup under {self.describe()}: "
                                    f"{e}. " + DELEGATE_HINT) from e
        return self

    @staticmethod
    def _prepare(t: _Tree) -> None:
        try:
            if not os.access(t.parent, os.W_OK):
                raise CgroupUnavailable(
                    f"cgroup v{t.version} ({', '.join(t.controllers)}): {t.parent} is not "
                    f"writable by uid {os.geteuid()} (not a delegated cgroup). " + DELEGATE_HINT)
            if t.version == 2:
                _enable_v2(t.parent, t.controllers)
            os.makedirs(t.base, exist_ok=True)
            if t.version == 2:
                _enable_v2(t.base, t.controllers)
        except OSError as e:
            raise CgroupUnavailable(f"cgroup v{t.version}: cannot set up {t.base}: {e}. "
                                    + DELEGATE_HINT) from e

    def remove_stale(self) -> None:
        """Remove empty groups and runs left by trainers that are gone. Their processes died
        with them (bwrap --die-with-parent); a cgroup still holding some is left alone."""
        for t in self.trees:
            for name in os.listdir(t.base):
                try:
                    os.kill(int(name.split("-")[0]), 0)
                    continue
                except (ValueError, PermissionError):
                    continue
                except ProcessLookupError:
                    pass
                _rmdir_tree(os.path.join(t.base, name))

    def new_run(self) -> RunCgroup:
        name = f"r{next(self._runs)}"
        dirs, versions = [], []
        try:
            for t, g in zip(self.trees, self.groups):
                d = os.path.join(g, name)
                os.mkdir(d)
                dirs.append(d)
                versions.append(t.version)
                self._limit(t, d)
        except OSError as e:
            RunCgroup(dirs, versions).close()
            raise CgroupUnavailable(f"cannot create or limit run cgroup {name}: {e}") from e
        return RunCgroup(dirs, versions)

    def _limit(self, t: _Tree, d: str) -> None:
        if "pids" in t.controllers:
            _write(os.path.join(d, "pids.max"), str(self.pids_max))
        if "memory" in t.controllers:
            _limit_memory(t.version, d, self.memory_bytes)
            if t.version == 2 and os.path.exists(os.path.join(d, "memory.oom.group")):
                _write(os.path.join(d, "memory.oom.group"), "1")   # an OOM kills the run

    def memory_usage(self) -> int:
        """Bytes charged to this instance's runs now, including what dead runs left behind
        (charges of a removed cgroup move to its parent, the group)."""
        for t, g in zip(self.trees, self.groups):
            if "memory" in t.controllers:
                name = "memory.current" if t.version == 2 else "memory.usage_in_bytes"
                return int(_read(os.path.join(g, name)))
        return 0

    def close(self) -> None:
        """Remove the group cgroups (runs must be closed)."""
        for g in self.groups:
            _rmdir_tree(g)

    def describe(self) -> str:
        return "; ".join(f"v{t.version} {'+'.join(t.controllers)} in {t.base}" for t in self.trees)


def _limit_memory(version: int, d: str, limit: int) -> None:
    """RAM limit `limit` bytes and no swap for cgroup d."""
    if version == 2:
        _write(os.path.join(d, "memory.max"), str(limit))
        if os.path.exists(os.path.join(d, "memory.swap.max")):
            _write(os.path.join(d, "memory.swap.max"), "0")
        return
    _write(os.path.join(d, "memory.limit_in_bytes"), str(limit))
    if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
        _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(limit))   # RAM + swap = RAM
    else:
        try:
            _write(os.path.join(d, "memory.swappiness"), "0")
        except OSError:
            pass


def _rmdir_tree(d: str) -> None:
    """rmdir d and its (empty) child cgroups, deepest first; what still has members stays."""
    for sub, _, _ in sorted(os.walk(d), key=lambda x: -x[0].count("/")):
        try:
            os.rmdir(sub)
        except OSError:
            pass
