"""A user's first hour, from a fresh clone: ``pip install .`` into a new venv, then from
another directory the console scripts run the demo (the tiny one, end to end), export its
RL checkpoint for transformers and evaluate the export; a demo's console output stays short.

The venv reaches the heavy dependencies through a .pth file naming this interpreter's
site-packages (they are pinned in pyproject.toml and already installed here), and the
package itself is built offline from the clone (--no-deps --no-build-isolation --no-index).
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from test_demo import _check_outputs, _has_bwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_clone(dest) -> str:
    if os.path.exists(os.path.join(REPO, ".git")):
        subprocess.run(["git", "clone", "-q", REPO, str(dest)], check=True, timeout=120)
    else:  # a copy of the work tree without git: its files as they are
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "*.egg-info", "build", ".pytest_cache"))
    return str(dest)


def _venv(path) -> str:
    """A new venv seeing this interpreter's site-packages after its own (no pip of its
    own: the parent's pip installs into it)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    purelib = subprocess.run([str(path / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    parents = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    with open(os.path.join(purelib, "_klear_parent_env.pth"), "w") as f:
        f.writelines(f"import site; site.addsitedir({p!r})\n" for p in sorted(parents))
    return str(path / "bin")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return dict(env, JAX_PLATFORMS="cpu")  # one CPU device, as a user's first run


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("install")
    clone = _fresh_clone(root / "clone")
    bin_dir = _venv(root / "venv")
    r = subprocess.run([os.path.join(bin_dir, "python"), "-m", "pip", "install", "-q",
                        "--no-deps", "--no-build-isolation", "--no-index", clone],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return {"bin": bin_dir, "clone": clone, "cwd": str(elsewhere), "venv": str(root / "venv")}


def _run(inst, script, *args, timeout=900):
    r = subprocess.run([os.path.join(inst["bin"], script), *args], cwd=inst["cwd"],
                       env=_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (script, r.stdout[-3000:], r.stderr[-4000:])
    return r


def test_installed_package_runs_demo_export_and_eval_from_another_directory(installed,
                                                                             tmp_path):
    inst = installed
    r = _run(inst, "python", "-c", "import klear_jax; print(klear_jax.__file__)")
    assert r.stdout.strip().startswith(inst["venv"]), r.stdout  # not the repository's copy

    w = tmp_path / "demo"
    extra = [] if _has_bwrap() else ["--allow_unsandboxed"]
    r = _run(inst, "klear-demo", "--workdir", str(w), "--size", "tiny", *extra)
    with open(w / "summary.json") as f:
        s = json.load(f)
    _check_outputs(w, s)
    assert s["sandbox"].startswith("bwrap") if _has_bwrap() else s["sandbox"] == "unsandboxed"
    # quiet by default: the stages, progress, eval tables and the summary; no library INFO
    out = (r.stdout + r.stderr).splitlines()
    assert len(out) <= 70, "\n".join(out)
    assert not [line for line in out if " INFO " in line or line.startswith("I1")], out
    text = "\n".join(out)
    for want in ("demo: stage sft done", "step 6/6", "avg@k", "math: avg@k T=1.0 SFT"):
        assert want in text, want

    hf = tmp_path / "hf"
    r = _run(inst, "klear-convert", "--from", str(w / "rl_math"), "--to_hf", str(hf))
    assert "with the tokenizer and generation_config.json" in r.stdout
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(hf)).chat_template

    config = os.path.join(inst["clone"], "configs", "eval_tiny.py") + ":k=1,max_new=8"
    _run(inst, "klear-eval", f"--config={config}", f"--config.checkpoint={hf}",
         f"--config.benchmarks.math.path={w / 'data' / 'heldout_math.jsonl'}",
         "--config.benchmarks.code.path=", f"--config.out_dir={tmp_path / 'eval'}")
    with open(tmp_path / "eval" / "results.json") as f:
        res = json.load(f)
    assert set(res["results"]) == {"math"}
    assert set(res["results"]["math"]) == {"greedy", "t1_0", "t0_6"}
