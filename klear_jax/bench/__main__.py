"""``python -m klear_jax.bench`` / ``klear-bench``: see ``klear_jax.bench``."""

from klear_jax.bench import main as bench_main


def main() -> int:
    bench_main()
    return 0


if __name__ == "__main__":
    main()
