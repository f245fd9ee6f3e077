"""Orbax checkpoints: full state round trip, restore onto other meshes, params alone,
retention, and atomicity when a process is killed mid-save."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from klear_jax import checkpoint as ck, integrity, optim, sharding as shd, train_step as ts
from klear_jax.models import ModelConfig, create_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=4, head_dim=8, logprob_chunk_size=16)
OPT, _ = optim.make_optimizer(dict(lr=1e-3, end_lr=1e-4, schedule="cosine", warmup_steps=0,
                                   decay_steps=0, b1=0.9, b2=0.999, eps=1e-8,
                                   weight_decay=0.1, clip_norm=1.0, mu_dtype=""), 10)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_tree_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, host(a), host(b))


def target_state(mesh, like):
    """Abstract TrainState with shardings for ``mesh`` (built from the model config only)."""
    _, abstract_params = ck.abstract_model(CFG, mesh)
    p_sh = jax.tree.map(lambda x: x.sharding, abstract_params)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like,
                        ts.state_shardings(p_sh, OPT, abstract_params, mesh))


def test_full_state_restores_onto_other_meshes(tmp_path):
    mesh8 = shd.make_mesh(fsdp=8)
    model = create_model(CFG, seed=3, mesh=mesh8)
    _, state, _ = ts.init_train_state(model, OPT, mesh8)
    # make the optimizer state non-trivial
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 1 if x.ndim else x, state.opt_state),
                          step=state.step + 7, skipped=state.skipped + 2)
    emb = state.params["embed"]["embedding"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")  # tensor axis = 1
    c = ck.TrainCheckpointer(tmp_path, keep=2, async_save=True)
    c.save(state, data_iter={"pos": 5, "epoch": [1, 2]}, rng=jax.random.key(11),
           config={"lr": 1e-3}, model_config=CFG)
    c.close()

    mesh4 = shd.make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
    mesh1 = shd.make_mesh(fsdp=1, devices=jax.devices()[:1])
    for mesh in (mesh4, mesh1):
        r = ck.TrainCheckpointer(tmp_path)
        got, data_state, rng = r.restore(target_state(mesh, state), with_rng=True)
        r.close()
        assert int(got.step) == 7 and int(got.skipped) == 2
        assert data_state == {"pos": 5, "epoch": [1, 2]}
        assert jax.random.key_data(rng).tolist() == jax.random.key_data(jax.random.key(11)).tolist()
        assert_tree_equal(got.params, state.params)
        assert_tree_equal(got.opt_state, state.opt_state)
        leaf = got.params["layers"]["mlp"]["up_proj"]["kernel"]
        assert leaf.sharding.mesh.shape == mesh.shape
        if mesh is mesh4:
            assert leaf.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")

    # parameters alone, from the training checkpoint, for eval / convert
    for mesh in (mesh4, None):
        m = ck.restore_params(tmp_path, mesh=mesh)  # a workdir: finds checkpoints/
        assert m.config == CFG
        assert_tree_equal(ts.split_model(m)[1], state.params)


def test_save_params_alone_and_retention(tmp_path):
    model = create_model(CFG, seed=1)
    ck.save_params(tmp_path / "p", model, step=4)
    m = ck.restore_params(tmp_path / "p", mesh=shd.make_mesh(fsdp=8), dtype="bfloat16")
    assert m.config.dtype == "bfloat16"  # runtime field overridden, shapes from the checkpoint
    assert_tree_equal(ts.split_model(m)[1], ts.split_model(model)[1])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.restore_params(tmp_path / "empty")

    _, state, _ = ts.init_train_state(model, OPT, shd.make_mesh(fsdp=1, devices=jax.devices()[:1]))
    c = ck.TrainCheckpointer(tmp_path / "w", keep=2, async_save=True)
    for s in (1, 2, 3):
        c.save(state.replace(step=state.step * 0 + s))
    c.close()
    assert sorted(ck.TrainCheckpointer(tmp_path / "w").mngr.all_steps()) == [2, 3]


CHILD = textwrap.dedent("""
    import sys, numpy as np, orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    small = {"w": np.arange(10, dtype=np.float32)}
    mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(small)))
    mngr.wait_until_finished()
    big = {f"w{i}": np.full((256, 256), i, np.float32) for i in range(1500)}
    print("saving", flush=True)
    mngr.save(2, args=ocp.args.Composite(params=ocp.args.StandardSave(big)))
    mngr.wait_until_finished()
    print("done", flush=True)
""")


def test_killed_mid_save_leaves_previous_restorable(tmp_path):
    d = tmp_path / "ck"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(d)], stdout=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout.readline().strip() == "saving"
    time.sleep(0.1)  # early in the 390 MB save: a finished save would test nothing
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    leftovers = [x.name for x in d.iterdir()]
    assert "2" not in leftovers, f"save finished before the kill: {leftovers}"
    mngr = ck._manager(d)  # as TrainCheckpointer opens it: cleans up the partial tmp dir
    assert mngr.latest_step() == 1
    got = mngr.restore(1, args=ck.ocp.args.Composite(
        params=ck.ocp.args.StandardRestore({"w": np.zeros(10, np.float32)})))
    np.testing.assert_array_equal(got["params"]["w"], np.arange(10, dtype=np.float32))
    mngr.close()


# ------------------------------------------------------------------ integrity (issue 23)
@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A workdir with sealed steps 1, 2, 3 (keep=3) of a tiny train state, and the states."""
    work = tmp_path_factory.mktemp("three")
    model = create_model(CFG, seed=2)
    _, state, _ = ts.init_train_state(model, OPT, shd.make_mesh(fsdp=1, devices=jax.devices()[:1]))
    states = {s: state.replace(step=state.step * 0 + s,
                               params=jax.tree.map(lambda x: x + s, state.params)) for s in (1, 2, 3)}
    c = ck.TrainCheckpointer(work, keep=3)
    for s in (1, 2, 3):
        c.save(states[s], data_iter={"pos": s}, model_config=CFG)
    c.close()
    return work, states


def copy_work(three_steps, dst):
    import shutil
    shutil.copytree(three_steps[0], dst)
    return dst, dst / "checkpoints"


def flip_block(path, offset=None, size=4096):
    """Overwrites ``size`` bytes (inverted) in the middle of ``path``, as a bad disk would."""
    data = bytearray(path.read_bytes())
    offset = max(0, len(data) // 2 - size // 2) if offset is None else offset
    data[offset:offset + size] = bytes(b ^ 0xFF for b in data[offset:offset + size])
    path.write_bytes(bytes(data))


def largest_params_file(step_dir):
    return max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_flipped_block_falls_back_loudly_and_keeps_the_good_step(tmp_path, three_steps, caplog):
    work, d = copy_work(three_steps, tmp_path / "w")
    bad = largest_params_file(d / "3")
    flip_block(bad)
    c = ck.TrainCheckpointer(work, keep=2)
    with caplog.at_level("WARNING", logger="klear_jax.checkpoint"):
        assert c.latest_step() == 2
    rel = bad.relative_to(d / "3").as_posix()
    assert f"CHECKPOINT STEP 3 IS CORRUPT: {d}/3: {rel}: content changed" in caplog.text
    assert "resuming from step 2" in caplog.text
    assert c.model_config() == CFG
    got, data_state, _ = c.restore(target_state(shd.make_mesh(fsdp=1, devices=jax.devices()[:1]),
                                                three_steps[1][2]))
    assert c.restored_step == 2 and int(got.step) == 2 and data_state == {"pos": 2}
    assert_tree_equal(got.params, three_steps[1][2].params)
    assert sorted(x.name for x in d.iterdir()) == ["1", "2", "3.corrupt"]  # moved aside, not deleted
    # keep=2: the resumed step 2 stays until two newer saves are sealed
    c.save(got.replace(step=got.step + 1))
    c.wait()
    assert sorted(x.name for x in d.iterdir()) == ["2", "3", "3.corrupt"] and c.latest_step() == 3
    c.save(got.replace(step=got.step + 2))
    c.close()
    assert sorted(x.name for x in d.iterdir()) == ["3", "3.corrupt", "4"]
    assert ck.verify(d / "3") is None and ck.verify(d / "4") is None


@pytest.mark.parametrize("damage, problem", [
    ("truncate step metadata", r"step/metadata: \d+ bytes, \d+ when saved"),
    ("delete params", r"params/\S+: missing"),
    ("delete manifest", "no integrity manifest"),
    ("truncate manifest", r"integrity\.0\.json: unreadable"),
])
def test_damaged_step_falls_back(tmp_path, three_steps, caplog, damage, problem):
    import shutil
    work, d = copy_work(three_steps, tmp_path / "w")
    if damage == "truncate step metadata":
        (d / "3" / "step" / "metadata").write_text('{"step": 3, "sk')
    elif damage == "delete params":
        shutil.rmtree(d / "3" / "params")
    elif damage == "delete manifest":
        (d / "3" / "integrity.0.json").unlink()
    else:
        (d / "3" / "integrity.0.json").write_text('{"process": 0, "files": {')
    c = ck.TrainCheckpointer(work)
    with caplog.at_level("WARNING", logger="klear_jax.checkpoint"):
        assert c.latest_step() == 2
    assert re.search(rf"CHECKPOINT STEP 3 IS CORRUPT: {d}/3: {problem}", caplog.text), caplog.text
    c.close()


def test_no_good_step_is_an_error_naming_every_step(tmp_path, three_steps):
    work, d = copy_work(three_steps, tmp_path / "w")
    for s in (1, 2, 3):
        flip_block(d / str(s) / "step" / "metadata", offset=0, size=4)
    with pytest.raises(ck.CorruptCheckpointError, match=r"step 3: step/metadata: content changed.*"
                                                         r"step 2: .*step 1: .*start from scratch"):
        ck.TrainCheckpointer(work).latest_step()
    assert sorted(x.name for x in d.iterdir()) == ["1", "2", "3"]  # nothing moved


def test_restore_params_names_a_corrupt_step(tmp_path):
    model = create_model(CFG, seed=1)
    ck.save_params(tmp_path / "p", model, step=4)
    assert ck.verify(tmp_path / "p" / "4") is None
    bad = largest_params_file(tmp_path / "p" / "4")
    flip_block(bad, size=64)
    rel = bad.relative_to(tmp_path / "p" / "4").as_posix()
    with pytest.raises(ck.CorruptCheckpointError, match=rf"step 4: {rel}: content changed"):
        ck.restore_params(tmp_path / "p")


def test_retention_counts_only_sealed_steps(tmp_path, three_steps):
    """A newer step whose manifest is not (yet) complete does not push out an older sealed one."""
    import shutil
    work, d = copy_work(three_steps, tmp_path / "w")
    shutil.copytree(d / "3", d / "4")
    (d / "4" / "integrity.0.json").unlink()  # step 4 committed by Orbax, not sealed yet
    c = ck.TrainCheckpointer(work, keep=1)
    c._retain()
    assert sorted(x.name for x in d.iterdir()) == ["3", "4"]
    ck.seal(d / "4")
    c._retain()
    assert sorted(x.name for x in d.iterdir()) == ["4"]
    c.close()


def test_manifest_splits_files_by_writing_process():
    assert integrity._writer("params/ocdbt.process_12/d/ab") == 12
    assert integrity._writer("opt_state/array_metadatas/process_3") == 3
    assert integrity._writer("params/d/ab") == integrity._writer("step/metadata") == 0


def test_checkpoints_saved_before_manifests_resume_unverified(tmp_path, three_steps, caplog):
    """A directory where no step has a manifest (older klear_jax) resumes from its newest
    step with a warning, instead of refusing every step."""
    work, d = copy_work(three_steps, tmp_path / "w")
    for s in (1, 2, 3):
        (d / str(s) / "integrity.0.json").unlink()
    c = ck.TrainCheckpointer(work)
    with caplog.at_level("WARNING", logger="klear_jax.integrity"):
        assert c.latest_step() == 3
    assert "no integrity manifests" in caplog.text and "step 3 is used unverified" in caplog.text
    assert sorted(x.name for x in d.iterdir()) == ["1", "2", "3"]
    c.close()
