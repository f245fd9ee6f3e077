import jax
import pytest
from jax.sharding import PartitionSpec as P

from klear_jax import sharding


def test_mesh_shapes():
    assert jax.device_count() == 8
    m = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sharding.mesh_from_config({"fsdp": -1}).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    with pytest.raises(ValueError, match="unknown key"):
        sharding.mesh_from_config({"model": 2})
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh(data=3, fsdp=-1)


def test_logical_to_spec_drops_non_dividing_axes():
    m = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert sharding.logical_to_spec(("vocab", "embed"), (10, 64), m) == P("tensor", "fsdp")
    assert sharding.logical_to_spec(("vocab", "embed"), (11, 64), m) == P(None, "fsdp")
    assert sharding.logical_to_spec(("act_batch", "act_length"), (4, 7), m) == P(("data", "fsdp"), None)
    assert sharding.logical_to_spec(("act_batch", "act_length"), (2, 7), m) == P("data", None)
    with pytest.raises(KeyError, match="no rule"):
        sharding.logical_to_spec(("bogus",))


def test_initialize_distributed_is_noop_on_one_host():
    sharding.initialize_distributed()
    assert jax.process_count() == 1
