"""One mesh, one logical-axis rules table, and the multi-host initialisation helper.

Every parameter, optimizer-state leaf and activation carries *logical* axis names
(e.g. ``("vocab", "embed")``); ``LOGICAL_RULES`` maps them onto the mesh axes
``("data", "fsdp", "tensor")``. Nothing else in the code base names a mesh axis.

A mesh axis is dropped from a dimension's spec when it does not divide that dimension
(tiny test models, odd vocabularies), so any model runs on any mesh; the dimension is then
replicated over that axis.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis name -> mesh axis (or tuple of mesh axes, or None for replicated).
# Parameter axes:
#   vocab, embed, mlp, q_heads, kv_heads, head_dim, layers, norm
# Activation axes (prefixed act_) so that a parameter's embed dim (fsdp-sharded) and an
# activation's embed dim (replicated between layers) are decided independently.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("act_batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_q_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_vocab", "tensor"),
    ("cache_batch", ("data", "fsdp")),
    ("cache_length", None),
    ("cache_kv_heads", "tensor"),
    ("cache_head_dim", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """Builds the ('data', 'fsdp', 'tensor') mesh. One axis may be -1: it takes the rest.

    Raises ValueError naming the axis sizes when they do not multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if len(devices) % fixed:
            raise ValueError(f"mesh: {len(devices)} devices not divisible by {sizes}")
        sizes[free[0]] = len(devices) // fixed
    total = math.prod(sizes.values())
    if total != len(devices):
        if total < len(devices):
            devices = devices[:total]
        else:
            raise ValueError(
                f"mesh: data*fsdp*tensor = {total} but only {len(devices)} devices ({sizes})")
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        dev_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # CPU fake devices or unusual topologies: plain reshape
        dev_array = np.asarray(devices).reshape(shape)
    return Mesh(dev_array, MESH_AXES)


def mesh_from_config(mesh_cfg: Mapping[str, int] | None, devices=None) -> Mesh:
    """Mesh from a config mapping with keys data / fsdp / tensor (missing -> data=1, fsdp=-1,
    tensor=1)."""
    mesh_cfg = dict(mesh_cfg or {})
    unknown = set(mesh_cfg) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh config: unknown key(s) {sorted(unknown)}; allowed {MESH_AXES}")
    return make_mesh(mesh_cfg.get("data", 1), mesh_cfg.get("fsdp", -1),
                     mesh_cfg.get("tensor", 1), devices=devices)


def logical_to_spec(names: Sequence[str | None] | None, shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    With ``shape`` and ``mesh`` given, mesh axes that do not divide the dimension (or that
    were already used by an earlier dimension) are dropped, so the result is always valid.
    """
    if names is None:
        return PartitionSpec()
    table = dict(LOGICAL_RULES)
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in klear_jax.sharding.LOGICAL_RULES")
        target = table[name]
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        kept = []
        size = None if shape is None else shape[i]
        for ax in axes:
            if ax in used:
                continue
            if mesh is not None:
                n = mesh.shape[ax]
                if size is not None and size % (n * math.prod(mesh.shape[a] for a in kept)):
                    continue
            kept.append(ax)
        used.update(kept)
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, names, shape=None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def constrain(x: jax.Array, names: Sequence[str | None], mesh: Mesh | None = None):
    """with_sharding_constraint by logical names. A no-op outside a mesh context."""
    mesh = mesh or current_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, names, x.shape))


_ACTIVE_MESH: list[Mesh] = []


class use_mesh:
    """Context manager making ``mesh`` the one that ``constrain`` uses (and jax's own)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._jax_ctx = None

    def __enter__(self):
        _ACTIVE_MESH.append(self.mesh)
        self._jax_ctx = self.mesh  # Mesh is itself a context manager (sets the physical mesh)
        self._jax_ctx.__enter__()
        return self.mesh

    def __exit__(self, *exc):
        self._jax_ctx.__exit__(*exc)
        _ACTIVE_MESH.pop()


def current_mesh() -> Mesh | None:
    return _ACTIVE_MESH[-1] if _ACTIVE_MESH else None


def to_host(x) -> np.ndarray:
    """A (possibly multi-host sharded) array as one numpy array on every process."""
    if not getattr(x, "is_fully_addressable", True):
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None,
                           heartbeat_timeout_s: int | None = None) -> None:
    """``jax.distributed.initialize`` once per process; a no-op on a single host.

    On Cloud TPU VMs all arguments are discovered automatically; elsewhere they come from
    the arguments or the env vars KLEAR_COORDINATOR (host:port of process 0's coordination
    service) / KLEAR_NUM_PROCESSES / KLEAR_PROCESS_ID. A loopback coordinator (127.0.0.1,
    localhost, ::1: several processes on one machine, as in the tests) is served on that
    address only, not on every interface (JAX_COORDINATOR_BIND_ADDRESS still overrides).
    KLEAR_HEARTBEAT_TIMEOUT_S (default JAX's, 100 s) bounds how long the others take to
    fail, naming the lost process ("Task N heartbeat timeout"), when one process dies.
    """
    coordinator_address = coordinator_address or os.environ.get("KLEAR_COORDINATOR")
    num_processes = num_processes or int(os.environ.get("KLEAR_NUM_PROCESSES", "0") or 0) or None
    if process_id is None and os.environ.get("KLEAR_PROCESS_ID"):
        process_id = int(os.environ["KLEAR_PROCESS_ID"])
    heartbeat_timeout_s = heartbeat_timeout_s or int(
        os.environ.get("KLEAR_HEARTBEAT_TIMEOUT_S", "0") or 0)
    on_tpu_pod = bool(os.environ.get("TPU_WORKER_HOSTNAMES", "").count(","))
    if not (coordinator_address or on_tpu_pod or (num_processes or 1) > 1):
        return
    if jax.distributed.is_initialized():
        return
    kw = {}
    if heartbeat_timeout_s:
        kw["heartbeat_timeout_seconds"] = heartbeat_timeout_s
    if (coordinator_address and _is_loopback(coordinator_address)
            and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")):
        kw["coordinator_bind_address"] = coordinator_address
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id, **kw)


def _is_loopback(address: str) -> bool:
    """True for 'host:port' addresses whose host is a loopback address or 'localhost'."""
    import ipaddress
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
