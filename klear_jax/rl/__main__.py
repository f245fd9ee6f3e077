"""``python -m klear_jax.rl`` / ``klear-rl``: see ``klear_jax.rl``."""

import logging

from klear_jax import config as C
from klear_jax.rewards import SandboxUnavailable
from klear_jax.rl import run


def main() -> None:
    C.run_config_cli(run, errors=(C.ConfigError, SandboxUnavailable),
                     report=lambda out, cfg: logging.getLogger("klear_jax.rl").info(
                         "finished: %s", {k: out[k] for k in ("step", "updates", "stopped")}))


if __name__ == "__main__":
    main()
