"""Fixed benchmark workloads: ``python -m klear_jax.bench --out FILE.json``.

Workloads (each in its own fresh subprocess, same thread settings), default model
``bench-small`` (Qwen3 shape, random weights, float32, untied embeddings; see ``model_config``):

    train      the real jitted RL train step (GPPO + positive-SFT loss, AdamW) on B x T
               tokens: tokens/s (median of >= 5 steps after warm-up), compile time, peak
               memory (compiled memory_analysis + process peak RSS), MFU against JAX's own
               float32 matmul peak measured in the same process.
    sample     the real Sampler (temperature 1): 8 prompts x 64 tokens, 256 new tokens:
               generated tokens/s, time to first token, decode cost per step at 64 vs 1024
               cached positions.
    scale      train tokens/s at 512 / 2048 / 8192 tokens per row (B = 4096 // T rows, at
               least 1, remat "full" so the 8192 row fits), compile time at 2 / 8 / 32 layers.
    reference  transformers' PyTorch Qwen3, same shape and batch (``bench.reference``).
    rollout    (on request: ``--workloads rollout``) static sampler vs rollout engine on a
               long-tailed stop schedule (lognormal lengths, mean / max 0.3): useful tokens/s
               and slot utilisation of each (``bench.rollout``); ``--preset gpu-1.7b
               --workloads rollout`` runs it at Qwen3-1.7B shape on one GPU.

The workloads live in ``bench.workloads`` (the torch side in ``bench.reference``, the
accelerator preset ``gpu-1.7b`` in ``bench.gpu``); ``bench.driver`` runs each in a fresh
process, computes the ratios, checks the targets and prints the table. Results:
docs/performance.md.
"""

from klear_jax.bench.driver import main

__all__ = ["main"]
