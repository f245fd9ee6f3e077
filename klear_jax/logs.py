"""Console logging for every entry point: quiet by default, the detail on request.

Default: the project's own messages (loggers under ``klear_jax``) at INFO, every library
(Orbax, absl, TFDS, grain, jax, ...) at WARNING, and the two warnings Orbax prints on every
read-only restore (``Given directory is read only``) and transformers' advisory notes
(``TRANSFORMERS_NO_ADVISORY_WARNINGS``, e.g. "PyTorch was not found", which JAX users do not
need) dropped. Progress bars and result tables are printed, not logged, so they show at any
level.

``--verbosity N`` (absl's numbering: -1 WARNING, 0 INFO, 1 DEBUG; the config-file stages
take absl's own ``--verbosity`` / ``-v`` flag, the others an argparse twin added by
``add_argument``) puts every logger, the libraries' included, at that level.
"""

from __future__ import annotations

import logging
import os
import sys

_OWN = "klear_jax"
# Orbax warns on every read-only CheckpointManager (each restore) about its own options.
_BENIGN = ("Given directory is read only", "CheckpointManagerOptions.read_only=True")


def level_of(verbosity: int) -> int:
    """absl verbosity -> a logging level (-2 ERROR, -1 WARNING, 0 INFO, >= 1 DEBUG)."""
    if verbosity >= 1:
        return logging.DEBUG
    return {0: logging.INFO, -1: logging.WARNING, -2: logging.ERROR}.get(verbosity,
                                                                         logging.CRITICAL)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (test capture, redirection)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


class _Format(logging.Formatter):
    """``HH:MM:SS message`` for the project's INFO lines, ``HH:MM:SS LEVEL file.py:line]
    message`` for the rest."""

    _short = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    _long = logging.Formatter("%(asctime)s %(levelname)s %(filename)s:%(lineno)d] %(message)s",
                              "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        own = record.name.startswith(_OWN) and record.levelno == logging.INFO
        return (self._short if own else self._long).format(record)


def _not_benign(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BENIGN)


def setup(verbosity: int | None = None) -> None:
    """Routes all logging to one stderr handler. ``None``: quiet (see the module docstring);
    an int: every logger at ``level_of(verbosity)``. Replaces handlers an earlier
    ``basicConfig``, absl's ``app.run`` or an earlier call installed; leaves others (a test
    runner's capture) alone."""
    root = logging.getLogger()
    absl_handler = type(getattr(sys.modules.get("absl.logging"), "_absl_handler", None))
    for h in list(root.handlers):
        if type(h) in (logging.StreamHandler, _Stderr, absl_handler):
            root.removeHandler(h)
    handler = _Stderr()
    handler.setFormatter(_Format())
    root.addHandler(handler)
    logging.getLogger("absl").setLevel(logging.NOTSET)  # inherit the root's level
    if verbosity is None:
        root.setLevel(logging.WARNING)
        logging.getLogger(_OWN).setLevel(logging.INFO)
        handler.addFilter(_not_benign)
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    else:
        root.setLevel(level_of(verbosity))
        logging.getLogger(_OWN).setLevel(logging.NOTSET)


def add_argument(parser) -> None:
    """``-v`` / ``--verbosity N`` on an argparse parser (absent: quiet)."""
    parser.add_argument("-v", "--verbosity", type=int, default=None, metavar="N",
                        help="log every library at this absl level (0 INFO, 1 DEBUG, "
                             "-1 WARNING); default: the project's INFO, libraries' warnings")
