"""``python -m klear_jax.demo``: see ``klear_jax.demo``."""

import sys

from klear_jax.demo import main

if __name__ == "__main__":
    sys.exit(main())
