"""``python -m klear_jax.bench``: see ``klear_jax.bench``."""

from klear_jax.bench import main

if __name__ == "__main__":
    main()
