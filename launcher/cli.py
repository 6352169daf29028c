"""The command surface: turn every bad input into one line naming the key and the fix (exit 2),
fill in detected defaults, and compose/validate the config before Hydra makes a run directory."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from pathlib import Path
from typing import Iterator

from launcher.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
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


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def prepare_argv(argv: list[str]) -> list[str]:
    """Validate the overrides by composing them, and add detected defaults (hardware)."""
    notes: list[str] = []
    if not any(a.split("=", 1)[0].lstrip("+~") == "hardware" for a in argv):
        hw, note = detect_hardware()
        argv = [*argv, f"hardware={hw}"]
        notes.append(note)
    if "-m" not in argv and "--multirun" not in argv:
        from launcher.app import model_spec

        model_spec(compose(argv))  # raises on any bad key, value or model
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    return argv


def detect_hardware() -> tuple[str, str]:
    """Map the first local GPU (nvidia-smi name) to a hardware profile; a100-80g if none."""
    from launcher.hardware import detect_local_profile

    return detect_local_profile(group_options("hardware"))


def compose(argv: list[str]):
    """Compose conf/ with these overrides into a validated LauncherConfig (no run directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from launcher.app import to_config

    overrides = [a for a in argv if not a.startswith("-") and not a.startswith("hydra.")]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides)
    return to_config(cfg)


def explain(err: BaseException) -> str | None:
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
    if isinstance(err, ConfigCompositionException) and cause is not None:
        inner = explain(cause)
        if inner:
            return inner
    if isinstance(err, (ConfigCompositionException, OmegaConfBaseException)):
        first = re.sub(r"\s+", " ", text.strip().splitlines()[0]) if text.strip() else type(err).__name__
        k = re.search(r"full_key: ([\w.\-]+)", text)
        key = k.group(1) if k else getattr(err, "full_key", None)
        return f"{key}: {first}" if key else first
    return None


def did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    import difflib

    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def valid_keys(full_key: str | None) -> list[str]:
    """The field names allowed next to `full_key` in the schema."""
    from launcher.config import LauncherConfig

    cls = LauncherConfig
    for p in (full_key or "").split(".")[:-1]:
        f = {f.name: f for f in dataclasses.fields(cls)}.get(p)
        if f is None or not dataclasses.is_dataclass(f.default_factory):  # type: ignore[arg-type]
            break
        cls = f.default_factory  # type: ignore[assignment]
    return sorted(f.name for f in dataclasses.fields(cls))
