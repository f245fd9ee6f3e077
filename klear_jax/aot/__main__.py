"""``python -m klear_jax.aot``: see ``klear_jax.aot``."""

import sys

from klear_jax.aot import main

if __name__ == "__main__":
    sys.exit(main())
