"""klear_jax: Klear-Reasoner style long-CoT SFT and GPPO reinforcement learning in JAX/Flax."""

__version__ = "0.1.0"
