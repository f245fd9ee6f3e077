"""``python -m klear_jax.curate`` / ``klear-curate``: see ``klear_jax.curate``."""

import logging
import os

from klear_jax import config as C
from klear_jax.curate import run
from klear_jax.data.records import RecordError

log = logging.getLogger("klear_jax.curate")


def _print_report(report: dict, cfg) -> None:
    for st in report["steps"]:
        log.info("%-16s seen %8d kept %8d dropped %s", st["step"], st["seen"], st["kept"],
                 st["dropped"])
    o = cfg.output
    print(f"wrote {report['written']} records to {report['curated_jsonl']}; report: "
          f"{os.path.join(o.dir, o.name)}_curate_report.md")


def main() -> None:
    C.run_config_cli(run, errors=(C.ConfigError, RecordError, FileNotFoundError,
                                  FileExistsError, ValueError), report=_print_report)


if __name__ == "__main__":
    main()
