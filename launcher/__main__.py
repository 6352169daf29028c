"""`python -m launcher ...`: the only @hydra.main. It validates the command line before Hydra
creates a run directory (so bad input writes nothing), then hands the config to `app.run`."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from launcher import cli
from launcher.config import register_schema
from launcher import app
from launcher.errors import ConfigError, SweepError


STARTED = time.time()


FAILED_JOBS: list[str] = []  # a sweep's jobs stopped by bad input (`_hydra_main`)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    with cli.user_errors():
        try:
            app.main(cfg)
        except ConfigError as err:
            _remove_empty_run_dir()
            job = _sweep_job()
            if job is None or isinstance(err, SweepError):
                raise
            # one job's bad input (a model without default LoRA targets...) stops that job only:
            # the sweep goes on, and the process exits 2 once every job has run (`main`)
            print(f"error: {job}: {err}", file=sys.stderr)
            FAILED_JOBS.append(job)


def _sweep_job() -> str | None:
    """'job N (its overrides)' when this process runs a sweep (-m), else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return f"job {hc.job.num} ({' '.join(hc.overrides.task)})"


def _remove_empty_run_dir() -> None:
    """A run stopped by bad input that only the planner finds (after Hydra made the run directory)
    leaves nothing behind: the directory goes when it holds only the `.hydra` record this process
    wrote."""
    import shutil

    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    record = run_dir / ".hydra"
    if ([p.name for p in run_dir.iterdir()] == [".hydra"]
            and all(f.stat().st_mtime >= STARTED for f in record.iterdir())):
        shutil.rmtree(run_dir)
        for parent in (run_dir.parent, run_dir.parent.parent):  # runs/<date>, runs: when now empty
            if parent.is_relative_to(Path.cwd()) and parent != Path.cwd() and not any(parent.iterdir()):
                parent.rmdir()


def single_run(argv: list[str]) -> bool:
    """No sweep is asked for on the command line (-m, --multirun, hydra.mode=); conf/ and recipes
    never set hydra.mode (launcher/recipes.py rejects `hydra:` keys)."""
    return not any(a in ("-m", "--multirun") or a.lstrip("+~").startswith("hydra.mode") for a in argv)


def main() -> None:
    register_schema()
    single = single_run(sys.argv[1:])
    with cli.user_errors():
        sys.argv = [sys.argv[0], *cli.prepare_argv(sys.argv[1:], validate=not single)]
    if single:
        from hydra._internal.hydra import Hydra
        from hydra.types import RunMode

        # Hydra composes the whole config once only to read hydra.mode, unset here: a single run
        if hasattr(Hydra, "get_mode"):
            Hydra.get_mode = lambda self, config_name, overrides: None
        # the run's one composition is validated before Hydra creates the run directory
        compose_config, argv = Hydra.compose_config, sys.argv[1:]

        def checked(self, config_name, overrides, run_mode, *args, **kwargs):
            with cli.user_errors():
                cfg = compose_config(self, config_name, overrides, run_mode, *args, **kwargs)
                if run_mode == RunMode.RUN:
                    cli.check_composed(cfg, argv)
            return cfg

        Hydra.compose_config = checked
    _hydra_main()
    if FAILED_JOBS:
        print(f"error: {len(FAILED_JOBS)} sweep job(s) stopped by bad input: "
              + "; ".join(FAILED_JOBS), file=sys.stderr)
        sys.exit(ConfigError.exit_code)


if __name__ == "__main__":
    main()
