"""``python -m klear_jax.sft``: see ``klear_jax.sft``."""

import logging

from klear_jax import config as C
from klear_jax.sft import run

if __name__ == "__main__":
    C.run_config_cli(run, report=lambda out, cfg: logging.getLogger("klear_jax.sft").info(
        "finished: %s", {k: out[k] for k in ("step", "stopped")}))
