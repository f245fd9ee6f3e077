"""Adversarial programs: each must score 0, leave no process, file or descriptor behind,
and leave the scorer working. Each attack prints the expected answer only if it worked.
Runs as root (per-slot uids); tests/test_sandbox_user.py runs the hostile probes as an
unprivileged user."""
import dataclasses
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time

import pytest

from klear_jax.rewards import CodeRewardConfig, CodeScorer, SandboxConfig
from klear_jax.rewards import cgroup as cgroup_mod
from klear_jax.rewards import keyring, seccomp, selfcheck
from klear_jax.rewards import sandbox as sandbox_mod
from klear_jax.rewards.cgroup import Cgroups
from klear_jax.rewards.sandbox import Sandbox, _uid_pids

SECRET = "klear-secret-7f3a"
# Slot uids per pytest-xdist worker, so two workers never share (and sweep) a uid range.
UID0 = 62000 + 1000 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
REPO_FILE = os.path.abspath(__file__)


def resp(code):
    return f"<think>x</think>\n```python\n{code}\n```"


def stdio(expected):
    return {"inputs": ["\n"], "outputs": [expected]}


def host_files_owned_by(uids, roots=("/tmp", "/dev/shm", "/work")):
    found = []
    for root in roots:
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x not in (".git", ".venv", "node_modules")]
            for name in dirs + files:
                try:
                    if os.lstat(os.path.join(d, name)).st_uid in uids:
                        found.append(os.path.join(d, name))
                except OSError:
                    pass
    return found


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    os.environ["KLEAR_TEST_SECRET"] = SECRET
    secret_file = tmp_path_factory.mktemp("trainer") / "secret.txt"
    secret_file.write_text(SECRET)
    cfg = SandboxConfig(timeout_s=2.0, num_slots=2, uid_base=UID0, uid_count=16,
                        memory_mb=512, tmpfs_mb=8, max_output_bytes=1 << 16,
                        lock_dir=str(tmp_path_factory.mktemp("locks")))
    fds_before = len(os.listdir("/proc/self/fd"))
    scorer = CodeScorer(CodeRewardConfig(sandbox=cfg))
    yield scorer, str(secret_file)
    scorer.close()
    os.environ.pop("KLEAR_TEST_SECRET")
    uids = set(range(cfg.uid_base, cfg.uid_base + cfg.uid_count))
    assert [p for u in uids for p in _uid_pids(u)] == []
    assert len(os.listdir("/proc/self/fd")) == fds_before


def check_attack(env, code, tests):
    scorer, _ = env
    cfg = scorer.cfg.sandbox
    uids = set(range(cfg.uid_base, cfg.uid_base + cfg.uid_count))
    fds = len(os.listdir("/proc/self/fd"))
    t = time.monotonic()
    assert scorer.score_batch([resp(code)], [tests]) == [0.0]
    assert time.monotonic() - t < 3 * cfg.timeout_s + 5
    assert [p for u in uids for p in _uid_pids(u)] == [], "stray sandbox processes"
    assert len(os.listdir("/proc/self/fd")) == fds, "leaked descriptors"
    # ... and the scorer still works.
    assert scorer.score_batch([resp("print('ok')")], [stdio("ok")]) == [1.0]


ATTACKS = {
    "infinite_loop": ("while True:\n    pass", stdio("ok")),
    "sleep_forever": ("import time\ntime.sleep(1000)\nprint('ok')", stdio("ok")),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                  "        pass", stdio("ok")),
    "fork_then_exit": ("import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n"
                       "        time.sleep(1000)\nprint('no')", stdio("ok")),
    "memory_bomb": ("x = bytearray(4 << 30)\nprint('ok')", stdio("ok")),
    "memory_grow": ("a = []\nwhile True:\n    a.append(bytearray(1 << 24))", stdio("ok")),
    "disk_fill": ("n = 0\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        while True:\n"
                  "            f.write(b'x' * (1 << 20)); n += 1\nexcept OSError:\n    pass\n"
                  "print('ok' if n > 64 else n)", stdio("ok")),
    "shm_fill": ("n = 0\ntry:\n    with open('/dev/shm/fill', 'wb') as f:\n        while True:\n"
                 "            f.write(b'x' * (1 << 20)); n += 1\nexcept OSError:\n    pass\n"
                 "print('ok' if n > 4 else n)", stdio("ok")),
    "env_secret": ("import os\nprint(os.environ.get('KLEAR_TEST_SECRET', 'none'))", stdio(SECRET)),
    "proc_environ": ("import os\nfor p in os.listdir('/proc'):\n    try:\n        d = open(f'/proc/{p}/environ').read()\n"
                     f"        if {SECRET!r} in d: print({SECRET!r}); break\n"
                     "    except Exception:\n        pass", stdio(SECRET)),
    "read_repo_file": (f"print(open({REPO_FILE!r}).read()[:3])", stdio('"""')),
    "read_root": ("import os\nprint(sorted(os.listdir('/root'))[:1], open('/etc/hostname').read())",
                  stdio("x")),
    "write_outside": ("import os\nok = 0\nfor p in ['/klear_pwn', '/usr/klear_pwn', '/etc/klear_pwn', "
                      f"{os.path.dirname(REPO_FILE)!r} + '/klear_pwn', '/root/.pyenv/klear_pwn']:\n"
                      "    try:\n        open(p, 'w').write('x'); ok += 1\n    except OSError:\n"
                      "        pass\nprint('ok' if ok else 'no')", stdio("ok")),
    "kill_parent": ("import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n"
                    "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
                    "print('no')", stdio("ok")),
    "huge_output": ("import sys\nwhile True:\n    sys.stdout.write('ok\\n' * 10000)", stdio("ok")),
    "huge_stderr": ("import sys\nfor _ in range(10 ** 5):\n    sys.stderr.write('e' * 10000)\n"
                    "print('no')", stdio("ok")),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero(env, name):
    code, tests = ATTACKS[name]
    check_attack(env, code, tests)


def test_trainer_file_is_unreadable(env):
    _, secret_file = env
    check_attack(env, f"print(open({secret_file!r}).read())", stdio(SECRET))


def test_network_connect_to_host_listener(env):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(5)
    port = srv.getsockname()[1]
    hits = []
    threading.Thread(target=lambda: hits.append(_accept(srv)), daemon=True).start()
    try:
        check_attack(env, "import socket\ntry:\n"
                          f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                          "    print(s.recv(10).decode())\nexcept OSError:\n    print('no')",
                     stdio("ok"))
        check_attack(env, "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), "
                          "timeout=1)\n    print('ok')\nexcept OSError:\n    print('no')",
                     stdio("ok"))
    finally:
        srv.close()
    assert hits in ([], [None])


def _accept(srv):
    try:
        conn, _ = srv.accept()
        conn.sendall(b"ok")
        conn.close()
        return "connected"
    except OSError:
        return None


CALL = {"fn_name": "f", "inputs": [[3]], "outputs": [42]}
TAMPER = {
    "exit_before_tests": "import sys\nsys.exit(0)\ndef f(x):\n    return 42",
    "os_exit_before_tests": "import os\nos._exit(0)\ndef f(x):\n    return 42",
    "rigged_eq": "class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return A()",
    "rigged_int": "class I(int):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return I(1)",
    "patch_json_print": ("import json, builtins, sys, os\njson.dumps = lambda *a, **k: '42'\n"
                         "builtins.print = lambda *a, **k: None\nsys.exit = lambda *a: None\n"
                         "os.write = lambda *a: 0\ndef f(x):\n    return 0"),
    "fake_markers": ("import sys\nfor line in sys.stdin: print(line)\nprint('PASS True 42')\n"
                     "def f(x):\n    print('0' * 32, 42)\n    return 0"),
    "stolen_nonce_wrong_value": ("import __main__, os\n"
                                 "os.write(1, (__main__._nonce + ' 41\\n').encode())\n"
                                 "os._exit(0)\ndef f(x):\n    return 41"),
    "exit_in_call": "import sys\ndef f(x):\n    sys.exit(0)",
    "hang_in_call": "def f(x):\n    while True: pass",
}


@pytest.mark.parametrize("name", sorted(TAMPER))
def test_harness_tampering_scores_zero(env, name):
    check_attack(env, TAMPER[name], CALL)


def test_honest_call_based_passes(env):
    scorer, _ = env
    assert scorer.score_batch([resp("def f(x):\n    return 42")], [CALL]) == [1.0]


def test_timeout_kills_sandbox_promptly():
    cfg = SandboxConfig(timeout_s=1.0, num_slots=1, uid_base=UID0 + 100, uid_count=4)
    sb = Sandbox(cfg)
    t = time.monotonic()
    res = sb.run("import os, time\nfor _ in range(10):\n    try:\n        os.fork()\n"
                 "    except OSError:\n        pass\ntime.sleep(100)")
    assert res.status == "timeout" and time.monotonic() - t < 5
    assert [p for u in range(UID0 + 100, UID0 + 104) for p in _uid_pids(u)] == []
    res = sb.run("import os\nprint(os.getuid(), len(os.listdir('/proc')))")
    assert res.ok and int(res.stdout.split()[0]) >= UID0 + 100


def test_no_files_left_by_sandbox_uids(env):
    scorer, _ = env
    cfg = scorer.cfg.sandbox
    uids = set(range(cfg.uid_base, cfg.uid_base + cfg.uid_count))
    assert host_files_owned_by(uids) == []


# ---------------------------------------------------------------- issue 23: the hardened sandbox
# The hostile probes of `python -m klear_jax.rewards.selfcheck` (items 1-6), as root here;
# tests/test_sandbox_user.py runs them as an unprivileged user with a delegated cgroup.
PROBE_NAMES = [p.name for p in selfcheck.probes()]


@pytest.fixture(scope="module")
def probe_scorer(tmp_path_factory):
    """The self-check's scorer (memory.max 256 MB), with a token planted in this process's
    session keyring the way a trainer might hold one."""
    token = "klear-" + secrets.token_hex(8)
    serial = keyring.add_key("klear-test-token", token.encode())
    cfg = dataclasses.replace(selfcheck.CONFIG, uid_base=UID0 + 200, uid_count=8,
                              lock_dir=str(tmp_path_factory.mktemp("probe_locks")))
    with CodeScorer(CodeRewardConfig(sandbox=cfg)) as scorer:
        yield scorer, token, serial
        group = scorer.sandbox.cgroups.groups
    assert not any(os.path.exists(g) for g in group), "group cgroups left after close"


@pytest.mark.parametrize("name", PROBE_NAMES)
def test_hostile_probe_as_root(probe_scorer, name):
    """No reward not earned, a benign program right after scores full, nothing left behind,
    and (memory probes) the memory held for the runs stays within memory.max + margin."""
    scorer, token, serial = probe_scorer
    probe = next(p for p in selfcheck.probes(serial) if p.name == name)
    r = selfcheck.run(scorer, probe, token)
    assert r["holds"], r
    if probe.pins_memory and name != "userns_tmpfs":   # the attack reached the limit
        assert r["held_mb"] > 0.5 * r["limit_mb"], r


def test_seccomp_filter_is_what_refuses(tmp_path):
    """The same probe program without the filter escapes: the filter does the refusing."""
    sb = Sandbox(SandboxConfig(timeout_s=5.0, num_slots=1, uid_base=UID0 + 300, uid_count=2,
                               lock_dir=str(tmp_path)))
    try:
        code = next(p.code for p in selfcheck.probes() if p.name == "seccomp")
        assert sb.run(code).stdout.split() == [b"refused"]
        sb.seccomp = None
        res = sb.run(code)           # prints ok, and what escaped to stderr
        escaped = set(res.stderr.decode().split())
        assert res.stdout == b"ok\n" and {"unshare", "clone3", "keyctl", "add_key"} <= escaped, res
    finally:
        sb.close()


def test_seccomp_syscall_numbers_match_kernel_headers():
    headers = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
               "aarch64": "/usr/include/asm-generic/unistd.h"}
    checked = 0
    for col, (arch, path) in enumerate(headers.items()):
        if not os.path.exists(path):
            continue
        text = open(path).read()
        for name, nrs in {**seccomp.DENY, "clone": seccomp.CLONE, "clone3": seccomp.CLONE3}.items():
            m = re.search(rf"#define __NR(?:3264)?_{name}\s+(\d+)", text)
            if m:
                assert int(m.group(1)) == nrs[col], (arch, name)
                checked += 1
        prog = seccomp.filter_bytes(arch)
        assert len(prog) % 8 == 0 and len(prog) // 8 < 256
    if not checked:
        pytest.skip("no kernel headers to check the syscall numbers against")


KEY_READER = ("import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "buf = ctypes.create_string_buffer(256)\n"
              "n = libc.syscall(ctypes.c_long({nr}), ctypes.c_long(11), ctypes.c_long({serial}),"
              " buf, ctypes.c_long(256))\nprint(buf.raw[:n].decode() if n > 0 else 'no')\n")


def test_fresh_session_keyring_per_run_keeps_the_trainers(tmp_path):
    """Independently of seccomp: a child started through keyring.call holds an empty
    session keyring (cannot read the trainer's key), while a plain child can, and the
    calling thread keeps its own keyring and key."""
    out = {}

    def trainer_thread():
        keyring.join_fresh_session_keyring()
        token = "klear-" + secrets.token_hex(8)
        serial = keyring.add_key("klear-test", token.encode())
        mine = keyring.session_keyring_id()
        code = KEY_READER.format(nr=keyring._NR[os.uname().machine]["keyctl"], serial=serial)
        cmd = [sys.executable, "-c", code]
        out["plain"] = subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
        out["fresh"] = keyring.call(
            lambda: subprocess.run(cmd, capture_output=True, text=True)).stdout.strip()
        sb = Sandbox(SandboxConfig(timeout_s=5.0, num_slots=1, uid_base=UID0 + 310, uid_count=2,
                                   lock_dir=str(tmp_path)))
        sb.seccomp = None           # the keyring alone keeps the sandbox out
        out["sandbox"] = sb.run(code).stdout.decode().strip()
        sb.close()
        out["kept"] = keyring.session_keyring_id() == mine and keyring.read_key(serial) == token.encode()
        out["token"] = token

    t = threading.Thread(target=trainer_thread)
    t.start()
    t.join()
    assert out["plain"] == out["token"]          # the attack a plain child could make
    assert out["fresh"] == "no" and out["sandbox"] == "no"
    assert out["kept"]


def test_run_cgroup_limits_kill_and_removal():
    cg = Cgroups.detect(memory_bytes=64 << 20, pids_max=10, group_memory_bytes=128 << 20)
    try:
        for g, t in zip(cg.groups, cg.trees):     # all runs together: the group's limit
            if "memory" in t.controllers:
                name = "memory.max" if t.version == 2 else "memory.limit_in_bytes"
                assert int(open(os.path.join(g, name)).read()) == 128 << 20
        run = cg.new_run()
        for d, v in zip(run.dirs, run.versions):
            files = os.listdir(d)
            if "pids.max" in files:
                assert open(os.path.join(d, "pids.max")).read().strip() == "10"
            if v == 2 and "memory.max" in files:
                assert open(os.path.join(d, "memory.max")).read().strip() == str(64 << 20)
                if "memory.swap.max" in files:
                    assert open(os.path.join(d, "memory.swap.max")).read().strip() == "0"
            if v == 1 and "memory.limit_in_bytes" in files:
                assert int(open(os.path.join(d, "memory.limit_in_bytes")).read()) == 64 << 20
                if "memory.memsw.limit_in_bytes" in files:   # RAM + swap = RAM: no swap
                    assert int(open(os.path.join(d, "memory.memsw.limit_in_bytes")).read()) == 64 << 20
        # a process tree that daemonizes and ignores its parent: killed as a unit
        proc = subprocess.Popen(["/bin/sh", "-c", sandbox_mod._SHIM, "sh",
                                 str(len(run.procs_files)), *run.procs_files, "/bin/sh", "-c",
                                 "(setsid sleep 300 &) ; sleep 300 & sleep 300"])
        deadline = time.monotonic() + 5
        while len({p for d in run.dirs for p in cgroup_mod._members(d)}) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        members = {p for d in run.dirs for p in cgroup_mod._members(d)}
        assert run.close()
        proc.wait(5)
        assert not any(os.path.exists(f"/proc/{p}/cgroup") and
                       any(d.split("/sys/fs/cgroup")[-1] in open(f"/proc/{p}/cgroup").read()
                           for d in run.dirs) for p in members)
        assert not any(os.path.exists(d) for d in run.dirs)
        assert run.memory_peak is not None
    finally:
        cg.close()
    assert not any(os.path.exists(g) for g in cg.groups)


def test_stale_groups_of_dead_trainers_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    cg = Cgroups.detect(memory_bytes=64 << 20, pids_max=10)
    stale = [os.path.join(t.base, f"{dead.pid}-0") for t in cg.trees]
    cg.close()
    for d in stale:
        os.makedirs(os.path.join(d, "r3"))
    Cgroups.detect(memory_bytes=64 << 20, pids_max=10).close()
    assert not any(os.path.exists(d) for d in stale)


def test_userns_hint_names_apparmor(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "_sysctl", lambda name: {
        "kernel/apparmor_restrict_unprivileged_userns": "1"}.get(name))
    assert "apparmor_parser" in sandbox_mod.userns_hint()
    monkeypatch.setattr(sandbox_mod, "_sysctl", lambda name: {
        "user/max_user_namespaces": "0"}.get(name))
    assert "user.max_user_namespaces" in sandbox_mod.userns_hint()
