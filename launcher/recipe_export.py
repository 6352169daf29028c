"""`python -m launcher recipe_from=RUN_DIR [recipe_name=NAME] [recipe_dir=DIR]`: write a finished
(or planned) run as a recipe, never overwriting one.

The recipe holds the run's group choices (model, hardware, peft) and every value of its composed
config (RUN_DIR/.hydra/config.yaml) that differs from those choices' defaults, with the strategy
and micro-batch the run used pinned. Provenance: the estimate of that candidate (plan.json), and
the measured peak per rank and throughput (summary.json) with the versions recorded at launch
(versions.json, written by launcher/launch.py `prepare`).
"""
from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

from launcher.catalogue import CONF_DIR, group_options
from launcher.config import register_schema
from launcher.environment import writable_dir_problem
from launcher.errors import ConfigError
from launcher.recipes import COMMAND_KEYS, HEADER, RECIPE_DIR, estimate_entry, gib, installed_versions, load_recipe
from launcher.fallback import latest_attempt

EXPORT_KEYS = ("recipe_from", "recipe_name", "recipe_dir")
SKIPPED = (*COMMAND_KEYS, "launch", "model.trust_remote_code", "strategy", "training.micro_batch_size")
"""Not copied from the run: decided by the command, the cluster, or pinned from the plan."""
def _flat(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _nest(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def changed_values(run_dir: Path, choices: dict) -> dict:
    """The run's config values that differ from the defaults of its group choices."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_schema()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        base = compose("config", overrides=[f"{g}={c}" for g, c in choices.items()])
    before = _flat(OmegaConf.to_container(base, resolve=False, enum_to_str=True))
    after = _flat(OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=False))
    keep = {k: v for k, v in after.items() if before.get(k, object()) != v
            and not any(k == s or k.startswith(s + ".") for s in SKIPPED)}
    return _nest(keep)


def _candidate(run_dir: Path, spec: dict) -> dict:
    plan = json.loads((run_dir / "plan.json").read_text())
    for c in plan["candidates"]:
        if c["strategy"] == spec["strategy"] and c["micro_batch_size"] == spec["micro_batch_size"]:
            return c
    return plan["candidates"][plan["chosen"]]


def provenance(run_dir: Path, spec_dir: Path) -> dict:
    spec = json.loads((spec_dir / "run.json").read_text())
    c = _candidate(run_dir, spec)
    day = lambda p: datetime.date.fromtimestamp(p.stat().st_mtime).isoformat()  # noqa: E731
    estimate = estimate_entry(c, day(run_dir / "plan.json"))
    summary_path = spec_dir / "summary.json"
    if not summary_path.is_file():
        return {"estimate": estimate, "measured": None}
    s = json.loads(summary_path.read_text())
    versions_path = spec_dir / "versions.json"
    versions = json.loads(versions_path.read_text()) if versions_path.is_file() else installed_versions()
    measured = {"peak_allocated_gib_per_rank": [gib(b) for b in s["measured_peak_allocated_bytes"]],
                "tokens_per_s": round(s["mean_tokens_per_s"], 1) if s.get("mean_tokens_per_s") else None,
                "steps": s["steps"], "first_loss": round(s["first_loss"], 4), "last_loss": round(s["last_loss"], 4),
                "device": spec["device"], "date": day(summary_path), "versions": versions}
    if not versions_path.is_file():
        measured["versions_note"] = "run has no versions.json: versions of the exporting environment"
    return {"estimate": estimate, "measured": measured}


def export(run_dir: Path, name: str | None = None, recipe_dir: Path = RECIPE_DIR) -> Path:
    """Write RUN_DIR as recipe_dir/NAME.yaml; return its path. Never overwrites."""
    from omegaconf import OmegaConf

    run_dir = run_dir.expanduser().resolve()
    if not (run_dir / ".hydra" / "config.yaml").is_file() or not (run_dir / "plan.json").is_file():
        raise ConfigError(f"recipe_from={run_dir}: not a run directory (no .hydra/config.yaml or plan.json)")
    spec_dir = latest_attempt(run_dir)
    if not (spec_dir / "run.json").is_file():
        raise ConfigError(f"recipe_from={run_dir}: no run.json (no candidate fitted); nothing to export")
    hydra_choices = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices
    choices = {g: hydra_choices[g] for g in ("model", "hardware", "peft") if hydra_choices.get(g)}
    for g, c in choices.items():
        if c not in group_options(g):
            raise ConfigError(f"recipe_from={run_dir}: {g}={c} is not in conf/{g}/; a recipe may only name catalogue files")
    spec = json.loads((spec_dir / "run.json").read_text())
    values = changed_values(run_dir, choices)
    values["strategy"] = spec["strategy"]
    values.setdefault("training", {})["micro_batch_size"] = spec["micro_batch_size"]
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    name = name or f"{choices['model']}-{cfg.gpus}x{choices.get('hardware', 'gpu')}-{spec['strategy']}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):  # `recipe=NAME` looks it up in recipe_dir
        raise ConfigError(f"recipe_name={name}: use letters, digits, '.', '_' and '-' only (no path); "
                          "choose the directory with recipe_dir=")
    dest = recipe_dir / f"{name}.yaml"
    per_node = cfg.gpus // cfg.nodes
    body = {"defaults": [{f"override /{g}": c} for g, c in choices.items()], **values,
            "provenance": provenance(run_dir, spec_dir)}
    text = "\n".join([
        HEADER,
        f"# Fine-tune {choices['model']} ({spec['strategy']}, {cfg.training.precision}, micro-batch "
        f"{spec['micro_batch_size']}, seq_len {cfg.training.seq_len}) on {cfg.nodes} node(s) x {per_node} "
        f"{choices.get('hardware')}{' process(es)' if spec['device'] == 'cpu' else ' GPU(s)'}.",
        f"# Command: python -m launcher recipe={name} mode=run",
        f"# Exported from {run_dir} on {datetime.date.today().isoformat()} (python -m launcher recipe_from=...).",
        OmegaConf.to_yaml(body)])
    why = writable_dir_problem(recipe_dir, f"recipe_dir={recipe_dir}", "e.g. recipe_dir=my-recipes")
    if why:
        raise ConfigError(why)
    try:
        with open(dest, "x") as f:
            f.write(text)
    except FileExistsError:
        raise ConfigError(f"recipe {dest} already exists and is never overwritten; choose another recipe_name=") from None
    try:
        load_recipe(dest)
    except ConfigError:
        dest.unlink()
        raise
    return dest


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = [a for a in argv if a.split("=", 1)[0] not in (*EXPORT_KEYS, "cache_dir")]  # cache_dir: unused
    if unknown:
        raise ConfigError(f"recipe_from= takes only {', '.join(k + '=' for k in EXPORT_KEYS)}; not {' '.join(unknown)}")
    dest = export(Path(args["recipe_from"]), args.get("recipe_name"), Path(args.get("recipe_dir", RECIPE_DIR)))
    where = "" if dest.parent == RECIPE_DIR else f" (file: {dest}; run it with recipe={dest})"
    print(f"wrote {dest}\nrun it: python -m launcher recipe={dest.stem} mode=run{where}\n"
          f"update recipes/README.md: python -m launcher.recipes readme")
