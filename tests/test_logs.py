"""Quiet console by default: the project's INFO and every warning show, libraries' INFO and
Orbax's read-only-restore warnings do not; --verbosity brings the libraries' detail back.
(A whole command's output: tests/test_install.py runs the demo and counts its lines.)"""
import logging

import pytest

from klear_jax import logs


@pytest.fixture
def restore_logging(monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # setup() sets it: undone
    root, names = logging.getLogger(), ("klear_jax", "absl")
    saved = (list(root.handlers), root.level, [logging.getLogger(n).level for n in names])
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for n, level in zip(names, saved[2]):
        logging.getLogger(n).setLevel(level)


def emit():
    logging.getLogger("klear_jax.demo").info("own progress")
    logging.getLogger("absl").info("checkpoint manager internals")
    logging.getLogger("absl").warning("Given directory is read only=/x")
    logging.getLogger("grain").warning("a real library warning")
    logging.getLogger("klear_jax.trainer").debug("own detail")


def test_quiet_by_default(restore_logging, capsys):
    logging.getLogger().addHandler(logging.StreamHandler())  # a library's basicConfig:
    logs.setup(None)                                          # replaced, not doubled
    emit()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].endswith(" own progress") and "INFO" not in err[0]
    assert "WARNING" in err[1] and err[1].endswith("] a real library warning")


def test_verbosity_shows_the_libraries(restore_logging, capsys):
    logs.setup(0)
    emit()
    err = capsys.readouterr().err
    assert "checkpoint manager internals" in err and "read only" in err
    assert "own progress" in err and "own detail" not in err
    logs.setup(1)
    emit()
    assert "own detail" in capsys.readouterr().err
    assert logs.level_of(-1) == logging.WARNING and logs.level_of(-2) == logging.ERROR
