"""Entry point: `python -m launcher.worker [--check] RUN_DIR/run.json` (one process per rank)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from launcher.errors import ConfigError
from launcher.runspec import RunSpec
from launcher.worker import train

REPORT_GRACE_S = 10.0
"""Seconds a non-reporting rank waits after a bad input before it exits (see `main`)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.worker")
    parser.add_argument("run_json", help="path to RUN_DIR/run.json (launcher.runspec.RunSpec)")
    parser.add_argument("--check", action="store_true", help="validate the inputs, do not train")
    args = parser.parse_args(argv)
    try:
        if not os.path.isfile(args.run_json):
            raise ConfigError(f"run spec {args.run_json} does not exist")
        spec = RunSpec.load(args.run_json)
        if args.check:
            train.check(spec)
        else:
            train.run(spec)
    except ConfigError as err:
        # Every rank sees the same inputs, so one rank reporting is enough. The others wait before
        # leaving: torchrun stops every rank at the first exit, and a rank 0 still importing
        # under load would otherwise be stopped before it could report.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(REPORT_GRACE_S)
        return ConfigError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
