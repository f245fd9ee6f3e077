"""Flax NNX decoder for Qwen3 (q/k RMSNorm) and Qwen2/2.5 (qkv bias).

Layers are stored stacked (every per-layer parameter has a leading L axis) and run under
``jax.lax.scan``, so compile time does not grow with depth; the layer body is wrapped in
``jax.checkpoint`` with the configured policy. With a KV cache (sampling) the layers are
unrolled instead, each over its own cache buffer. Every ``nnx.Param`` carries its logical
axis names in the ``logical_axes`` metadata; ``param_shardings`` maps them to a mesh.

Parameter layout (paths inside ``nnx.state(model)``)::

    embed.embedding                     [V, D]        (vocab, embed)
    layers.input_norm.scale             [L, D]        (layers, norm)
    layers.post_attn_norm.scale         [L, D]
    layers.attn.q_proj.kernel           [L, D, H, hd] (layers, embed, q_heads, head_dim)
    layers.attn.q_proj.bias             [L, H, hd]    Qwen2 only
    layers.attn.{k,v}_proj.kernel       [L, D, K, hd] (layers, embed, kv_heads, head_dim)
    layers.attn.{k,v}_proj.bias         [L, K, hd]    Qwen2 only
    layers.attn.o_proj.kernel           [L, H, hd, D] (layers, q_heads, head_dim, embed)
    layers.attn.{q,k}_norm.scale        [L, hd]       Qwen3 only
    layers.mlp.{gate,up}_proj.kernel    [L, D, F]     (layers, embed, mlp)
    layers.mlp.down_proj.kernel         [L, F, D]     (layers, mlp, embed)
    final_norm.scale                    [D]           (norm,)
    lm_head.kernel                      [D, V]        (embed, vocab), absent when tied
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from klear_jax import sharding as shd
from klear_jax.models.attention import positions_from_segment_ids, rope_cos_sin
from klear_jax.models.config import ModelConfig, remat_policy, rope_frequencies
from klear_jax.models.kernels import (apply_rope, attention, cache_attention, project, rms_norm,
                                      slot_attention, swiglu)
from klear_jax.models.logprobs import chunked_token_logprobs

_INIT_STD = 0.02


def _param(rngs, shape, names, dtype, init="normal"):
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(names))


class RMSNorm(nnx.Module):
    def __init__(self, prefix: tuple[int, ...], dim: int, names, eps: float, cfg: ModelConfig,
                 rngs: nnx.Rngs):
        self.scale = _param(rngs, (*prefix, dim), names, cfg.jnp_param_dtype, "ones")
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


class Proj(nnx.Module):
    """A kernel (and optional bias) applied by an einsum the caller names."""

    def __init__(self, shape, names, bias_shape, bias_names, cfg: ModelConfig, rngs: nnx.Rngs):
        self.kernel = _param(rngs, shape, names, cfg.jnp_param_dtype)
        if bias_shape is not None:
            self.bias = _param(rngs, bias_shape, bias_names, cfg.jnp_param_dtype, "zeros")

    def __call__(self, x, eqn: str):
        y = project(eqn, x, self.kernel[...].astype(x.dtype))
        if hasattr(self, "bias"):
            y = y + self.bias[...].astype(x.dtype)
        return y


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, H, K, hd = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = cfg.qkv_bias
        self.q_proj = Proj((L, D, H, hd), ("layers", "embed", "q_heads", "head_dim"),
                           (L, H, hd) if b else None, ("layers", "q_heads", "head_dim"), cfg, rngs)
        kv_names = ("layers", "embed", "kv_heads", "head_dim")
        kvb_names = ("layers", "kv_heads", "head_dim")
        self.k_proj = Proj((L, D, K, hd), kv_names, (L, K, hd) if b else None, kvb_names, cfg, rngs)
        self.v_proj = Proj((L, D, K, hd), kv_names, (L, K, hd) if b else None, kvb_names, cfg, rngs)
        self.o_proj = Proj((L, H, hd, D), ("layers", "q_heads", "head_dim", "embed"), None, None,
                           cfg, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm((L,), hd, ("layers", "head_dim"), cfg.rms_norm_eps, cfg, rngs)
            self.k_norm = RMSNorm((L,), hd, ("layers", "head_dim"), cfg.rms_norm_eps, cfg, rngs)
        self.impl = cfg.attention_impl
        self.recompute_probs = cfg.remat_policy == "none"  # else the layer remat recomputes

    def _qkv(self, x, cos, sin):
        """x [B, T, D] -> q [B, T, H, hd], k, v [B, T, K, hd] (q/k normed and rotated)."""
        q = self.q_proj(x, "btd,dhk->bthk")
        k = self.k_proj(x, "btd,dhk->bthk")
        v = self.v_proj(x, "btd,dhk->bthk")
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = shd.constrain(q, ("act_batch", "act_length", "act_q_heads", "act_head_dim"))
        k = shd.constrain(k, ("act_batch", "act_length", "act_kv_heads", "act_head_dim"))
        v = shd.constrain(v, ("act_batch", "act_length", "act_kv_heads", "act_head_dim"))
        return q, k, v

    def __call__(self, x, cos, sin, q_pos, q_seg, kv):
        """x [B, T, D] -> ([B, T, D], (k, v) [B, T, K, hd] or the updated (cache_k, cache_v)).

        ``kv`` is None (attend within x; the layer's own k / v are returned, for a prefill
        that inserts them into a slot cache) or (cache_k, cache_v, kv_pos, kv_seg, index,
        fresh): this layer's cache (k [B, K, hd, S], v [B, K, S, hd]); the new k/v are
        written at slots index:index + T (in place under donation) and attention reads the
        cache, or, when ``fresh`` (static: the cache was empty, so the slots just written are
        its only filled ones), attends within x exactly as without a cache: same result,
        T x T scores instead of T x S, and the model's training kernel (splash on TPU).
        """
        q, k, v = self._qkv(x, cos, sin)
        if kv is None:
            out = attention(q, k, v, q_pos, q_pos, q_seg, q_seg, impl=self.impl,
                            recompute=self.recompute_probs)
            new_cache = (k, v)
        else:
            ck, cv, kv_pos, kv_seg, index, fresh = kv
            zero = jnp.zeros((), jnp.int32)
            # Head-major, keys length-minor: a row-head's keys are one [hd, S] block and its
            # values one [S, hd] block, the layouts the two decode dots read fastest.
            ck = jax.lax.dynamic_update_slice(ck, k.transpose(0, 2, 3, 1).astype(ck.dtype),
                                              (zero, zero, zero, index))
            cv = jax.lax.dynamic_update_slice(cv, v.swapaxes(1, 2).astype(cv.dtype),
                                              (zero, zero, index, zero))
            ck, cv = shd.constrain(ck, CACHE_K_AXES), shd.constrain(cv, CACHE_V_AXES)
            if fresh:
                # Prefill: empty slots (segment 0) are masked anyway. Over the whole cache
                # the GPPO prefill (4K prompt, 36.8K slots) materialised [B, K, G, T, S]
                # float32 scores of 18 GiB per chip on v5p-64 and no longer fit (docs/aot.md).
                out = attention(q, k, v, q_pos, q_pos, q_seg, q_seg, impl=self.impl)
            else:
                out = cache_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), q_pos, kv_pos,
                                      q_seg, kv_seg)
            new_cache = (ck, cv)
        y = self.o_proj(out, "bthk,hkd->btd")
        return y, new_cache

    def decode_slots(self, x, cos, sin, ck, cv, lengths):
        """One new token per slot of a slot cache (``init_slot_cache``): x [B, 1, D] at
        position lengths[b]; its k / v are written at index lengths[b] of the slot (k
        [B, K, hd, S], v [B, K, S, hd], in place under donation) and it attends to the
        slot's first lengths[b] + 1 entries (``kernels.slot_attention``: the work is bounded
        by what is filled, not by S). Returns (y [B, 1, D], (ck, cv))."""
        q, k, v = self._qkv(x, cos, sin)
        # One dynamic_update_slice per row (vmapped): in place. The equivalent scatter
        # (.at[rows, :, :, lengths].set) made XLA TPU copy the whole cache twice per decode
        # chunk (AOT, Qwen3-8B shapes; docs/aot.md).
        zero = jnp.zeros((), jnp.int32)
        ck = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (zero, zero, i)))(
            ck, k.transpose(0, 2, 3, 1).astype(ck.dtype), lengths)
        cv = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (zero, i, zero)))(
            cv, v.swapaxes(1, 2).astype(cv.dtype), lengths)
        ck, cv = shd.constrain(ck, CACHE_K_AXES), shd.constrain(cv, CACHE_V_AXES)
        out = slot_attention(q, ck, cv, lengths + 1)
        return self.o_proj(out, "bthk,hkd->btd"), (ck, cv)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Proj((L, D, F), ("layers", "embed", "mlp"), None, None, cfg, rngs)
        self.up_proj = Proj((L, D, F), ("layers", "embed", "mlp"), None, None, cfg, rngs)
        self.down_proj = Proj((L, F, D), ("layers", "mlp", "embed"), None, None, cfg, rngs)

    def __call__(self, x):
        h = swiglu(self.gate_proj(x, "btd,df->btf"), self.up_proj(x, "btd,df->btf"))
        h = shd.constrain(h, ("act_batch", "act_length", "act_mlp"))
        return self.down_proj(h, "btf,fd->btd")


class DecoderLayers(nnx.Module):
    """All L layers, parameters stacked on a leading axis; called on one layer's slice."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D = cfg.num_layers, cfg.hidden_size
        self.input_norm = RMSNorm((L,), D, ("layers", "norm"), cfg.rms_norm_eps, cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm((L,), D, ("layers", "norm"), cfg.rms_norm_eps, cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, q_pos, q_seg, kv):
        a, new_kv = self.attn(self.input_norm(x), cos, sin, q_pos, q_seg, kv)  # new_kv: cache
        return self._mlp(x + a), new_kv

    def decode_slots(self, x, cos, sin, ck, cv, lengths):
        a, new_kv = self.attn.decode_slots(self.input_norm(x), cos, sin, ck, cv, lengths)
        return self._mlp(x + a), new_kv

    def _mlp(self, x):
        x = x + self.mlp(self.post_attn_norm(x))
        return shd.constrain(x, ("act_batch", "act_length", "act_embed"))


class Embed(nnx.Module):
    def __init__(self, embedding: nnx.Param):
        self.embedding = embedding


class LMHead(nnx.Module):
    def __init__(self, kernel: nnx.Param):
        self.kernel = kernel


class Qwen(nnx.Module):
    """Qwen2 / Qwen3 causal LM. See the module docstring for the parameter layout."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = Embed(_param(rngs, (V, D), ("vocab", "embed"), cfg.jnp_param_dtype))
        self.layers = DecoderLayers(cfg, rngs)
        self.final_norm = RMSNorm((), D, ("norm",), cfg.rms_norm_eps, cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = LMHead(_param(rngs, (D, V), ("embed", "vocab"), cfg.jnp_param_dtype))

    def unembed_matrix(self):
        """[D, V] output projection (embedding transposed when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def layer_states(self):
        """The stacked layer parameters split into L per-layer States (copies). A decode loop
        takes them once, outside the loop: slicing the stacked weights inside it would copy
        every layer's weights at every step."""
        state = nnx.state(self.layers)
        return tuple(jax.tree.map(lambda a, i=i: a[i], state) for i in range(self.config.num_layers))

    def _embed(self, input_ids, positions):
        """(x [B, T, D] in the compute dtype, rope cos, sin [B, T, hd]) of int32 [B, T] ids at
        ``positions``."""
        cfg = self.config
        x = jnp.take(self.embed.embedding[...], input_ids, axis=0).astype(cfg.jnp_dtype)
        x = shd.constrain(x, ("act_batch", "act_length", "act_embed"))
        inv_freq, scaling = rope_frequencies(cfg)
        return (x, *rope_cos_sin(positions, inv_freq, scaling, cfg.jnp_dtype))

    def hidden_states(self, input_ids, positions=None, segment_ids=None, cache=None,
                      layers=None, fresh_cache: bool = False, return_kv: bool = False):
        """(h [B, T, D] after the final norm, new cache or None).

        input_ids int32 [B, T]; segment_ids int32 [B, T] (0 = padding; default ones);
        positions int32 [B, T] (default: position inside each segment, or, with a cache,
        continuing from the cache's filled slots of the row). ``layers``: optional
        ``layer_states()`` to use with a cache (default: sliced from the stacked parameters).
        ``fresh_cache`` (static): the cache is empty (``init_cache``; prefill), so attention
        runs over this call's T keys instead of the cache's S slots (same result).
        ``return_kv`` (no cache): the second output is every layer's (k, v), each
        [L, B, T, K, hd] (k normed and rotated), for a prefill that fills a slot cache.
        """
        cfg = self.config
        B, T = input_ids.shape
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        segment_ids = segment_ids.astype(jnp.int32)
        if positions is None:
            if cache is None:
                positions = positions_from_segment_ids(segment_ids)
            else:
                prior = jnp.sum(cache["segment_ids"] != 0, axis=1).astype(jnp.int32)
                positions = prior[:, None] + jnp.maximum(
                    jnp.cumsum(segment_ids != 0, axis=1) - 1, 0).astype(jnp.int32)
        positions = positions.astype(jnp.int32)
        x, cos, sin = self._embed(input_ids, positions)

        graphdef, state = nnx.split(self.layers)
        if cache is not None:
            index = jnp.asarray(cache["index"], jnp.int32)
            zero = jnp.zeros((), jnp.int32)
            kv_pos = jax.lax.dynamic_update_slice(cache["positions"], positions, (zero, index))
            kv_seg = jax.lax.dynamic_update_slice(cache["segment_ids"], segment_ids, (zero, index))

            # Sampling unrolls the layers over the per-layer caches: each layer's buffer is
            # updated in place and read by the attention dots directly (slicing one layer
            # out of a stacked [L, ...] cache inside a scan copies it, every step).
            ks, vs = list(cache["k"]), list(cache["v"])
            layers = self.layer_states() if layers is None else layers
            for i in range(cfg.num_layers):
                layer = nnx.merge(graphdef, layers[i])
                x, (ks[i], vs[i]) = layer(x, cos, sin, positions, segment_ids,
                                          (ks[i], vs[i], kv_pos, kv_seg, index, fresh_cache))
            new_cache = {"k": tuple(ks), "v": tuple(vs), "positions": kv_pos,
                         "segment_ids": kv_seg, "index": index + T}
            return self.final_norm(x), new_cache

        def body(h, xs):
            layer = nnx.merge(graphdef, xs)
            h, kv = layer(h, cos, sin, positions, segment_ids, None)
            return h, (kv if return_kv else None)
        if cfg.remat_policy != "none":
            body = jax.checkpoint(body, policy=remat_policy(cfg.remat_policy), prevent_cse=False)
        if cfg.scan_layers:
            x, kvs = jax.lax.scan(body, x, state)
        else:  # unrolled: compile time grows with depth (kept for comparison / debugging)
            outs = []
            for layer_state in self.layer_states():
                x, kv = body(x, layer_state)
                outs.append(kv)
            kvs = jax.tree.map(lambda *a: jnp.stack(a), *outs) if return_kv else None
        return self.final_norm(x), kvs

    def decode_slots(self, tokens, cache, layers=None):
        """Appends one token to every slot of a slot cache (``init_slot_cache``).

        tokens int32 [B] (slot b's token at position cache["lengths"][b]); ``layers``:
        optional ``layer_states()``. Returns (h [B, 1, D] after the final norm, the cache
        with the token's k / v written and lengths + 1 for every slot: a caller with idle
        slots keeps their old lengths, so what was written there stays unread)."""
        cfg = self.config
        lengths = cache["lengths"]
        x, cos, sin = self._embed(tokens[:, None], lengths[:, None])
        graphdef, _ = nnx.split(self.layers)
        layers = self.layer_states() if layers is None else layers
        ks, vs = list(cache["k"]), list(cache["v"])
        for i in range(cfg.num_layers):
            layer = nnx.merge(graphdef, layers[i])
            x, (ks[i], vs[i]) = layer.decode_slots(x, cos, sin, ks[i], vs[i], lengths)
        return self.final_norm(x), {"k": tuple(ks), "v": tuple(vs), "lengths": lengths + 1}

    def __call__(self, input_ids, positions=None, segment_ids=None):
        """Logits float32 [B, T, V] (materialised whole: use token_logprobs for long T)."""
        h, _ = self.hidden_states(input_ids, positions, segment_ids)
        return self.logits(h)

    def logits(self, h):
        """h [B, T, D] -> float32 logits [B, T, V]."""
        w = self.unembed_matrix().astype(h.dtype)
        out = project("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        return shd.constrain(out, ("act_batch", "act_length", "act_vocab"))

    def token_logprobs(self, input_ids, targets, positions=None, segment_ids=None,
                       return_entropy=False, temperature=1.0):
        """(log p(targets) float32 [B, T], entropy float32 [B, T] or None) under the
        policy's logits / ``temperature``, chunked over T so the [B, T, V] logits are never
        materialised."""
        h, _ = self.hidden_states(input_ids, positions, segment_ids)
        return chunked_token_logprobs(h, self.unembed_matrix(), targets,
                                      chunk_size=self.config.logprob_chunk_size,
                                      remat=self.config.logprob_remat,
                                      return_entropy=return_entropy, temperature=temperature)


# ------------------------------------------------------------------------- KV cache
def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None):
    """Empty KV cache: k, v tuples of L per-layer head-major arrays, k [B, K, hd, S] and
    v [B, K, S, hd] (S = max_len); positions, segment_ids int32 [B, S] (0 = empty slot);
    index int32 scalar (next slot to write; all rows share it, so prompts are left-padded).
    ``max_len`` must cover prompt + generated tokens: a write past the end is clamped by
    dynamic_update_slice (overwrites the last slots), so size it up front."""
    kv = init_slot_cache(cfg, batch, max_len, dtype)
    return {"k": kv["k"], "v": kv["v"], "positions": jnp.zeros((batch, max_len), jnp.int32),
            "segment_ids": jnp.zeros((batch, max_len), jnp.int32),
            "index": jnp.zeros((), jnp.int32)}


def init_slot_cache(cfg: ModelConfig, slots: int, max_len: int, dtype=None):
    """Empty slot cache for a rollout engine: every slot (row) is its own sequence, filled
    from index 0 and at its own pace. k, v: L per-layer arrays k [B, K, hd, S], v
    [B, K, S, hd] (``init_cache``'s layouts, B = slots, S = max_len); lengths int32 [B]:
    entries filled per slot (a token at index t has position t; entries >= lengths[b] are
    never read, so a slot is reused by overwriting it from 0 and resetting its length)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    B, K, S, hd = slots, cfg.num_kv_heads, max_len, cfg.head_dim
    layers = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return {"k": layers((B, K, hd, S)), "v": layers((B, K, S, hd)),
            "lengths": jnp.zeros((B,), jnp.int32)}


CACHE_K_AXES = ("cache_batch", "cache_kv_heads", "cache_head_dim", "cache_length")
CACHE_V_AXES = ("cache_batch", "cache_kv_heads", "cache_length", "cache_head_dim")
CACHE_LOGICAL_AXES = {  # k / v: per layer
    "k": CACHE_K_AXES,
    "v": CACHE_V_AXES,
    "positions": ("cache_batch", "cache_length"),
    "segment_ids": ("cache_batch", "cache_length"),
    "index": (),
    "lengths": ("cache_batch",),  # slot cache
}


def cache_shardings(cache, mesh):
    """NamedSharding per cache leaf (same structure as ``init_cache`` / ``init_slot_cache``)."""
    return {k: jax.tree.map(lambda x, k=k: shd.named_sharding(mesh, CACHE_LOGICAL_AXES[k],
                                                              jnp.shape(x)), v)
            for k, v in cache.items()}


# ------------------------------------------------------------------------- sharding
def _is_var(x):
    return isinstance(x, nnx.Variable)


def param_logical_axes(model_or_state):
    """Tree (like ``nnx.state``) of logical-name tuples, one per parameter."""
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    return jax.tree.map(lambda v: v.get_metadata().get("logical_axes"), state, is_leaf=_is_var)


def param_shardings(model_or_state, mesh):
    """NamedSharding per parameter (a State of the same structure as ``nnx.state(model)``),
    from each Param's ``logical_axes`` metadata via ``sharding.logical_to_spec``."""
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state

    def one(v):
        names = v.get_metadata().get("logical_axes")
        return v.replace(shd.named_sharding(mesh, names, v.shape))
    return jax.tree.map(one, state, is_leaf=_is_var)


def create_model(cfg: ModelConfig, rngs: nnx.Rngs | None = None, seed: int = 0, mesh=None) -> Qwen:
    """A randomly initialised model, initialised under jit from ``seed`` (or eagerly from
    ``rngs`` when given without a mesh); with ``mesh`` every parameter is created in its
    sharded place (no host copy of the full model)."""
    if rngs is not None and mesh is None:
        return Qwen(cfg, rngs=rngs)
    abstract = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(seed)))
    graphdef, abs_state = nnx.split(abstract)
    out_sh = param_shardings(abs_state, mesh) if mesh is not None else None

    @functools.partial(jax.jit, out_shardings=out_sh)
    def init():
        return nnx.state(Qwen(cfg, rngs=nnx.Rngs(seed)))
    return nnx.merge(graphdef, init())
