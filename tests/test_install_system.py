"""Item 8 of issue 23: the README's first command sets up the system packages the demo
needs (bubblewrap for the code sandbox), still as one command, like the test command."""
import os
import re
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, ".ci", "install_system.sh")


def readme_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [ln.strip() for ln in quick.splitlines() if ln.startswith("    ")]


def test_readme_first_command_installs_the_system_packages():
    first, second = readme_commands()[:2]
    assert first.startswith("bash .ci/install_system.sh && ") and "klear_jax.demo" in first
    assert second.startswith("bash .ci/install_system.sh && ")


def test_install_system_covers_the_sandbox_and_shellcheck():
    text = open(SCRIPT).read()
    for cmd, pkg in (("bwrap", "bubblewrap"), ("prlimit", "util-linux"),
                     ("setpriv", "util-linux"), ("shellcheck", "shellcheck")):
        assert re.search(rf"command -v {cmd}\b", text) and pkg in text, cmd


def test_install_system_is_a_quick_no_op_when_all_is_there():
    if not all(shutil.which(c) for c in ("bwrap", "prlimit", "setpriv", "shellcheck")):
        pytest.skip("a package is missing: the script would install it")
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 0 and proc.stdout == proc.stderr == ""


def test_install_system_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run(["shellcheck", SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
