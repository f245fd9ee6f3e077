"""pyproject.toml and the requirements files agree pin for pin, and every console script
names a callable that exists (the install itself: tests/test_install.py)."""
import importlib
import os
import re
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    PROJECT = tomllib.load(_f)["project"]


def requirements(name: str) -> set[str]:
    """The requirement lines of a pip -r file, following its own ``-r`` includes."""
    out = set()
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r"):
                out |= requirements(line[2:].strip())
            elif line:
                out.add(line)
    return out


def canonical(reqs) -> set[str]:
    return {re.sub(r"[-_.]+", "-", r.lower()) for r in reqs}


@pytest.mark.parametrize("file,extra", [("requirements.txt", None),
                                        ("requirements-tpu.txt", "tpu"),
                                        ("requirements-gpu.txt", "gpu"),
                                        ("requirements-test.txt", "test")])
def test_requirements_files_equal_the_pyproject_pins(file, extra):
    want = set(PROJECT["dependencies"])
    if extra:
        want |= set(PROJECT["optional-dependencies"][extra])
    assert canonical(requirements(file)) == canonical(want), file
    assert all("==" in r for r in want), "every runtime and extra requirement is pinned"


def test_wandb_is_optional_and_tested():
    assert not any(r.startswith("wandb") for r in PROJECT["dependencies"])
    assert set(PROJECT["optional-dependencies"]["wandb"]) <= set(
        PROJECT["optional-dependencies"]["test"])


def test_every_stage_has_a_console_script_that_resolves():
    scripts = PROJECT["scripts"]
    stages = {d for d in os.listdir(os.path.join(ROOT, "klear_jax"))
              if os.path.isfile(os.path.join(ROOT, "klear_jax", d, "__main__.py"))}
    assert {f"klear-{s}" for s in stages} <= set(scripts)
    assert {"klear-convert", "klear-prepare", "klear-selfcheck"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name
