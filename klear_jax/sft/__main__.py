"""``python -m klear_jax.sft`` / ``klear-sft``: see ``klear_jax.sft``."""

import logging

from klear_jax import config as C
from klear_jax.sft import run


def main() -> None:
    C.run_config_cli(run, report=lambda out, cfg: logging.getLogger("klear_jax.sft").info(
        "finished: %s", {k: out[k] for k in ("step", "stopped")}))


if __name__ == "__main__":
    main()
