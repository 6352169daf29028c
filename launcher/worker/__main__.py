"""Entry point: `python -m launcher.worker [--check] RUN_DIR/run.json` (one process per rank)."""
from __future__ import annotations

import argparse
import os
import sys

from launcher.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.worker")
    parser.add_argument("run_json", help="path to RUN_DIR/run.json (launcher.runspec.RunSpec)")
    parser.add_argument("--check", action="store_true", help="validate the inputs, do not train")
    args = parser.parse_args(argv)
    try:
        from launcher.runspec import RunSpec
        from launcher.worker import train

        if not os.path.isfile(args.run_json):
            raise ConfigError(f"run spec {args.run_json} does not exist")
        spec = RunSpec.load(args.run_json)
        if args.check:
            train.check(spec)
        else:
            train.run(spec)
    except ConfigError as err:
        # Every rank sees the same inputs, so one rank reporting is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
