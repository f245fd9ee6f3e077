"""Functions that DeadlinePool workers import by name in tests (tests/ is on their PYTHONPATH)."""
import time

_warmed = False


def is_warm() -> bool:
    return _warmed


def _slow_warm_up() -> None:
    global _warmed
    time.sleep(1.0)
    _warmed = True


is_warm.worker_warm_up = _slow_warm_up
