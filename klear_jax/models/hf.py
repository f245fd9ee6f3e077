"""HF interop: ``from_hf`` (config.json + safetensors -> sharded Qwen) and ``to_hf`` (back).

Loading streams one parameter leaf at a time: the leaf's HF tensors (one per layer for
stacked leaves) are read from the safetensors shards, converted to the parameter dtype,
transposed into the layout documented in ``qwen.py`` and handed to
``jax.make_array_from_callback`` with the leaf's NamedSharding, so each device only
receives its shard and the host never holds more than one leaf.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from klear_jax import sharding as shd
from klear_jax.models.config import ModelConfig
from klear_jax.models.qwen import Qwen, param_shardings

_LAYER = "model.layers.{i}."


def _leaf_specs(cfg: ModelConfig) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """(our path 'a.b.c', HF name (with {i} for per-layer tensors), kind, HF shape).

    kind 'T': ours = hf.T reshaped; 'R': ours = hf reshaped."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = [("embed.embedding", "model.embed_tokens.weight", "R", (V, D)),
             ("layers.input_norm.scale", _LAYER + "input_layernorm.weight", "R", (D,)),
             ("layers.post_attn_norm.scale", _LAYER + "post_attention_layernorm.weight", "R", (D,)),
             ("layers.attn.q_proj.kernel", _LAYER + "self_attn.q_proj.weight", "T", (H * hd, D)),
             ("layers.attn.k_proj.kernel", _LAYER + "self_attn.k_proj.weight", "T", (K * hd, D)),
             ("layers.attn.v_proj.kernel", _LAYER + "self_attn.v_proj.weight", "T", (K * hd, D)),
             ("layers.attn.o_proj.kernel", _LAYER + "self_attn.o_proj.weight", "T", (D, H * hd))]
    if cfg.qkv_bias:
        specs += [("layers.attn.q_proj.bias", _LAYER + "self_attn.q_proj.bias", "R", (H * hd,)),
                  ("layers.attn.k_proj.bias", _LAYER + "self_attn.k_proj.bias", "R", (K * hd,)),
                  ("layers.attn.v_proj.bias", _LAYER + "self_attn.v_proj.bias", "R", (K * hd,))]
    if cfg.qk_norm:
        specs += [("layers.attn.q_norm.scale", _LAYER + "self_attn.q_norm.weight", "R", (hd,)),
                  ("layers.attn.k_norm.scale", _LAYER + "self_attn.k_norm.weight", "R", (hd,))]
    specs += [("layers.mlp.gate_proj.kernel", _LAYER + "mlp.gate_proj.weight", "T", (F, D)),
              ("layers.mlp.up_proj.kernel", _LAYER + "mlp.up_proj.weight", "T", (F, D)),
              ("layers.mlp.down_proj.kernel", _LAYER + "mlp.down_proj.weight", "T", (D, F)),
              ("final_norm.scale", "model.norm.weight", "R", (D,))]
    if not cfg.tie_word_embeddings:
        specs.append(("lm_head.kernel", "lm_head.weight", "T", (V, D)))
    return specs


def _hf_names(cfg, name):
    return [name.format(i=i) for i in range(cfg.num_layers)] if "{i}" in name else [name]


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _weight_map(hf_dir: str) -> dict[str, str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors files and no model.safetensors.index.json")
    out = {}
    for fn in files:
        with safe_open(os.path.join(hf_dir, fn), framework="numpy") as f:
            for k in f.keys():
                out[k] = os.path.join(hf_dir, fn)
    return out


def from_hf(hf_dir: str, dtype: str = "float32", param_dtype: str | None = None, mesh=None,
            **config_overrides: Any) -> Qwen:
    """Loads a HF Qwen2/Qwen3 checkpoint directory into a ``Qwen`` model.

    dtype: compute dtype; param_dtype: storage dtype (default: ``dtype``); mesh: place every
    parameter in its NamedSharding on this mesh (default: the default device).
    ``config_overrides`` set other ModelConfig fields (remat_policy, attention_impl, ...).
    """
    cfg = ModelConfig.from_hf_config(hf_dir, dtype=dtype, param_dtype=param_dtype or dtype,
                                     **config_overrides)
    abstract = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    shardings = param_shardings(abs_state, mesh) if mesh is not None else None
    flat_sh = {}
    if shardings is not None:
        for path, v in jax.tree_util.tree_flatten_with_path(
                shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
            flat_sh[_path_str(path)] = v.get_value()
    specs = {p: (n, kind, shp) for p, n, kind, shp in _leaf_specs(cfg)}
    wmap = _weight_map(hf_dir)
    expected = {n for name, _, _ in specs.values() for n in _hf_names(cfg, name)}
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(k for k in wmap if k not in expected and k not in ignorable
                        and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:  # e.g. qkv biases in a checkpoint whose config says qwen3
        raise ValueError(f"{hf_dir}: tensor(s) not used by a {cfg.model_type} model with this "
                         f"config: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    pdt = np.dtype(cfg.jnp_param_dtype)

    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def read(name, hf_shape):
            if name not in wmap:
                raise KeyError(f"{hf_dir}: missing tensor {name!r} (expected shape {hf_shape})")
            fn = wmap[name]
            if fn not in handles:
                handles[fn] = stack.enter_context(safe_open(fn, framework="numpy"))
            sl = handles[fn].get_slice(name)
            shape = tuple(sl.get_shape())
            if shape != tuple(hf_shape):
                raise ValueError(f"{os.path.basename(fn)}: tensor {name!r} has shape {shape}, "
                                 f"expected {tuple(hf_shape)}")
            return handles[fn].get_tensor(name)

        def load(path, var):
            key = _path_str(path)
            if key not in specs:
                raise KeyError(f"from_hf: no HF mapping for parameter {key!r}")
            name, kind, hf_shape = specs[key]
            names = _hf_names(cfg, name)
            stacked = "{i}" in name
            host = np.empty(var.shape, pdt)
            per = var.shape[1:] if stacked else var.shape
            for i, n in enumerate(names):
                w = read(n, hf_shape).astype(pdt)
                w = (w.T if kind == "T" else w).reshape(per)
                if stacked:
                    host[i] = w
                else:
                    host[...] = w
            if key in flat_sh:
                arr = jax.make_array_from_callback(host.shape, flat_sh[key], lambda idx: host[idx])
            else:
                arr = jax.device_put(host)
            return var.replace(arr)

        state = jax.tree_util.tree_map_with_path(
            load, abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def to_hf(model: Qwen, out_dir: str, max_shard_bytes: int = 5 * 2**30,
          dtype: str | None = None, tokenizer=None,
          generation_config: dict[str, Any] | None = None) -> None:
    """Writes config.json + model.safetensors (or model-0000i-of-0000N.safetensors with an
    index when larger than ``max_shard_bytes``), loadable by AutoModelForCausalLM; with a
    ``tokenizer`` its files (chat template included) and with ``generation_config`` a
    generation_config.json, so AutoTokenizer and ``generate`` use the export as it is.

    dtype: storage dtype for the files (default: the parameters' own). One leaf at a time is
    gathered to the host; on multi-host runs every process gathers, process 0 writes.
    """
    cfg: ModelConfig = model.config
    out_dtype = dtype or cfg.param_dtype
    if out_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"to_hf: dtype {out_dtype!r} is not one of ('float32', 'bfloat16')")
    odt = np.dtype(jax.numpy.dtype(out_dtype))
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(out_dir, exist_ok=True)
    flat = {_path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(
        nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
    specs = _leaf_specs(cfg)
    # plan shards at leaf granularity from shapes alone
    shards: list[list[int]] = [[]]
    size = 0
    for j, (_, name, _, hf_shape) in enumerate(specs):
        nbytes = len(_hf_names(cfg, name)) * int(np.prod(hf_shape)) * odt.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(j)
        size += nbytes
    n = len(shards)
    fnames = (["model.safetensors"] if n == 1 else
              [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])
    weight_map, total = {}, 0
    for fname, idxs in zip(fnames, shards):
        tensors = {}
        for j in idxs:
            path, name, kind, hf_shape = specs[j]
            host = shd.to_host(flat[path].get_value()).astype(odt)
            for i, nm in enumerate(_hf_names(cfg, name)):
                w = host[i] if "{i}" in name else host
                w = w.reshape(hf_shape[::-1]).T if kind == "T" else w.reshape(hf_shape)
                tensors[nm] = np.ascontiguousarray(w)
                weight_map[nm] = fname
                total += w.nbytes
        if writer:
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del tensors
    if writer:
        hf_cfg = cfg.to_hf_config()
        hf_cfg["dtype"] = out_dtype
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        if n > 1:
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        if generation_config is not None:
            with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
                json.dump(dict(generation_config), f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
