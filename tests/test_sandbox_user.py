"""The hostile probes as an unprivileged user, the way a Cloud TPU VM user runs: bubblewrap
without root (a user namespace) and run cgroups inside a cgroup delegated to the user.

CI runs as root, so this creates a system user and delegates a cgroup to it the way systemd
does for `systemd-run --user --scope -p Delegate=yes` (cgroup v2: a cgroup with memory and
pids for its children, chowned with its cgroup.procs / subtree_control / threads files;
cgroup v1: a chowned cgroup in the memory and pids hierarchies), then runs
`python -m klear_jax.rewards.selfcheck --json` as that user inside it. Also: without the
delegated cgroup, or without user namespaces, code rewards refuse to start and say what
is missing; allow_unsandboxed still runs.
"""
import json
import os
import pwd
import shutil
import subprocess
import sys
import time

import pytest

from klear_jax.rewards import keyring, selfcheck
from klear_jax.rewards.cgroup import _find_trees, _members, _rmdir_tree
from klear_jax.rewards.sandbox import _SHIM

USER = "klearsbx" + os.environ.get("PYTEST_XDIST_WORKER", "gw0")   # one per xdist worker
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="creates a user and delegates a cgroup: needs root and useradd")


def _as_user(pw, python, args, procs_files=(), timeout=300):
    """Runs `python args` as the user (no caps, own fresh session keyring), first joining
    `procs_files` (cgroups), from a clean environment."""
    cmd = ["/bin/sh", "-c", _SHIM, "sh", str(len(procs_files)), *procs_files,
           shutil.which("setpriv"), f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}",
           "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--", python, *args]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": REPO, "HOME": "/tmp",
           "LANG": "C.UTF-8"}
    return keyring.call(lambda: subprocess.run(cmd, capture_output=True, text=True, env=env,
                                               cwd="/tmp", timeout=timeout))


@pytest.fixture(scope="module")
def user():
    created = False
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        for _ in range(20):     # another worker's useradd may hold /etc/passwd's lock
            proc = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                                   "/usr/sbin/nologin", USER], capture_output=True, text=True)
            if proc.returncode == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"useradd {USER}: {proc.stderr}")
        pw, created = pwd.getpwnam(USER), True
    try:    # an interpreter the user can run that can import klear_jax from this checkout
        for python in dict.fromkeys([os.path.realpath(sys.executable), "/usr/bin/python3"]):
            check = ("import os, sys, klear_jax.rewards\n"   # bwrap must see the interpreter too
                     "os.stat(os.path.dirname(os.path.realpath(sys.executable)))")
            if os.path.exists(python) and _as_user(
                    pw, python, ["-c", check], timeout=60).returncode == 0:
                break
        else:
            pytest.skip(f"no Python interpreter the user {USER} can run imports klear_jax from "
                        f"{REPO} (is it readable by other users?)")
        yield pw, python
    finally:
        if created:
            subprocess.run(["userdel", USER], capture_output=True)


@pytest.fixture(scope="module")
def delegated(user):
    """cgroup.procs files of cgroups delegated to the user (one per hierarchy)."""
    pw, _ = user
    dirs = []
    for t in _find_trees():
        d = os.path.join(t.parent, f"klear_test_{USER}")
        os.makedirs(d, exist_ok=True)
        dirs.append(d)
        if t.version == 2:
            with open(os.path.join(t.parent, "cgroup.subtree_control")) as f:
                if not set(t.controllers) <= set(f.read().split()):
                    with open(os.path.join(t.parent, "cgroup.subtree_control"), "w") as g:
                        g.write(" ".join("+" + c for c in t.controllers))
        for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads", "tasks"):
            if os.path.exists(os.path.join(d, name)):
                os.chown(os.path.join(d, name), pw.pw_uid, pw.pw_gid)
    yield [os.path.join(d, "cgroup.procs") for d in dirs]
    for d in dirs:
        for sub, _, _ in os.walk(d):
            for pid in _members(sub):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        _rmdir_tree(d)


@pytest.fixture(scope="module")
def user_report(user, delegated):
    pw, python = user
    proc = _as_user(pw, python, ["-m", "klear_jax.rewards.selfcheck", "--json"], delegated)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"selfcheck as {USER} printed no JSON (rc {proc.returncode}):\n"
                    f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    assert "error" not in report, report["error"]
    for r in report["results"]:   # shown with -s / on failure
        print(f"as {USER}: {r['probe']}: holds {r['holds']}, reward {r['reward']}, held "
              f"+{r['held_mb']} MB, host-wide +{r['host_mb']} MB, {r['failures']}")
    return report


def test_user_sandbox_is_unprivileged_bwrap_with_delegated_cgroups(user_report):
    assert user_report["mode"] == "bwrap-user"
    assert f"klear_test_{USER}" in user_report["cgroups"]


@pytest.mark.parametrize("name", [p.name for p in selfcheck.probes()])
def test_hostile_probe_as_unprivileged_user(user_report, name):
    """The same criteria as as root: no reward not earned, benign full right after, nothing
    left behind, memory held within memory.max + margin."""
    (r,) = [r for r in user_report["results"] if r["probe"] == name]
    assert r["holds"], r
    if r["pins_memory"] and name != "userns_tmpfs":   # the attack reached the limit
        assert r["held_mb"] > 0.5 * r["limit_mb"], r


REFUSAL = ("from klear_jax.rewards import Sandbox, SandboxConfig, SandboxUnavailable\n"
           "try:\n    Sandbox(SandboxConfig(num_slots=1))\n    print('STARTED')\n"
           "except SandboxUnavailable as e:\n    print(e)\n"
           "sb = Sandbox(SandboxConfig(num_slots=1, allow_unsandboxed=True))\n"
           "print('ALLOWED', sb.mode, sb.run('print(6 * 7)').stdout.decode().strip())\n")


def test_user_without_delegated_cgroup_refuses_with_how_to(user):
    """The user process stays in root's cgroup (not writable): code rewards refuse and say
    how to get a delegated cgroup; allow_unsandboxed runs bwrap without the cgroup."""
    pw, python = user
    out = _as_user(pw, python, ["-c", REFUSAL], timeout=120).stdout
    assert "STARTED" not in out, out
    assert "no per-run cgroup" in out and "Delegate=yes" in out, out
    assert "ALLOWED bwrap-user 42" in out, out


def test_user_without_user_namespaces_refuses_with_how_to(user, delegated):
    """Inside a sandbox that forbids further user namespaces (bwrap --disable-userns, the
    state of a host without them), the check says bubblewrap cannot start and why."""
    pw, python = user
    outer = [shutil.which("bwrap"), "--dev-bind", "/", "/", "--unshare-user", "--disable-userns",
             "--", python, "-c", REFUSAL]
    proc = _as_user(pw, outer[0], outer[1:], delegated, timeout=120)
    if "disable-userns" in proc.stderr:
        pytest.skip(f"this bwrap has no --disable-userns: {proc.stderr.strip()}")
    assert "STARTED" not in proc.stdout, proc.stdout + proc.stderr
    assert "bubblewrap cannot start a sandbox here" in proc.stdout, proc.stdout + proc.stderr
    assert "namespace" in proc.stdout, proc.stdout
