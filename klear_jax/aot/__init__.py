"""Ahead-of-time compilation for a Cloud TPU topology, from a CPU host (libtpu installed).

    python -m klear_jax.aot --config=configs/sft_qwen3_8b.py --topology=v5p-64
    python -m klear_jax.aot --config=configs/gppo_math_qwen3_8b.py:chips=64,tensor=4 --topology=v6e-64 \
        --what=rl_step,engine_insert,engine_decode --out=/tmp/aot.json

Builds the topology's devices (``jax.experimental.topologies``), the config's mesh over them,
abstract parameters / optimizer state / batches (``jax.ShapeDtypeStruct`` with shardings;
nothing the size of the model is ever allocated), then lowers and compiles the real jitted
functions the training entry points run:

    sft_step   klear_jax.sft.step.build_sft_step: [batch_size, seq_len] rows
    rl_step    klear_jax.rl.step.build_rl_step: one mini-batch of batch_prompts /
               num_minibatches * group_size rows of max_prompt_len + max_new_tokens tokens
               (the longest bucket)
    engine_insert  klear_jax.engine.Engine's insert: insert_rows distinct prompts of
               max_prompt_len tokens prefilled and written into the slot cache (decode_slots
               rows of max_prompt_len + max_new_tokens entries, donated), first tokens sampled
    engine_decode  the Engine's decode chunk: decode_chunk steps of every slot (donated)
    prefill    the static Sampler's prefill (the engine's reference): decode_slots /
               group_size prompts into a fresh KV cache, repeated group_size times
    decode     the static Sampler's decode while_loop over that cache (donated)

Default for an RL config: rl_step, engine_insert, engine_decode.

For each it reports per-chip memory (``compiled.memory_analysis()``), XLA's cost estimate
(``compiled.cost_analysis()``: it counts a scanned or looped body ONCE, so for the layer scan
its FLOPs are low by about the layer count) and analytical FLOPs (``klear_jax.flops``) with the time
they take at the chip's peak and the implied MFU. Splash attention is compiled as the real
Mosaic TPU kernel (not the CPU interpret mode the model picks on a CPU backend).
"""

from klear_jax.aot.compile import (TOPOLOGIES, build_jobs, format_report, libtpu_available,
                                   main, parse_topology, run, topology_devices)

__all__ = ["TOPOLOGIES", "build_jobs", "format_report", "libtpu_available", "main",
           "parse_topology", "run", "topology_devices"]
