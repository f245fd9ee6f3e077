"""Run untrusted Python programs under bubblewrap, a per-run cgroup, seccomp, rlimits and a
wall-clock deadline.

Every program the model writes runs here and nowhere else. One call, one sandbox:

    trusted parent: a fresh empty session keyring (keyring.py), a run cgroup (cgroup.py:
      memory.max for everything the run allocates, swap 0, pids.max), stdout/stderr
      pipes the program may reopen as /dev/stdout and /dev/stderr
    -> /bin/sh shim: puts itself into the run cgroup, execs bwrap
    -> bwrap (as root, privileged mode: it can bind the interpreter from /root read-only)
      new pid / net / ipc / uts / mount (/cgroup) namespaces, --die-with-parent,
      --new-session, --clearenv, root tmpfs remounted read-only, /usr + interpreter
      read-only, private size-capped tmpfs /tmp (the working dir), tiny /dev/shm,
      --seccomp: the filter of seccomp.py (no namespaces, mounts, keyrings, io_uring,
      bpf, ptrace, ...), applied to everything below
    -> prlimit (CPU s, address space, nproc, fsize, nofile)
    -> setpriv: drop to an unprivileged per-slot uid, no caps, no_new_privs
    -> python -I -B /sbx/prog.py

Why a per-slot uid: root must not run the program, and RLIMIT_NPROC counts per real uid,
so each concurrent run gets its own uid (61000+k, not in /etc/passwd, claimed with an
flock under `lock_dir` so several trainers on one host never share one).
Why kill pid 1: killing only bwrap tears the namespace down asynchronously; we SIGKILL
the sandbox's pid 1 through a pidfd (the kernel then kills the whole pid namespace),
wait for bwrap, kill whatever is left in the run cgroup, remove it, and, releasing the
slot, sweep every process still owned by its uid, so the next run starts from zero.

When the trainer is not root, bwrap runs unprivileged with a user namespace instead
(RLIMIT_NPROC is then charged to the namespace's ucounts) and no uid switch happens; the
run cgroup then comes from a cgroup delegated to the user (cgroup.py).

Construction checks the host (bubblewrap present and able to make its namespaces, a
writable cgroup with the memory and pids controllers, a seccomp filter for this arch) by
running a trivial program the real way; when something is missing it raises
SandboxUnavailable saying what and how to fix it, unless `allow_unsandboxed=True`, which
runs with whatever isolation is there (without bwrap: the rlimits and the deadline only).
`python -m klear_jax.rewards.selfcheck` runs hostile probes on the current host.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import pwd
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref

from klear_jax.rewards import keyring
from klear_jax.rewards.cgroup import CgroupUnavailable, Cgroups, RunCgroup
from klear_jax.rewards.seccomp import filter_bytes

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """All sandbox limits in one place. Paper (Klear code): firejail, 35 s, <= 16 tests."""
    timeout_s: float = 35.0          # wall clock per program run (paper: 35 s)
    max_tests: int = 16              # test cases per problem (paper: 16)
    cpu_s: int = 0                   # RLIMIT_CPU; 0 -> ceil(timeout_s) + 1
    memory_mb: int = 1024            # per run: cgroup memory.max (all processes, tmpfs, memfd,
                                     # kernel objects; swap 0) and each process's RLIMIT_AS;
                                     # all runs together: slots x this, <= half the host RAM
    nproc: int = 32                  # per run: cgroup pids.max (+4 for bwrap); RLIMIT_NPROC
    fsize_mb: int = 16               # RLIMIT_FSIZE (largest file the program may write)
    nofile: int = 64                 # RLIMIT_NOFILE
    tmpfs_mb: int = 32               # size of the private writable /tmp
    shm_kb: int = 64                 # size of /dev/shm (bwrap --dev alone leaves it unbounded)
    max_output_bytes: int = 1 << 20  # stdout cap; more output kills the run
    max_stderr_bytes: int = 1 << 16  # stderr kept (rest discarded, not a failure)
    num_slots: int = 0               # concurrent runs; 0 -> os.cpu_count()
    uid_base: int = 61000            # slot uids are uid_base .. uid_base + uid_count - 1
    uid_count: int = 1000
    lock_dir: str = "/tmp/klear_jax_sandbox_locks"
    python: str = ""                 # interpreter inside the sandbox; "" -> base interpreter
    extra_ro_binds: tuple = ()       # more host paths made visible read-only
    hide_site_packages: bool = True  # stdlib only inside the sandbox
    bwrap: str = ""                  # "" -> shutil.which("bwrap"); a missing path = no bwrap
    allow_unsandboxed: bool = False  # run with what isolation the host has (unsafe; see module doc)

    def __post_init__(self):
        for name in ("timeout_s", "max_tests", "memory_mb", "nproc", "fsize_mb", "nofile",
                     "tmpfs_mb", "shm_kb", "max_output_bytes", "uid_count"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def slots(self) -> int:
        return self.num_slots or os.cpu_count() or 1


@dataclasses.dataclass
class RunResult:
    """Outcome of one program run. status: 'ok' (exited by itself), 'timeout',
    'output_limit' (stdout over the cap), or 'error' (the sandbox itself failed)."""
    status: str
    returncode: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    memory_peak: int | None = None   # the run cgroup's peak charge in bytes (None: no cgroup)
    oom_kills: int = 0               # processes the kernel OOM-killed in the run cgroup

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.returncode == 0


class SandboxUnavailable(RuntimeError):
    """The host cannot isolate untrusted programs; the message says what is missing."""


def _base_python() -> str:
    """The real interpreter behind a venv's python (the venv itself stays invisible)."""
    return os.path.realpath(sys.executable)


def _uid_pids(uid: int) -> list[int]:
    """Pids whose real uid is `uid` (the slot's processes)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except OSError:
            continue
    return pids


def sweep_uid(uid: int, timeout_s: float = 5.0) -> bool:
    """SIGKILL every process of `uid` until none is left; True when the uid is clean."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _uid_pids(uid)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


class _SlotLock:
    """Claims one free slot uid for the duration of a run (flock, released on exit)."""

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self.uid = None
        self._fd = None

    def __enter__(self) -> int:
        os.makedirs(self.cfg.lock_dir, mode=0o700, exist_ok=True)
        start = random.randrange(self.cfg.uid_count)
        for _ in range(3):
            for k in range(self.cfg.uid_count):
                uid = self.cfg.uid_base + (start + k) % self.cfg.uid_count
                fd = os.open(os.path.join(self.cfg.lock_dir, str(uid)),
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                try:
                    pwd.getpwuid(uid)
                    taken = True           # a real account: never borrow it
                except KeyError:
                    taken = not sweep_uid(uid, 1.0)
                if taken:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                return uid
            time.sleep(0.05)
        raise SandboxUnavailable(
            f"no free sandbox uid in [{self.cfg.uid_base}, {self.cfg.uid_base + self.cfg.uid_count})")

    def __exit__(self, *exc):
        sweep_uid(self.uid)
        os.close(self._fd)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


PIDS_OVERHEAD = 4   # the shim/bwrap, bwrap's pid 1 and spares, on top of cfg.nproc
_SHIM = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || '
         '{ echo "klear-sandbox: cannot join cgroup $1" >&2; exit 125; }; '
         'shift; n=$((n - 1)); done; exec "$@"')


def _group_memory_bytes(cfg: SandboxConfig) -> int:
    """All concurrent runs together: slots x memory_mb, at most half of the host's RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(cfg.slots * (cfg.memory_mb << 20), total // 2)


def _sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/{name}") as f:
            return f.read().strip()
    except OSError:
        return None


def userns_hint() -> str:
    """How to let an unprivileged user run bwrap on this host (what blocks it, if seen)."""
    hints = []
    if _sysctl("kernel/apparmor_restrict_unprivileged_userns") == "1":
        hints.append(
            "AppArmor restricts unprivileged user namespaces "
            "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 23.10+/24.04): give bwrap "
            "a profile allowing them, e.g. write /etc/apparmor.d/bwrap with `abi <abi/4.0>, "
            "include <tunables/global> profile bwrap /usr/bin/bwrap flags=(unconfined) "
            "{ userns, }` and run `apparmor_parser -r /etc/apparmor.d/bwrap`")
    if _sysctl("kernel/unprivileged_userns_clone") == "0":
        hints.append("unprivileged user namespaces are off: sysctl kernel.unprivileged_userns_clone=1")
    if _sysctl("user/max_user_namespaces") == "0":
        hints.append("user namespaces are off: sysctl user.max_user_namespaces=15000")
    if not hints:
        hints.append("this process may not create user namespaces (a container without "
                     "them, or a seccomp/LSM policy): enable them, or run the trainer as root")
    return "; ".join(hints)


class Sandbox:
    """Runs programs; thread-safe (each run claims its own uid and cgroup). See module doc.

    `mode`: 'bwrap-root', 'bwrap-user' or 'unsandboxed'; `missing`: what this host lacks
    (empty unless allow_unsandboxed let it start anyway)."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg = cfg or SandboxConfig()
        self.python = cfg.python or _base_python()
        self.bwrap = shutil.which(cfg.bwrap or "bwrap")
        self.root = os.geteuid() == 0
        self.prlimit = shutil.which("prlimit")
        self.setpriv = shutil.which("setpriv")
        self.cpu_s = cfg.cpu_s or int(math.ceil(cfg.timeout_s)) + 1
        self.missing: list[str] = []
        self.cgroups: Cgroups | None = None
        self.seccomp: bytes | None = None
        self.mode = "unsandboxed"
        if self.bwrap is None:
            self.missing.append(
                "bubblewrap (bwrap) is not installed, so untrusted code cannot be isolated: "
                "install it (apt-get install bubblewrap; .ci/install_system.sh does)")
        elif self.root and not (self.prlimit and self.setpriv):
            self.missing.append("the sandbox needs util-linux prlimit and setpriv on PATH "
                                "(apt-get install util-linux)")
        else:
            self.mode = "bwrap-root" if self.root else "bwrap-user"
        try:
            self.cgroups = Cgroups.detect(cfg.memory_mb << 20, cfg.nproc + PIDS_OVERHEAD,
                                          _group_memory_bytes(cfg))
        except CgroupUnavailable as e:
            self.missing.append(f"no per-run cgroup: {e}")
        if self.mode != "unsandboxed":
            try:
                self.seccomp = filter_bytes()
            except ValueError as e:
                self.missing.append(str(e))
            probe = keyring.call(lambda: self._run_bwrap(b"print(6 * 7)", b"", 30.0))
            if probe.stdout.strip() != b"42":
                why = probe.stderr.decode("utf-8", "replace").strip()[-600:]
                userns = not self.root and any(w in why.lower() for w in (
                    "namespace", "uid map", "uid_map", "operation not permitted"))
                hint = " " + userns_hint() if userns else ""
                self.missing.append(f"bubblewrap cannot start a sandbox here (status "
                                    f"{probe.status}, rc {probe.returncode}: {why!r}).{hint}")
                self.mode = "unsandboxed"
        if self.cgroups is not None:
            weakref.finalize(self, self.cgroups.close)
        if self.missing:
            listing = "\n  - ".join(self.missing)
            if not cfg.allow_unsandboxed:
                self.close()
                raise SandboxUnavailable(
                    f"code rewards cannot contain untrusted programs on this host:\n  - "
                    f"{listing}\nFix the above (then check with `python -m "
                    f"klear_jax.rewards.selfcheck`), or set allow_unsandboxed (SandboxConfig("
                    f"allow_unsandboxed=True); RL/eval: --config.reward.code.allow_unsandboxed="
                    f"true; demo: --allow_unsandboxed) to run them with only the isolation "
                    f"that is there ({self.mode}).")
            log.warning("sandbox running WITHOUT full isolation (allow_unsandboxed, mode %s):"
                        "\n  - %s", self.mode, listing)

    def close(self) -> None:
        """Removes this sandbox's cgroup group (also done when it is garbage collected)."""
        if self.cgroups is not None:
            self.cgroups.close()

    # ---------------------------------------------------------------- commands
    def _limits_code(self) -> str:
        c = self.cfg
        return (f"import resource as r\n"
                f"for k, v in ((r.RLIMIT_CPU, {self.cpu_s}), (r.RLIMIT_AS, {c.memory_mb << 20}),"
                f" (r.RLIMIT_NPROC, {c.nproc}), (r.RLIMIT_FSIZE, {c.fsize_mb << 20}),"
                f" (r.RLIMIT_NOFILE, {c.nofile}), (r.RLIMIT_CORE, 0)):\n"
                f"    r.setrlimit(k, (v, v))\n")

    def _bwrap_cmd(self, uid: int | None, prog_fd: int, info_fd: int,
                   seccomp_fd: int | None) -> list[str]:
        c = self.cfg
        pyhome = os.path.dirname(os.path.dirname(self.python))
        cmd = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session",
               "--ro-bind", "/usr", "/usr"]
        for d in ("bin", "lib", "lib64", "sbin"):
            src = f"/{d}"
            if os.path.islink(src):
                cmd += ["--symlink", os.readlink(src), src]
            elif os.path.isdir(src):
                cmd += ["--ro-bind", src, src]
        for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/alternatives"):
            if os.path.exists(f):
                cmd += ["--ro-bind", f, f]
        if not pyhome.startswith("/usr/"):
            cmd += ["--ro-bind", pyhome, pyhome]
        if c.hide_site_packages:
            ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
            site = os.path.join(pyhome, "lib", ver, "site-packages")
            if os.path.isdir(site):
                cmd += ["--tmpfs", site, "--remount-ro", site]
        for p in c.extra_ro_binds:
            cmd += ["--ro-bind", p, p]
        cmd += ["--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(c.shm_kb << 10), "--tmpfs", "/dev/shm",
                "--perms", "1777", "--size", str(c.tmpfs_mb << 20), "--tmpfs", "/tmp",
                "--perms", "0444", "--ro-bind-data", str(prog_fd), "/sbx/prog.py",
                "--chdir", "/tmp", "--info-fd", str(info_fd),
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                "--setenv", "LANG", "C.UTF-8", "--remount-ro", "/"]
        if seccomp_fd is not None:
            cmd += ["--seccomp", str(seccomp_fd)]
        if uid is not None:   # privileged bwrap: rlimits, then drop to the slot uid
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                    self.prlimit, f"--cpu={self.cpu_s}", f"--as={c.memory_mb << 20}",
                    f"--nproc={c.nproc}", f"--fsize={c.fsize_mb << 20}",
                    f"--nofile={c.nofile}", "--core=0", "--",
                    self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
                    self.python, "-I", "-B", "/sbx/prog.py"]
        else:                 # unprivileged bwrap: user namespace, limits set in-process
            cmd.insert(1, "--unshare-user")
            cmd += [self.python, "-I", "-B", "-c",
                    self._limits_code() + "import runpy\nrunpy.run_path('/sbx/prog.py', run_name='__main__')"]
        return cmd

    # ---------------------------------------------------------------- running
    def run(self, program: str | bytes, stdin: str | bytes = b"",
            timeout_s: float | None = None) -> RunResult:
        """Runs `program` (Python source) with `stdin`; blocks until done. Never raises for
        anything the program does; raises SandboxUnavailable if no uid slot is free."""
        if isinstance(program, str):
            program = program.encode()
        if isinstance(stdin, str):
            stdin = stdin.encode()
        timeout_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        if self.mode == "unsandboxed":
            return keyring.call(lambda: self._run_unsandboxed(program, stdin, timeout_s))
        return keyring.call(lambda: self._run_bwrap(program, stdin, timeout_s))

    def _run_bwrap(self, program: bytes, stdin: bytes, timeout_s: float) -> RunResult:
        if self.root:
            with _SlotLock(self.cfg) as uid:
                return self._run_bwrap_as(program, stdin, timeout_s, uid)
        return self._run_bwrap_as(program, stdin, timeout_s, None)

    def _run_bwrap_as(self, program, stdin, timeout_s, uid) -> RunResult:
        cg = self.cgroups.new_run() if self.cgroups else None
        child_fds, parent_fds = [], []
        try:
            prog_fd, in_fd = _memfd("prog", program), _memfd("stdin", stdin)
            child_fds += [prog_fd, in_fd]
            sec_fd = _memfd("seccomp", self.seccomp) if self.seccomp else None
            if sec_fd is not None:
                child_fds.append(sec_fd)
            pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]    # info, stdout, stderr
            parent_fds += [r for r, _ in pipes]
            child_fds += [w for _, w in pipes]
            (info_r, info_w), (out_r, out_w), (err_r, err_w) = pipes
            if uid is not None:   # the program may reopen them (/dev/stdout): its uid owns them
                for w in (out_w, err_w):
                    os.fchown(w, uid, uid)
            cmd = self._bwrap_cmd(uid, prog_fd, info_w, sec_fd)
            if cg is not None:
                cmd = ["/bin/sh", "-c", _SHIM, "sh", str(len(cg.procs_files)),
                       *cg.procs_files, *cmd]
            t0 = time.monotonic()
            proc = subprocess.Popen(
                cmd, stdin=in_fd, stdout=out_w, stderr=err_w,
                pass_fds=[prog_fd, info_w] + ([sec_fd] if sec_fd is not None else []),
                env={"PATH": "/usr/bin:/bin"}, process_group=0)
        except BaseException:
            for fd in child_fds + parent_fds:
                os.close(fd)
            if cg is not None:
                cg.close()
            raise
        for fd in child_fds:
            os.close(fd)
        return self._supervise(proc, t0, timeout_s, out_r, err_r, info_r, uid, cg)

    def _run_unsandboxed(self, program, stdin, timeout_s) -> RunResult:
        in_fd = _memfd("stdin", stdin)
        cg = self.cgroups.new_run() if self.cgroups else None
        with tempfile.TemporaryDirectory(prefix="klear_sbx_") as tmp:
            path = os.path.join(tmp, "prog.py")
            with open(path, "wb") as f:
                f.write(program)
            code = self._limits_code() + f"import runpy\nrunpy.run_path({path!r}, run_name='__main__')"
            cmd = [self.python, "-I", "-B", "-c", code]
            if cg is not None:
                cmd = ["/bin/sh", "-c", _SHIM, "sh", str(len(cg.procs_files)),
                       *cg.procs_files, *cmd]
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            t0 = time.monotonic()
            try:
                proc = subprocess.Popen(
                    cmd, stdin=in_fd, stdout=out_w, stderr=err_w, cwd=tmp,
                    env={"PATH": "/usr/bin:/bin", "HOME": tmp}, start_new_session=True)
            except BaseException:
                for fd in (out_r, err_r):
                    os.close(fd)
                if cg is not None:
                    cg.close()
                raise
            finally:
                for fd in (in_fd, out_w, err_w):
                    os.close(fd)
            return self._supervise(proc, t0, timeout_s, out_r, err_r, None, None, cg)

    def _supervise(self, proc, t0, timeout_s, out_r, err_r, info_r, uid,
                   cg: RunCgroup | None) -> RunResult:
        cap_out, cap_err = self.cfg.max_output_bytes, self.cfg.max_stderr_bytes
        out, err, info = bytearray(), bytearray(), bytearray()
        deadline = t0 + timeout_s
        status = None
        pidfd = None
        sel = selectors.DefaultSelector()
        try:
            sel.register(out_r, selectors.EVENT_READ, "out")
            sel.register(err_r, selectors.EVENT_READ, "err")
            if info_r is not None:
                sel.register(info_r, selectors.EVENT_READ, "info")
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    status = "timeout"
                    break
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fd)
                        if key.data == "info":
                            pidfd = self._open_pid1(info, pidfd)
                        continue
                    if key.data == "out":
                        out += chunk
                        if len(out) > cap_out:
                            status = "output_limit"
                    elif key.data == "err":
                        if len(err) < cap_err:
                            err += chunk[: cap_err - len(err)]
                    else:
                        info += chunk
                        pidfd = self._open_pid1(info, pidfd)
                if status:
                    break
            if status is None:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                    status = "ok"
                except subprocess.TimeoutExpired:
                    status = "timeout"
        finally:
            sel.close()
            if proc.poll() is None:
                self._kill(proc, pidfd)
            proc.wait()
            for fd in (out_r, err_r, info_r, pidfd):
                if fd is not None:
                    os.close(fd)
            if cg is not None:
                cg.close()
        rc = proc.returncode
        if status == "ok" and rc not in (None, 0) and (
                err.startswith(b"klear-sandbox:") or
                (self.mode != "unsandboxed" and err.startswith(b"bwrap:"))):
            status = "error"
        return RunResult(status, rc if status == "ok" else None, bytes(out[:cap_out]),
                         bytes(err), time.monotonic() - t0,
                         cg.memory_peak if cg else None, cg.oom_kills if cg else 0)

    @staticmethod
    def _open_pid1(info: bytearray, pidfd):
        if pidfd is not None:
            return pidfd
        try:
            pid = json.loads(bytes(info))["child-pid"]
        except (ValueError, KeyError):
            return None
        try:
            return os.pidfd_open(pid)
        except OSError:
            return None

    def _kill(self, proc, pidfd):
        """SIGKILL the sandbox's pid 1 (the kernel kills its whole pid namespace), then the
        bwrap process group, and wait for bwrap."""
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            try:
                proc.wait(2.0)
                return
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError as e:
            if e.errno != errno.ESRCH:
                raise
