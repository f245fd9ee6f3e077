"""tpu_scripts/: the exact gcloud commands of --dry-run, settings validation, shellcheck,
and the worker-side shell snippets executed for real in a temporary $HOME."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tpu_scripts"
ALL = ["create.sh", "setup.sh", "run.sh", "logs.sh", "status.sh", "delete.sh"]
LOC = ["--project=proj-1", "--zone=us-east5-a"]
BASE = {"KLEAR_TPU_PROJECT": "proj-1", "KLEAR_TPU_ZONE": "us-east5-a", "KLEAR_TPU_NAME": "klear-v5p"}
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "klear-v5p", *LOC]


def _env(extra=None, path_prefix=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLEAR_TPU_")}
    env.update(extra or {})
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    return env


def script(name, *args, env=None, scripts=SCRIPTS, path_prefix=None, check=False):
    proc = subprocess.run(["bash", str(scripts / name), *args], env=_env(env, path_prefix),
                          capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, f"{name} {args} failed: {proc.stderr}"
    return proc


def dry(name, *args, env=BASE):
    """Run NAME with --dry-run; return each printed command as an argv list ('# ' lines,
    run.sh's per-worker commands, aside: see worker_commands)."""
    proc = script(name, "--dry-run", *args, env=env, check=True)
    return [shlex.split(line) for line in proc.stdout.splitlines() if not line.startswith("# ")]


def worker_commands(*args, env=BASE):
    """run.sh --dry-run's '# worker N: COMMAND' lines as {N: argv}."""
    proc = script("run.sh", "--dry-run", *args, env=env, check=True)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("# worker "):
            w, cmd = line[len("# worker "):].split(": ", 1)
            out[w] = shlex.split(cmd)
    return out


def remote_of(argv):
    """The --command=... value of a gcloud tpu-vm ssh argv."""
    (cmd,) = [a[len("--command="):] for a in argv if a.startswith("--command=")]
    return cmd


# ---------------------------------------------------------------------------- create.sh

def test_create_on_demand_v5p():
    assert dry("create.sh", "--accelerator-type=v5p-64") == [[
        "gcloud", "compute", "tpus", "tpu-vm", "create", "klear-v5p", *LOC,
        "--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5"]]


def test_create_spot_v6e_from_env_only():
    env = {"KLEAR_TPU_PROJECT": "p2", "KLEAR_TPU_ZONE": "europe-west4-a", "KLEAR_TPU_NAME": "t6",
           "KLEAR_TPU_TYPE": "v6e-64", "KLEAR_TPU_SPOT": "1"}
    assert dry("create.sh", env=env) == [[
        "gcloud", "compute", "tpus", "tpu-vm", "create", "t6", "--project=p2",
        "--zone=europe-west4-a", "--accelerator-type=v6e-64", "--version=v2-alpha-tpuv6e",
        "--spot"]]


def test_create_queued_spot_with_deadline():
    assert dry("create.sh", "--accelerator-type", "v5p-64", "--queued", "--spot",
               "--valid-until-duration=6h") == [[
        "gcloud", "compute", "tpus", "queued-resources", "create", "klear-v5p", *LOC,
        "--node-id=klear-v5p", "--accelerator-type=v5p-64", "--runtime-version=v2-alpha-tpuv5",
        "--spot", "--valid-until-duration=6h"]]


def test_create_queued_on_demand_from_env_and_flags_override_env():
    env = dict(BASE, KLEAR_TPU_QUEUED="1", KLEAR_TPU_SPOT="1", KLEAR_TPU_TYPE="v6e-64",
               KLEAR_TPU_RUNTIME="v2-alpha-tpuv6e-custom")
    (argv,) = dry("create.sh", "--on-demand", "--project", "other", "--name=n2", env=env)
    assert argv == ["gcloud", "compute", "tpus", "queued-resources", "create", "n2",
                    "--project=other", "--zone=us-east5-a", "--node-id=n2",
                    "--accelerator-type=v6e-64", "--runtime-version=v2-alpha-tpuv6e-custom"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("var", ["KLEAR_TPU_PROJECT", "KLEAR_TPU_ZONE", "KLEAR_TPU_NAME"])
def test_missing_required_setting_is_named(name, var):
    env = {k: v for k, v in dict(BASE, KLEAR_TPU_TYPE="v5p-64").items() if k != var}
    extra = ["--", "true"] if name == "run.sh" else []
    proc = script(name, "--dry-run", *extra, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{var} is not set" in proc.stderr


@pytest.mark.parametrize("args,env,message", [
    ([], BASE, "KLEAR_TPU_TYPE is not set"),
    (["--accelerator-type=tpu64"], BASE, "KLEAR_TPU_TYPE 'tpu64' is not an accelerator type"),
    (["--accelerator-type=v9z-8"], BASE, "no default runtime version for KLEAR_TPU_TYPE 'v9z-8'"),
    (["--accelerator-type=v5p-64"], dict(BASE, KLEAR_TPU_SPOT="yes"), "KLEAR_TPU_SPOT must be 0 or 1"),
    (["--accelerator-type=v5p-64", "--name=My_TPU"], BASE, "KLEAR_TPU_NAME 'My_TPU'"),
    (["--accelerator-type=v5p-64", "--valid-until-duration=1h"], BASE, "KLEAR_TPU_VALID_UNTIL only"),
    (["--accelerator-type=v5p-64", "--bucket=gs://b"], BASE, "KLEAR_TPU_BUCKET 'gs://b'"),
    (["--accelerator-type=v5p-64", "--frobnicate"], BASE, "unknown argument '--frobnicate'"),
    (["--zone"], BASE, "flag --zone needs a value (KLEAR_TPU_ZONE)"),
])
def test_create_rejects_bad_settings(args, env, message):
    proc = script("create.sh", "--dry-run", *args, env=env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ALL)
def test_help(name):
    proc = script(name, "--help", env={}, check=True)
    assert proc.stdout.startswith(f"Usage: tpu_scripts/{name}")
    assert "KLEAR_TPU_PROJECT" in proc.stdout and "--dry-run" in proc.stdout


# --------------------------------------------------------------- delete / status / logs

def test_delete_stops_then_deletes_the_vm():
    stop, delete = dry("delete.sh", "--grace=60")
    assert stop[:-1] == [*SSH, "--worker=all"]
    assert "kill -TERM" in remote_of(stop) and "-lt 60" in remote_of(stop)
    assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "klear-v5p", *LOC, "--quiet"]


def test_delete_queued_resource_with_its_node():
    assert dry("delete.sh", "--queued", "--no-stop") == [[
        "gcloud", "compute", "tpus", "queued-resources", "delete", "klear-v5p", *LOC,
        "--force", "--quiet"]]
    (stop,) = dry("delete.sh", "--stop-only", "--run=sft")
    assert "klear_jax/logs/sft.pid" in remote_of(stop)
    assert script("delete.sh", "--dry-run", "--stop-only", "--no-stop", env=BASE).returncode == 2


def test_status_plain_queued_and_jobs():
    assert dry("status.sh") == [["gcloud", "compute", "tpus", "tpu-vm", "describe", "klear-v5p", *LOC]]
    qr, vm, jobs = dry("status.sh", "--queued", "--jobs")
    assert qr == ["gcloud", "compute", "tpus", "queued-resources", "describe", "klear-v5p", *LOC]
    assert vm == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "klear-v5p", *LOC]
    assert jobs[:-1] == [*SSH, "--worker=all"]


def test_logs_collect_tail_follow_gcs():
    mk, ssh = dry("logs.sh", "--run=gppo")
    assert mk == ["mkdir", "-p", "tpu_logs/klear-v5p/gppo"]
    assert ssh == [*SSH, "--worker=all", "--command=cat klear_jax/logs/gppo.worker*.log",
                   "--output-directory=tpu_logs/klear-v5p/gppo"]
    _, ssh = dry("logs.sh", "--tail=50", "--out=/tmp/l x")
    assert ssh[-2:] == ["--command=tail -n 50 klear_jax/logs/main.worker*.log", "--output-directory=/tmp/l x"]
    assert dry("logs.sh", "--follow", "--worker=3") == [
        [*SSH, "--worker=3", "--command=tail -n 100 -F klear_jax/logs/main.worker*.log"]]
    assert dry("logs.sh", "--gcs", "--bucket=my-bkt") == [[*SSH, "--worker=all",
        "--command=gcloud storage cp klear_jax/logs/main.worker*.log gs://my-bkt/runs/klear-v5p/logs/"]]
    proc = script("logs.sh", "--dry-run", "--gcs", env=BASE)
    assert proc.returncode == 2 and "KLEAR_TPU_BUCKET is not set" in proc.stderr


# -------------------------------------------------------------------------- setup.sh

def test_setup_local_copy_commands():
    pack, scp, ssh = dry("setup.sh", "--bucket=my-bkt", env=dict(BASE, TMPDIR="/tmp/x"))
    assert " ".join(pack).startswith(f"git -C {ROOT} ls-files -z --cached --others --exclude-standard | tar")
    assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "/tmp/x/klear_jax-src-klear-v5p.tar.gz",
                   "klear-v5p:klear_jax-src.tar.gz", *LOC, "--worker=all"]
    assert ssh[:-1] == [*SSH, "--worker=all"]
    steps = remote_of(ssh).split(" && ")
    assert "install -y bubblewrap git python3.11 python3.11-venv" in steps[1]
    for step in ["tar -xzf klear_jax-src.tar.gz -C klear_jax", "cd klear_jax",
                 "{ [ -x .venv/bin/python ] || python3.11 -m venv .venv; }",
                 ".venv/bin/python -m pip install -q -r requirements-tpu.txt",
                 "bwrap --version", "gcloud storage ls gs://my-bkt > /dev/null"]:
        assert step in steps
    assert steps.index("cd klear_jax") < steps.index("bwrap --version")
    assert steps[-1].startswith(".venv/bin/python -c 'import jax;")


def test_setup_git_clone_and_code_only():
    (ssh,) = dry("setup.sh", "--repo=https://example.com/k.git", "--ref=origin/dev", "--no-check",
                 "--python=python3.12", "--remote-dir=src/kj")
    steps = remote_of(ssh).split(" && ")
    assert "{ [ -d src/kj/.git ] || git clone -q https://example.com/k.git src/kj; }" in steps
    assert "git -C src/kj checkout -q --detach origin/dev" in steps
    assert "python3.12 -m venv" in remote_of(ssh) and "import jax" not in remote_of(ssh)
    _, _, ssh = dry("setup.sh", "--code-only")
    assert remote_of(ssh) == ("mkdir -p klear_jax && tar -xzf klear_jax-src.tar.gz -C klear_jax"
                              " && rm -f klear_jax-src.tar.gz")


def _fake_bin(tmp_path, worker="3", endpoints=None):
    """gcloud that records its argv (the real one needs a project); curl that answers the
    metadata server's agent-worker-number and worker-network-endpoints (fails: None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(
        f'#!{sys.executable}\nimport json, sys\n'
        f'open({str(tmp_path / "gcloud.jsonl")!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")\n')
    endpoints = "exit 22" if endpoints is None else f"echo {shlex.quote(endpoints)}"
    (bin_dir / "curl").write_text(
        f'#!/bin/sh\ncase "$*" in *worker-network-endpoints*) {endpoints} ;; *) echo {worker} ;; esac\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_setup_executes_what_dry_run_prints_and_packs_the_tree(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(SCRIPTS, repo / "tpu_scripts")
    (repo / "requirements-tpu.txt").write_text("jax[tpu]\n")
    (repo / "untracked.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / ".venv").mkdir()
    (repo / ".venv" / "big").write_text("ignored")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "tpu_scripts", "requirements-tpu.txt", ".gitignore"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    bin_dir = _fake_bin(tmp_path)
    env = dict(BASE, TMPDIR=str(tmp_path))
    printed = [shlex.split(l) for l in script("setup.sh", "--dry-run", env=env, scripts=repo / "tpu_scripts",
                                              check=True).stdout.splitlines()]
    script("setup.sh", env=env, scripts=repo / "tpu_scripts", path_prefix=bin_dir, check=True)
    ran = [json.loads(l) for l in (tmp_path / "gcloud.jsonl").read_text().splitlines()]
    assert [["gcloud", *a] for a in ran] == printed[1:]
    with tarfile.open(tmp_path / "klear_jax-src-klear-v5p.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"tpu_scripts/common.sh", "tpu_scripts/run.sh", "untracked.py", ".gitignore"} <= names
    assert not any(n.startswith(".venv") for n in names)


# ---------------------------------------------------------------------------- run.sh

GPPO = ["python", "-m", "klear_jax.rl", "--config=configs/gppo_math_qwen3_8b.py",
        "--config.workdir=gs://my-bkt/runs/klear-v5p"]


def test_run_foreground_command():
    (ssh,) = dry("run.sh", "--", *GPPO)
    assert ssh[:-1] == [*SSH, "--worker=all"]
    remote = remote_of(ssh)
    assert remote.startswith("set -o pipefail && cd klear_jax && mkdir -p logs && . .venv/bin/activate && W=$(curl")
    assert remote.endswith(f"&& {{ {shlex.join(GPPO)}; }} 2>&1 | tee -a logs/main.worker$W.log")


def test_run_background_and_worker_subset():
    (ssh,) = dry("run.sh", "--background", "--worker=0-3", "--run=gppo", "--", *GPPO)
    assert ssh[:-1] == [*SSH, "--worker=0-3"]
    assert f"nohup bash -c {shlex.quote('exec ' + shlex.join(GPPO))} >> logs/gppo.worker$W.log" in remote_of(ssh)
    assert script("run.sh", "--dry-run", env=BASE).stderr.startswith("error: no command given")
    assert "--worker must be" in script("run.sh", "--dry-run", "--worker=x", "--", "t", env=BASE).stderr


def _worker_home(tmp_path):
    """A worker's $HOME: ~/klear_jax with a real (pip-less) venv."""
    home = tmp_path / "home"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / "klear_jax" / ".venv")],
                   check=True)
    return home


def _on_worker(remote, home, bin_dir, timeout=60):
    env = _env({"HOME": str(home)}, path_prefix=bin_dir)
    return subprocess.run(["bash", "-c", remote], cwd=home, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_run_foreground_executes_on_a_worker(tmp_path):
    home, bin_dir = _worker_home(tmp_path), _fake_bin(tmp_path, worker="5")
    job = ["python", "-c", "import sys; print('hello', sys.prefix.endswith('.venv'), 'it''s')"]
    (ssh,) = dry("run.sh", "--", *job)
    proc = _on_worker(remote_of(ssh), home, bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hello True its\n"
    log = (home / "klear_jax/logs/main.worker5.log").read_text().splitlines()
    assert log[0].startswith("=== ") and log[0].endswith(f"main on worker 5: {shlex.join(job)}")
    assert log[1:] == ["hello True its"]
    (ssh,) = dry("run.sh", "--", "python", "-c", "raise SystemExit(3)")
    assert _on_worker(remote_of(ssh), home, bin_dir).returncode == 3  # pipefail keeps the job's status


def test_run_dry_run_prints_each_workers_command():
    """The per-worker command: the multi-host settings a worker exports (what
    tests/multihost.py gives each local process, with worker 0's address for 127.0.0.1)."""
    v5p = dict(BASE, KLEAR_TPU_TYPE="v5p-64")
    got = worker_commands("--", *GPPO, env=v5p)
    assert list(got) == [str(i) for i in range(8)]
    for i, argv in got.items():
        assert argv == ["KLEAR_COORDINATOR=<worker 0 address>:8482", "KLEAR_NUM_PROCESSES=8",
                        f"KLEAR_PROCESS_ID={i}", *GPPO]
    got = worker_commands("--coordinator-port=9000", "--worker=0-1,5", "--", "t", env=v5p)
    assert {w: a[0] + " " + a[2] for w, a in got.items()} == {
        w: f"KLEAR_COORDINATOR=<worker 0 address>:9000 KLEAR_PROCESS_ID={w}" for w in "015"}
    assert worker_commands("--", "t", env=dict(BASE, KLEAR_TPU_TYPE="v6e-8")) == {"0": ["t"]}
    assert list(worker_commands("--", "t", env=dict(BASE, KLEAR_TPU_TYPE="v6e-64"))) == [
        str(i) for i in range(16)]
    assert "<N>" in worker_commands("--", "t")  # no type: the worker count is unknown
    assert "not a TCP port" in script("run.sh", "--dry-run", "--coordinator-port=0", "--", "t",
                                      env=BASE).stderr


def test_run_exports_multihost_settings_on_a_worker(tmp_path):
    """On a worker of a 4-host slice the job sees the settings from the metadata server,
    in both endpoint formats; set ones win; a single-host slice exports none."""
    job = ["python", "-c", "import os; print([os.environ.get('KLEAR_' + k) for k in "
           "('COORDINATOR', 'NUM_PROCESSES', 'PROCESS_ID')])"]
    (ssh,) = dry("run.sh", "--", *job)
    for endpoints, coordinator in [("w-0:0:10.1.0.7,w-1:1:10.1.0.8,w-2:2:10.1.0.9,w-3:3:10.1.0.6",
                                    "10.1.0.7"), ("t1v-w-0,t1v-w-1,t1v-w-2,t1v-w-3", "t1v-w-0")]:
        home = _worker_home(tmp_path / coordinator)
        bin_dir = _fake_bin(tmp_path / coordinator, worker="2", endpoints=endpoints)
        proc = _on_worker(remote_of(ssh), home, bin_dir)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"['{coordinator}:8482', '4', '2']\n"
        log = (home / "klear_jax/logs/main.worker2.log").read_text().splitlines()
        assert f"main on worker 2: KLEAR_COORDINATOR={coordinator}:8482 KLEAR_NUM_PROCESSES=4 " \
               f"KLEAR_PROCESS_ID=2 python -c" in log[0]
    env = _env({"HOME": str(home), "KLEAR_PROCESS_ID": "7"}, path_prefix=bin_dir)
    proc = subprocess.run(["bash", "-c", remote_of(ssh)], cwd=home, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout == "['t1v-w-0:8482', '4', '7']\n", proc.stderr
    home = _worker_home(tmp_path / "single")
    bin_dir = _fake_bin(tmp_path / "single", worker="0", endpoints="t1v-w-0")
    assert _on_worker(remote_of(ssh), home, bin_dir).stdout == "[None, None, None]\n"


# One line: dry-run prints one command per line, so the job avoids literal newlines.
JOB = ("import signal, sys, time; "
       "signal.signal(signal.SIGTERM, lambda *_: (print('SIGTERM: checkpoint saved', flush=True), sys.exit(0))); "
       "print('training', flush=True); "
       "[time.sleep(0.1) for _ in iter(int, 1)]")


def test_background_run_status_and_sigterm_stop_on_a_worker(tmp_path):
    home, bin_dir = _worker_home(tmp_path), _fake_bin(tmp_path, worker="2")
    (start,) = dry("run.sh", "--background", "--run=gppo", "--", "python", "-c", JOB)
    (stop,) = dry("delete.sh", "--stop-only", "--run=gppo", "--grace=20")
    _, jobs = dry("status.sh", "--jobs", "--run=gppo")
    logs, pidfile = home / "klear_jax/logs", home / "klear_jax/logs/gppo.pid"
    proc = _on_worker(remote_of(start), home, bin_dir)
    assert proc.returncode == 0, proc.stderr
    pid = int(pidfile.read_text())
    try:
        assert proc.stdout.startswith(f"worker 2: started pid {pid}")
        deadline = time.time() + 20
        while "training" not in (logs / "gppo.worker2.log").read_text() and time.time() < deadline:
            time.sleep(0.1)
        assert f"worker 2: gppo running (pid {pid})" in _on_worker(remote_of(jobs), home, bin_dir).stdout
        again = _on_worker(remote_of(start), home, bin_dir)
        assert again.returncode == 1 and "gppo is already running on worker 2" in again.stderr
        proc = _on_worker(remote_of(stop), home, bin_dir)
        assert proc.returncode == 0 and proc.stdout == "worker 2: stopped\n", proc.stderr
        assert (logs / "gppo.worker2.log").read_text().splitlines()[-2:] == [
            "training", "SIGTERM: checkpoint saved"]
        assert "worker 2: gppo not running" in _on_worker(remote_of(jobs), home, bin_dir).stdout
        assert _on_worker(remote_of(stop), home, bin_dir).stdout == "worker 2: no running gppo job\n"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -------------------------------------------------------------------- lint / requirements

@pytest.mark.parametrize("name", [*ALL, "common.sh"])
def test_shellcheck_clean(name):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", str(SCRIPTS / name)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("name", ALL)
def test_scripts_are_executable_and_strict(name):
    path = SCRIPTS / name
    assert os.access(path, os.X_OK)
    assert "set -euo pipefail" in path.read_text()


def test_remote_commands_parse_as_shell():
    cmds = [dry("setup.sh")[-1], dry("run.sh", "--", *GPPO)[0], dry("run.sh", "--background", "--", *GPPO)[0],
            dry("delete.sh", "--stop-only")[0], dry("status.sh", "--jobs")[-1], dry("logs.sh")[-1]]
    for argv in cmds:
        proc = subprocess.run(["bash", "-n", "-c", remote_of(argv)], capture_output=True, text=True)
        assert proc.returncode == 0, (argv, proc.stderr)


def test_requirements_tpu_pins_match_runtime():
    tpu = (ROOT / "requirements-tpu.txt").read_text().splitlines()
    runtime = (ROOT / "requirements.txt").read_text().splitlines()
    assert "-r requirements.txt" in tpu
    jax_pin = next(l for l in runtime if l.startswith("jax=="))
    assert f"jax[tpu]=={jax_pin.split('==')[1]}" in tpu
