"""``python -m klear_jax.eval`` / ``klear-eval``: see ``klear_jax.eval``."""

from klear_jax import config as C
from klear_jax.data.records import RecordError
from klear_jax.eval import run
from klear_jax.rewards import SandboxUnavailable


def main() -> None:
    C.run_config_cli(run, errors=(C.ConfigError, RecordError, FileNotFoundError, ValueError,
                                  SandboxUnavailable))


if __name__ == "__main__":
    main()
