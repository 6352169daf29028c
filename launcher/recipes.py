"""Recipes: shareable Hydra override files (recipes/NAME.yaml) selected with `recipe=NAME` (or
`recipe=PATH.yaml`), each with its provenance (the estimate, and measured numbers once run).

Recipes are data, not code. Before Hydra sees a recipe, `check_recipe` rejects: `_target_` (and
the other instantiation keys) anywhere; a `hydra:` key (launcher plugins, callbacks, search path);
any `${...}` interpolation (resolvers can read the environment or run registered code; a recipe
holds literal values only); `trust_remote_code` other than false (only the command line may enable
it); a defaults entry other than `override /GROUP: OPTION` for GROUP in model, hardware, peft,
launch with OPTION a file of conf/GROUP/; and any key outside the launcher schema
(launcher/config.py) or that the command decides (mode, report, resume, run_dir, cache_dir).
The validated content (without `provenance`) is written to a fresh search-path root as
`recipe/NAME.yaml`, so Hydra composes exactly the bytes that were checked
(https://hydra.cc/docs/advanced/search_path/); command-line overrides still win over it.

`python -m launcher recipe_from=RUN_DIR [recipe_name=NAME] [recipe_dir=DIR]` exports a finished
run as a recipe (launcher/recipe_export.py); `python -m launcher.recipes readme` regenerates
recipes/README.md; `python -m launcher.recipes estimate [NAME...]` re-plans and stores estimates.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

from launcher.catalogue import did_you_mean, group_options
from launcher.errors import ConfigError
from launcher.config import LauncherConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE_DIR = REPO_ROOT / "recipes"
HEADER = "# @package _global_"
GROUPS = ("model", "hardware", "peft", "launch")
COMMAND_KEYS = ("mode", "report", "resume", "run_dir", "cache_dir")
"""Keys the command decides, never a recipe."""
INSTANTIATE_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")
"""hydra.utils.instantiate's special keys (https://hydra.cc/docs/advanced/instantiate_objects/overview/)."""
VERSIONED = ("torch", "transformers", "deepspeed", "peft", "colossalai", "launcher")


def installed_versions() -> dict:
    """Versions of Python and of the frameworks a run uses (importlib.metadata: no imports)."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


# ---- validation ------------------------------------------------------------------------------

def _fail(path: Path, key: str, why: str) -> ConfigError:
    return ConfigError(f"recipe {path}: {key}: {why}")


def _schema_fields(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _walk(path: Path, node, key: str, schema) -> None:
    """Check one value: `schema` is the dataclass it must fit, or None for free data."""
    if isinstance(node, dict):
        fields = _schema_fields(schema) if dataclasses.is_dataclass(schema) else None
        for k, v in node.items():
            full = f"{key}.{k}" if key else str(k)
            if not isinstance(k, str):
                raise _fail(path, full, "keys must be strings")
            if k in INSTANTIATE_KEYS:
                raise _fail(path, full, "not allowed: recipes are data, nothing in them is instantiated")
            if "${" in k:
                raise _fail(path, full, "interpolations are not allowed in recipes (literal values only)")
            if k == "trust_remote_code" and v is not False:
                raise _fail(path, full, "only the command line may enable it (model.trust_remote_code=true)")
            if fields is not None and k not in fields:
                raise _fail(path, full, f"not a launcher key{did_you_mean(k, sorted(fields), key + '.' if key else '')}")
            _walk(path, v, full, fields[k] if fields is not None else None)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _walk(path, v, f"{key}[{i}]", None)
    elif isinstance(node, str) and "${" in node:
        raise _fail(path, key, f"interpolation {node!r} is not allowed in recipes (literal values only)")
    elif node is not None and not isinstance(node, (str, int, float, bool)):
        raise _fail(path, key, f"unsupported value {node!r}")


def _check_defaults(path: Path, defaults) -> None:
    if not isinstance(defaults, list):
        raise _fail(path, "defaults", "must be a list of `- override /GROUP: OPTION`")
    for i, entry in enumerate(defaults):
        if entry == "_self_":
            continue
        if not (isinstance(entry, dict) and len(entry) == 1):
            raise _fail(path, f"defaults[{i}]", "only `- override /GROUP: OPTION` entries are allowed")
        (k, v), = entry.items()
        m = re.fullmatch(r"override /?([\w-]+)", str(k))
        if not m or m.group(1) not in GROUPS:
            raise _fail(path, f"defaults[{i}].{k}", f"only `override /GROUP: OPTION` with GROUP one of {', '.join(GROUPS)}")
        if v not in group_options(m.group(1)):
            raise _fail(path, f"defaults[{i}].{k}", f"{v!r} is not a file of conf/{m.group(1)}/")


def check_provenance(path: Path, prov) -> None:
    if not (isinstance(prov, dict) and set(prov) == {"estimate", "measured"}):
        raise _fail(path, "provenance", "must hold exactly `estimate:` and `measured:` (null until the recipe was run)")
    if not isinstance(prov["estimate"], dict) or not (prov["measured"] is None or isinstance(prov["measured"], dict)):
        raise _fail(path, "provenance", "estimate must be a mapping, measured a mapping or null")
    _walk(path, prov, "provenance", None)


def load_recipe(path: Path) -> dict:
    """Parse and check one recipe file; return its content (provenance included)."""
    from omegaconf import OmegaConf

    text = path.read_text()
    if text.splitlines()[:1] != [HEADER]:
        raise _fail(path, "header", f"the first line must be `{HEADER}` (recipes override the whole config)")
    try:
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except Exception as err:  # noqa: BLE001 - any YAML/OmegaConf parse error is the recipe's fault
        raise _fail(path, "yaml", str(err).splitlines()[0]) from None
    if not isinstance(data, dict):
        raise _fail(path, "yaml", "a recipe is a mapping of launcher keys")
    if "hydra" in data:
        raise _fail(path, "hydra", "recipes may not configure Hydra (launcher plugins, callbacks, search path)")
    for k in COMMAND_KEYS:
        if k in data:
            raise _fail(path, k, "set on the command line, not in a recipe")
    _check_defaults(path, data.get("defaults", []))
    check_provenance(path, data.get("provenance"))
    _walk(path, {k: v for k, v in data.items() if k not in ("defaults", "provenance")}, "", LauncherConfig)
    return data


def header_lines(path: Path) -> list[str]:
    """The comment lines after the package line (description, command)."""
    lines = path.read_text().splitlines()[1:]
    out = []
    for ln in lines:
        if not ln.startswith("#"):
            break
        out.append(ln.lstrip("# ").rstrip())
    return out


# ---- recipe=NAME on the command line ---------------------------------------------------------

def recipe_path(value: str) -> Path:
    if value.endswith((".yaml", ".yml")):
        path = Path(value).expanduser().resolve()
    else:
        path = RECIPE_DIR / f"{value}.yaml"
    if not path.is_file():
        names = shipped()
        raise ConfigError(f"recipe={value}: no such recipe{did_you_mean(value, names)}; shipped recipes: "
                          f"{', '.join(names)} (or give a recipe file, recipe=PATH.yaml)")
    return path


def shipped() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def translate_argv(argv: list[str]) -> tuple[list[str], set]:
    """`recipe=NAME|PATH` (also `+recipe=NAME`, as a run's .hydra/overrides.yaml records it) ->
    `+recipe=NAME` and one merged `hydra.searchpath` holding the checked copy. Returns the new
    argv and the groups the recipe chooses (model, hardware, ...)."""
    import tempfile

    from omegaconf import OmegaConf

    values = [a.partition("=")[2] for a in argv if a.partition("=")[0].lstrip("+") == "recipe"]
    if not values:
        return argv, set()
    if len(values) > 1:
        raise ConfigError(f"recipe= given {len(values)} times ({', '.join(values)}); give one recipe")
    path = recipe_path(values[0].strip("'\""))
    data = load_recipe(path)
    name = path.stem if re.fullmatch(r"[\w.-]+", path.stem) else "recipe"
    root = Path(tempfile.mkdtemp(prefix="launcher-recipe-"))
    (root / "recipe").mkdir()
    body = {k: v for k, v in data.items() if k != "provenance"}
    (root / "recipe" / f"{name}.yaml").write_text(f"{HEADER}\n# checked copy of {path}\n" + OmegaConf.to_yaml(body))
    groups = {re.sub(r"^override /?", "", k) for e in data.get("defaults", []) if isinstance(e, dict) for k in e}
    rest = [a for a in argv if a.partition("=")[0].lstrip("+") != "recipe"]
    return merge_searchpaths([*rest, f"+recipe={name}", f"hydra.searchpath=[file://{root}]"]), groups


def merge_searchpaths(argv: list[str]) -> list[str]:
    """Several `hydra.searchpath=[...]` overrides -> one (the last would replace the others)."""
    paths = [a for a in argv if a.partition("=")[0] == "hydra.searchpath"]
    if len(paths) < 2:
        return argv
    entries = [e.strip() for a in paths for e in a.partition("=")[2].strip("[]").split(",") if e.strip()]
    return [a for a in argv if a not in paths] + [f"hydra.searchpath=[{','.join(entries)}]"]


# ---- recipes/README.md -----------------------------------------------------------------------

def _gib(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return _gib(max(value)) if value else "-"
    return f"{value:.3g}"


def _rate(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def readme_text(recipe_dir: Path = RECIPE_DIR) -> str:
    """recipes/README.md: every recipe with its estimate next to what was measured."""
    rows = ["| recipe | fine-tunes | estimate: strategy, peak GiB/GPU, tokens/s | measured: peak GiB/rank (max), "
            "tokens/s | measured with |", "|---|---|---|---|---|"]
    for path in sorted(recipe_dir.glob("*.yaml")):
        data = load_recipe(path)
        est, meas = data["provenance"]["estimate"], data["provenance"]["measured"]
        desc = header_lines(path)[0] if header_lines(path) else ""
        est_cell = f"{est.get('strategy', '-')}, {_gib(est.get('peak_allocated_gib'))}, {_rate(est.get('tokens_per_s'))}"
        if meas:
            strategy = str(est.get("strategy", ""))
            framework = "colossalai" if strategy.startswith("cai_") else "deepspeed" if strategy.startswith("zero") else None
            versions = ", ".join(f"{k} {v}" for k, v in (meas.get("versions") or {}).items() if k in ("torch", framework))
            meas_cell = f"{_gib(meas.get('peak_allocated_gib_per_rank'))}, {_rate(meas.get('tokens_per_s'))}"
            with_cell = f"{meas.get('date', '?')}: {versions}"
        else:
            meas_cell, with_cell = "not run yet", "-"
        rows.append(f"| [{path.stem}]({path.name}) | {desc} | {est_cell} | {meas_cell} | {with_cell} |")
    return "\n".join([
        "# Recipes", "",
        "Shareable, checked configurations: `python -m launcher recipe=NAME` (add overrides after it; the",
        "command line wins). Each file says what it fine-tunes on what hardware and the exact command, and",
        "carries its provenance: the launcher's estimate and, once it has been run, the measured peak",
        "memory and throughput with the versions used. Recipes are data: `_target_`, `hydra:` keys,",
        "`${...}` interpolations, `trust_remote_code` and keys outside the schema are rejected",
        "(launcher/recipes.py).", "",
        "Export a finished run: `python -m launcher recipe_from=RUN_DIR [recipe_name=NAME]` (never",
        "overwrites). Regenerate this file: `python -m launcher.recipes readme`.", "",
        "Peaks are `torch.cuda.max_memory_allocated` per GPU (on CPU: peak live tensor bytes per rank);",
        "tokens/s are for the whole job.", "", *rows, ""])


def gib(num_bytes) -> float | None:
    return None if num_bytes is None else float(f"{num_bytes / 2**30:.4g}")


def estimate_entry(c: dict, date: str) -> dict:
    """provenance.estimate from one candidate of plan.json (launcher/report.py candidate_to_dict)."""
    return {"strategy": c["strategy"], "micro_batch_size": c["micro_batch_size"],
            "grad_accum_steps": c["grad_accum_steps"], "peak_allocated_gib": gib(c["memory"]["peak_allocated_bytes"]),
            "device_total_gib": gib(c["memory"]["device_total_bytes"]),
            "tokens_per_s": round(c["speed"]["tokens_per_s"], 1), "date": date}


def plan_recipe(name: str) -> dict:
    """plan.json of `python -m launcher recipe=NAME mode=plan report=json` (a throwaway run dir)."""
    import json
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="launcher-recipe-plan-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "launcher", f"recipe={name}", "mode=plan", "report=json",
                               f"hydra.run.dir={tmp}/run"], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        if proc.returncode != 0:
            raise RuntimeError(f"planning recipe {name} failed: {proc.stderr.strip()[-2000:]}")
        return json.loads(Path(tmp, "run", "plan.json").read_text())


def write_provenance(path: Path, provenance: dict) -> None:
    """Replace the `provenance:` block (the end of a recipe file) with `provenance`."""
    from omegaconf import OmegaConf

    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("provenance:"))
    path.write_text("".join(lines[:start]) + OmegaConf.to_yaml({"provenance": provenance}))
    load_recipe(path)


def refresh_estimate(name: str) -> dict:
    """Re-plan recipe NAME and store its estimate (the measured block is kept)."""
    import datetime

    path = recipe_path(name)
    plan = plan_recipe(name)
    if plan["chosen"] is None:
        raise RuntimeError(f"recipe {name}: no candidate fits")
    prov = load_recipe(path)["provenance"]
    prov["estimate"] = estimate_entry(plan["candidates"][plan["chosen"]], datetime.date.today().isoformat())
    write_provenance(path, prov)
    return prov["estimate"]


def main(argv: list[str]) -> int:
    """`readme`: regenerate recipes/README.md; `estimate NAME...`: re-plan and store estimates."""
    if argv[:1] == ["readme"]:
        (RECIPE_DIR / "README.md").write_text(readme_text())
        print(RECIPE_DIR / "README.md")
        return 0
    if argv[:1] == ["estimate"]:
        for name in argv[1:] or shipped():
            print(name, refresh_estimate(name))
        return 0
    print("usage: python -m launcher.recipes readme | estimate [NAME...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
