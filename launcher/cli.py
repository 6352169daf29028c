"""The command surface: turn every bad input into one line naming the key and the fix (exit 2),
fill in detected defaults, and compose/validate the config before Hydra makes a run directory."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from pathlib import Path
from typing import Iterator

from launcher.catalogue import CONF_DIR, did_you_mean, group_options
from launcher.config import register_schema
from launcher.validate import to_config
from launcher.environment import cache_dir_problem
from launcher.errors import ConfigError, one_line
from launcher import fallback, recipes
from launcher import recipe_export
from launcher.app import mode_problem, model_spec
from launcher.report import wrapped
from launcher.hardware import detect_local_profile
from launcher.config import LauncherConfig

GROUPS = ("model", "hardware")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Print a ConfigError (or a Hydra/OmegaConf composition error) as one line; exit 2."""
    try:
        yield
    except ConfigError as err:
        _fail(str(err))
    except Exception as err:  # noqa: BLE001 - only composition errors are translated
        msg = explain(err)
        if msg is None:
            raise
        _fail(msg)


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(ConfigError.exit_code)


def prepare_argv(argv: list[str], validate: bool = True) -> list[str]:
    """Validate the overrides by composing them, and add detected defaults (hardware).
    `validate=False`: the caller validates the config Hydra composes for the run instead
    (`check_composed`), so a single run composes once."""
    register_schema()  # a -m sweep composes only in Hydra

    if any(a.partition("=")[0] == "recipe_from" for a in argv):  # export a finished run as a recipe

        recipe_export.main(argv)
        raise SystemExit(0)
    check_override_syntax(argv)
    notes: list[str] = []
    argv = fallback.resume_argv(argv)  # resume=<run dir>: that run's overrides; never reuse a run dir
    check_group_values(argv)
    argv = translate_hardware(argv)
    argv, recipe_groups = recipes.translate_argv(argv)  # recipe=NAME: a checked copy on the search path
    if "mode=calibrate" in argv and not any(a.split("=", 1)[0] == "model" for a in argv):
        argv = [*argv, "model=tiny-llama"]  # the schema requires a model; calibration does not use it
    if "hardware" not in recipe_groups and not any(a.split("=", 1)[0].lstrip("+~") == "hardware" for a in argv):
        hw, note = detect_hardware()
        argv = [*argv, f"hardware={hw}"]
        notes.append(note)
    if (validate or _resuming(argv)) and "-m" not in argv and "--multirun" not in argv:
        check(compose(argv))  # a resumed run also composes its earlier run's overrides (`check`)
    for n in notes:
        print(wrapped(f"note: {n}"), file=sys.stderr)
    return argv


def check(config, resume: bool = True) -> None:
    """What composing the overrides does not check: the cache directory, the model (its spec) and a
    resumed run."""
    why = cache_dir_problem(config.cache_dir)
    if why:
        raise ConfigError(why)
    if config.mode.name != "calibrate":  # calibration measures the machine, not a model
        model_spec(config)  # raises on any bad key, value or model
    why = mode_problem(config)
    if why:
        raise ConfigError(why)
    if resume and isinstance(config.resume, str):
        fallback.check_resume(config, compose(run_overrides(config.resume)))


def _resuming(argv: list[str]) -> bool:
    return any(a.partition("=")[0].lstrip("+~") == "resume" and a.partition("=")[2].lower() not in ("", "false")
               for a in argv)


def check_composed(cfg, argv: list[str]) -> None:
    """`check` the config Hydra composed for a run (with its `hydra` node) before Hydra creates the
    run directory, as `prepare_argv` checks its own composition; a resumed run was checked there
    (composing its earlier run's overrides needs Hydra's global state, which the run holds now)."""
    import copy

    from omegaconf import open_dict, read_write

    given = next((a.partition("=")[2] for a in argv if a.startswith("hydra.run.dir=")), None)
    why = run_dir_problem(given) if given and "${" not in given else ""
    if why:
        raise ConfigError(why)
    task = copy.deepcopy(cfg)
    with read_write(task), open_dict(task):
        del task["hydra"]
    check(to_config(task, argv=_task_overrides(argv)), resume=False)


def run_dir_problem(run_dir: str) -> str:
    """Why Hydra cannot make the run directory the user gave (`hydra.run.dir`): its nearest
    existing ancestor is a file, or not writable; or ''."""
    import os

    key = f"hydra.run.dir={run_dir}"
    ancestor = Path(run_dir).expanduser().absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{key}: {ancestor} is a file, not a directory; give hydra.run.dir=<a new directory>"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{key}: {ancestor} is not writable; run from a writable directory or give hydra.run.dir=<a writable path>"
    return ""


def _task_overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")
            and (not a.startswith("hydra.") or a.startswith("hydra.searchpath="))]


_OVERRIDE = re.compile(r"^(~|\+{1,2})?[A-Za-z_][\w.\-@/]*(=.*)?$")


def check_override_syntax(argv: list[str]) -> None:
    """Every argument is a flag (-m, --multirun, ...) or a Hydra override `key=value`."""
    for a in argv:
        if not a.isprintable():
            raise ConfigError(f"{a!r} contains a control character (newline, NUL, ...); type the value as plain text")
        if a.startswith("-"):
            continue
        if not _OVERRIDE.match(a) or ("=" not in a and not a.startswith("~")):
            raise ConfigError(f"{a!r} is not an override; overrides look like key=value, e.g. gpus=4")


def check_group_values(argv: list[str]) -> None:
    """A config-group override (model=, hardware=) must name a file of its group; Hydra raises a
    bare ValueError for some values (e.g. model=null). In a sweep (-m) each of its values must."""
    sweep = "-m" in argv or "--multirun" in argv
    for arg in argv:
        key, _, value = arg.partition("=")
        group = key.lstrip("+~")
        if group not in GROUPS or key.startswith("~"):
            continue
        for one in sweep_values(arg, group_options(group)) if sweep else [value]:
            if one not in group_options(group) and not one.endswith((".yaml", ".yml")):
                raise ConfigError(f"{group}={one}: no such {group}{did_you_mean(one, group_options(group))}; "
                                  f"valid choices: {', '.join(group_options(group))}")


def sweep_values(arg: str, options: list[str]) -> list[str]:
    """The values a sweep override takes (`model=a,b`, `choice(a,b)`, `glob(tiny-*)`), read by
    Hydra's own override parser; a plain override is its one value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    try:
        override = OverridesParser.create().parse_override(arg)
    except Exception as err:  # noqa: BLE001 - Hydra's OverrideParseException and its kin
        raise ConfigError(f"{arg}: {one_line(str(err))}") from None
    if isinstance(override.value(), Glob):
        return override.value().filter(options) or [override.get_value_element_as_str()]
    if override.is_discrete_sweep():
        return list(override.sweep_string_iterator())
    return [override.get_value_element_as_str()]


def translate_hardware(argv: list[str]) -> list[str]:
    """`hardware=PATH.yaml` (a profile file, e.g. the one mode=calibrate writes) -> `hardware=NAME`
    plus `hydra.searchpath=[file://ROOT]` with the file at ROOT/hardware/NAME.yaml: Hydra finds
    config-group options only under its search-path roots (https://hydra.cc/docs/advanced/search_path/).
    A file not in a `hardware/` directory, or whose name shadows a catalogue profile (the catalogue
    comes first in the search path), is copied to a fresh ROOT under a free name."""
    import shutil
    import tempfile

    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key != "hardware" or not value.endswith((".yaml", ".yml")):
            out.append(arg)
            continue
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"hardware={value}: no such file; give a profile name "
                              f"({', '.join(group_options('hardware'))}) or a YAML file written by mode=calibrate")
        name, root = path.stem, path.parent.parent
        if path.parent.name != "hardware" or name in group_options("hardware"):
            name = name if name not in group_options("hardware") else f"{name}-file"
            root = Path(tempfile.mkdtemp(prefix="launcher-hw-"))
            (root / "hardware").mkdir()
            shutil.copyfile(path, root / "hardware" / f"{name}.yaml")
        out += [f"hardware={name}", f"hydra.searchpath=[file://{root}]"]
    return out


def detect_hardware() -> tuple[str, str]:
    """Map the first local GPU (nvidia-smi name) to a hardware profile; a100-80g if none."""
    return detect_local_profile(group_options("hardware"))


def run_overrides(run_dir: str) -> list[str]:
    """The command-line overrides a run was started with (Hydra's .hydra/overrides.yaml)."""
    from omegaconf import OmegaConf

    return [str(a) for a in OmegaConf.load(Path(run_dir) / ".hydra" / "overrides.yaml")]


def compose(argv: list[str]):
    """Compose conf/ with these overrides into a validated LauncherConfig (no run directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    overrides = _task_overrides(argv)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides)
    return to_config(cfg, argv=overrides)


def explain(err: BaseException) -> str | None:
    msg = _explain(err)
    return None if msg is None else one_line(msg)


def _explain(err: BaseException) -> str | None:
    """One line for a Hydra/OmegaConf composition error, or None if it is not one."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    text = str(err)
    m = re.search(r"Could not find '([\w-]+)/([^']+)'", text)
    if isinstance(err, MissingConfigException) and m:
        group, value = m.groups()
        return f"{group}={value}: no such {group}{did_you_mean(value, group_options(group))}; valid choices: {', '.join(group_options(group))}"
    m = re.search(r"You must specify '([\w-]+)'", text)
    if m:
        group = m.group(1)
        return f"{group} is required: add {group}=<name>; valid choices: {', '.join(group_options(group))}"
    if isinstance(err, OverrideParseException):
        return f"cannot parse the command line: {text.splitlines()[0]}; overrides look like key=value"
    m = re.search(r"Could not override '([^']+)'", text)
    if m and "Key '" in str(err.__cause__ or ""):
        key = m.group(1)
        keys = valid_keys(key)
        prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
        hint = did_you_mean(key.rsplit(".", 1)[-1], keys, prefix)
        return f"{key}: unknown key{hint}; valid keys here: {', '.join(keys)}"
    cause = err.__cause__
    m = re.search(r"Error merging override ([\w.\-]+)=(.*)", text)
    if m and "is not a ListConfig, list or tuple" in str(cause or ""):  # `key=a` on a list-typed key
        key, value = m.groups()
        return f"{key}: takes a list; write it in brackets, e.g. {key}=[{value}]"
    if isinstance(err, ConfigCompositionException) and cause is not None:
        inner = _explain(cause)
        if inner:
            return inner
    if isinstance(err, (ConfigCompositionException, OmegaConfBaseException)):
        first = re.sub(r"\s+", " ", text.strip().splitlines()[0]) if text.strip() else type(err).__name__
        k = re.search(r"full_key: ([\w.\-]+)", text)
        key = k.group(1) if k else getattr(err, "full_key", None)
        e = re.search(r"Value .* \(dict\) is not a valid input for <enum '(\w+)'>", text)
        if key and e:  # `init.x=...` on a key that takes one word
            import launcher.config as schema

            names = [m.name for m in getattr(schema, e.group(1), [])]
            return f"{key}: takes one of [{', '.join(names)}], not sub-keys; e.g. {key}={names[0] if names else '...'}"
        v = (re.search(r"Value '\{.*\}' is not a valid (bool|int|float)", text)
             or re.search(r"Value '\{.*\}' of type 'dict' could not be converted to (Integer|Float|Boolean|String)", text)
             or re.search(r"Cannot convert 'dict' to (string)", text))
        if key and v:  # `fallback.x=...`, `gpus.x=...` on a key that takes one value
            kind = {"Integer": "int", "Float": "float", "Boolean": "bool", "String": "str", "string": "str"}.get(
                v.group(1), v.group(1))
            example = {"bool": "true", "int": "1", "float": "0.5", "str": "..."}[kind]
            return f"{key}: takes one {kind} value, not sub-keys; e.g. {key}={example}"
        return f"{key}: {first}" if key else first
    return None


def valid_keys(full_key: str | None) -> list[str]:
    """The field names allowed next to `full_key` in the schema."""
    cls = LauncherConfig
    for p in (full_key or "").split(".")[:-1]:
        f = {f.name: f for f in dataclasses.fields(cls)}.get(p)
        if f is None or not dataclasses.is_dataclass(f.default_factory):  # type: ignore[arg-type]
            break
        cls = f.default_factory  # type: ignore[assignment]
    return sorted(f.name for f in dataclasses.fields(cls))
