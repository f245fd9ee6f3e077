"""initialize_distributed's arguments to jax.distributed.initialize (captured, not run: the
multi-process tests run it for real), and the harness's per-process environment."""
import jax
import pytest

from klear_jax import sharding as shd
from multihost import process_env


@pytest.fixture
def calls(monkeypatch):
    got = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: got.append(kw))
    for k in ("KLEAR_COORDINATOR", "KLEAR_NUM_PROCESSES", "KLEAR_PROCESS_ID",
              "KLEAR_HEARTBEAT_TIMEOUT_S", "JAX_COORDINATOR_BIND_ADDRESS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(k, raising=False)
    return got


@pytest.mark.parametrize("address,bind", [("127.0.0.1:1234", True), ("localhost:9", True),
                                          ("[::1]:80", True), ("10.0.0.2:8482", False),
                                          ("t1v-n-w-0:8482", False)])
def test_env_settings_and_loopback_bind(calls, monkeypatch, address, bind):
    monkeypatch.setenv("KLEAR_COORDINATOR", address)
    monkeypatch.setenv("KLEAR_NUM_PROCESSES", "2")
    monkeypatch.setenv("KLEAR_PROCESS_ID", "1")
    shd.initialize_distributed()
    want = dict(coordinator_address=address, num_processes=2, process_id=1)
    if bind:  # a loopback coordinator is not served on every interface
        want["coordinator_bind_address"] = address
    assert calls == [want]


def test_heartbeat_and_explicit_bind_address(calls, monkeypatch):
    monkeypatch.setenv("KLEAR_HEARTBEAT_TIMEOUT_S", "30")
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "[::]:1234")  # the user's choice wins
    shd.initialize_distributed("127.0.0.1:1234", 2, 0)
    assert calls == [dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=0,
                          heartbeat_timeout_seconds=30)]


def test_single_host_does_nothing(calls):
    shd.initialize_distributed()
    assert calls == []


def test_harness_env_replaces_the_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=8")
    env = process_env(1, 2, "127.0.0.1:5", 4, {"EXTRA": "x"})
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert (env["KLEAR_COORDINATOR"], env["KLEAR_NUM_PROCESSES"], env["KLEAR_PROCESS_ID"],
            env["JAX_PLATFORMS"], env["EXTRA"]) == ("127.0.0.1:5", "2", "1", "cpu", "x")
