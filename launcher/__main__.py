"""`python -m launcher ...`: the only @hydra.main. It validates the command line before Hydra
creates a run directory (so bad input writes nothing), then hands the config to `app.run`."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from launcher import cli
from launcher.config import register_schema
from launcher import app


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    with cli.user_errors():
        app.main(cfg)


def single_run(argv: list[str]) -> bool:
    """No sweep is asked for on the command line (-m, --multirun, hydra.mode=); conf/ and recipes
    never set hydra.mode (launcher/recipes.py rejects `hydra:` keys)."""
    return not any(a in ("-m", "--multirun") or a.lstrip("+~").startswith("hydra.mode") for a in argv)


def main() -> None:
    register_schema()
    with cli.user_errors():
        sys.argv = [sys.argv[0], *cli.prepare_argv(sys.argv[1:])]
    if single_run(sys.argv[1:]):
        # Hydra composes the whole config once only to read hydra.mode, unset here: a single run
        from hydra._internal.hydra import Hydra

        if hasattr(Hydra, "get_mode"):
            Hydra.get_mode = lambda self, config_name, overrides: None
    _hydra_main()


if __name__ == "__main__":
    main()
