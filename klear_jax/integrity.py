"""Checkpoint integrity: a manifest of content hashes per committed step, written by every
process for the files it wrote, and verified before a step is used.

``seal(step_dir)`` writes ``STEP/integrity.<process>.json`` ({file: [size, sha256]}) once
Orbax has committed the step; ``verify(step_dir)`` names the first file that is missing,
resized or changed; ``newest_good_step(ckpt_dir)`` walks back from the newest step to one
that verifies. A step without its manifests (a run killed between Orbax's commit and the
sealing) fails verification like a damaged one, so the run falls back to the step before.
A directory where no step has a manifest at all (saved before manifests existed) is used
as it is, with a warning. Costs: docs/integrity.md.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

MANIFEST_PREFIX = "integrity."  # STEP/integrity.<process>.json
UNSEALED = "no integrity manifest"
log = logging.getLogger(__name__)


class CorruptCheckpointError(RuntimeError):
    """A checkpoint step failed verification; the message names the step and the file."""


# --------------------------------------------------------------------- integrity
def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is True on any (a collective when multi-host)."""
    if jax.process_count() > 1:
        flag = bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
    return flag


def _file_digest(path: epath.Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _map(fn, items):
    """``fn`` over ``items`` on threads (hashlib and file reads release the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        return list(ex.map(fn, items))


def _step_files(step_dir: epath.Path) -> list[str]:
    """Paths (relative, '/'-separated) of the files of a step, manifests excluded."""
    out = []
    for root, _, names in step_dir.walk():
        for name in names:
            rel = (root / name).relative_to(step_dir).as_posix()
            if "/" in rel or not name.startswith(MANIFEST_PREFIX):
                out.append(rel)
    return sorted(out)


def _writer(rel: str) -> int:
    """The process that wrote a file: Orbax puts each process's array data under
    ``ocdbt.process_<i>/`` and its array metadata in ``array_metadatas/process_<i>``; the
    rest is process 0's."""
    m = re.search(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)", rel)
    return int(m.group(1)) if m else 0


def seal(step_dir) -> None:
    """Writes this process's manifest for the committed step ``step_dir``: size and SHA-256
    of every file it wrote. Every process of the run must call it."""
    step_dir = epath.Path(step_dir)
    index, count = jax.process_index(), jax.process_count()
    rels = [r for r in _step_files(step_dir) if _writer(r) == index]
    digests = _map(lambda r: _file_digest(step_dir / r), rels)
    manifest = {"process": index, "process_count": count, "algorithm": "sha256",
                "files": {r: [size, h] for r, (size, h) in zip(rels, digests)}}
    tmp = step_dir / f"{MANIFEST_PREFIX}{index}.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(step_dir / f"{MANIFEST_PREFIX}{index}.json")


def _manifest(step_dir: epath.Path) -> tuple[dict | None, str | None]:
    """({file: (size, sha256)} of all processes, None) or (None, problem)."""
    parts = {}
    for p in step_dir.glob(MANIFEST_PREFIX + "*.json"):
        try:
            part = json.loads(p.read_text())
            parts[int(part["process"])] = (int(part["process_count"]), {
                str(r): (int(v[0]), str(v[1])) for r, v in part["files"].items()})
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OSError) as e:
            return None, f"{p.name}: unreadable ({type(e).__name__})"
    if not parts:
        return None, f"{UNSEALED} (saved before manifests, or the run died while sealing)"
    missing = sorted(set(range(max(c for c, _ in parts.values()))) - set(parts))
    if missing:
        return None, f"{UNSEALED} from process(es) {missing}: the run died while sealing"
    return {r: v for _, files in parts.values() for r, v in files.items()}, None


def verify(step_dir, items=None) -> str | None:
    """None when the step's manifest is complete and the files match it; else the problem,
    naming the file. Only the files of ``items`` (e.g. ("params",)) and the step's own when
    given. Each process checks its share of the files (agree with raise_if_corrupt)."""
    step_dir = epath.Path(step_dir)
    files, problem = _manifest(step_dir)
    if problem:
        return problem
    wanted = sorted(r for r in files if items is None or "/" not in r or r.split("/")[0] in items)
    mine = wanted[jax.process_index()::jax.process_count()]

    def check(rel):
        try:
            size, digest = _file_digest(step_dir / rel)
        except FileNotFoundError:
            return f"{rel}: missing"
        if size != files[rel][0]:
            return f"{rel}: {size} bytes, {files[rel][0]} when saved"
        return None if digest == files[rel][1] else f"{rel}: content changed since saved (sha256)"

    return next((p for p in _map(check, mine) if p), None)


def raise_if_corrupt(ckpt_dir, step: int, problem: str | None) -> None:
    """CorruptCheckpointError naming the step and ``problem`` (this process's ``verify``
    result) when any process found one; every process must call it (a collective)."""
    if any_process(problem is not None):
        raise CorruptCheckpointError(f"checkpoint {ckpt_dir} step {step}: "
                                     f"{problem or 'failed verification on another process'}")


def sealed(step_dir: epath.Path) -> bool:
    """Every process's manifest is there (the files are not checked)."""
    return _manifest(step_dir)[1] is None


def steps(ckpt_dir: epath.Path) -> list[int]:
    """Committed step directories (Orbax renames a step's temporary dir to its number)."""
    if not ckpt_dir.exists():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if re.fullmatch(r"0|[1-9]\d*", p.name))


def newest_good_step(ckpt_dir) -> tuple[int | None, list[tuple[int, str]]]:
    """(the newest step that verifies, or None; [(each newer step, its problem)]). In a
    directory saved before manifests existed, the newest step, unverified."""
    ckpt_dir = epath.Path(ckpt_dir)
    on_disk = steps(ckpt_dir)
    if on_disk and not any(any((ckpt_dir / str(s)).glob(MANIFEST_PREFIX + "*.json"))
                           for s in on_disk):
        log.warning("checkpoints in %s have no integrity manifests (saved before klear_jax "
                    "wrote them): step %d is used unverified", ckpt_dir, on_disk[-1])
        return on_disk[-1], []
    bad = []
    for step in reversed(on_disk):
        problem = verify(ckpt_dir / str(step))
        if not any_process(problem is not None):
            return step, bad
        bad.append((step, problem or "a file failed verification on another process"))
    return None, bad
