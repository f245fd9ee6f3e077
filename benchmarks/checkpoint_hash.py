"""Cost of checkpoint integrity: seal (hash every file of a committed step, write the
manifest) and verify, per GB, on an Orbax step of random float32 arrays (incompressible, like
trained weights and Adam moments).

    JAX_PLATFORMS=cpu python benchmarks/checkpoint_hash.py --gb 2 --dir /tmp/ckpt_hash

The step was just written, so its files are in the page cache: this is the hashing cost
(SHA-256, one thread per file, up to 16 threads); from cold storage reads add their own time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from klear_jax import checkpoint as ck, integrity  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (1e9 bytes)")
    p.add_argument("--arrays", type=int, default=16)
    p.add_argument("--dir", default="/tmp/ckpt_hash")
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    n = int(a.gb * 1e9 / 4 / a.arrays)
    rng = np.random.default_rng(0)
    tree = {f"w{i}": rng.random(n, dtype=np.float32) for i in range(a.arrays)}
    mngr = ck._manager(a.dir)
    t = time.perf_counter()
    mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
    mngr.wait_until_finished()
    save_s = time.perf_counter() - t
    del tree
    step = os.path.join(a.dir, "1")
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step) for f in fs) / 1e9
    t = time.perf_counter()
    ck.seal(step)
    seal_s = time.perf_counter() - t
    t = time.perf_counter()
    assert ck.verify(step) is None
    verify_s = time.perf_counter() - t
    buf = np.ones(256 << 20, np.uint8)
    t = time.perf_counter()
    hashlib.sha256(buf).digest()
    one_thread = buf.nbytes / 1e9 / (time.perf_counter() - t)
    out = {"gb_on_disk": round(size, 3), "files": len(integrity._step_files(ck.epath.Path(step))),
           "cpus": os.cpu_count(), "orbax_save_s": round(save_s, 2),
           "seal_s": round(seal_s, 2), "seal_s_per_gb": round(seal_s / size, 3),
           "verify_s": round(verify_s, 2), "verify_s_per_gb": round(verify_s / size, 3),
           "sha256_one_thread_gb_per_s": round(one_thread, 2)}
    print(json.dumps(out, indent=1))
    shutil.rmtree(a.dir)


if __name__ == "__main__":
    main()
