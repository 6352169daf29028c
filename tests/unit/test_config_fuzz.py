"""Random command lines through the CLI's own validation (`cli.prepare_argv`: resume handling,
composition, value checks, the model check): every one ends in a valid config or in one clear
line (a ConfigError, or a composition error that `cli.explain` turns into one line), never in
another exception. No planning here (tracing is too slow for a fuzz loop)."""
from __future__ import annotations

import dataclasses
import enum
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher import cli, validate
from launcher.config import LauncherConfig
from launcher.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def schema_keys(cls=LauncherConfig, prefix: str = "") -> dict[str, object]:
    """Every leaf key of the schema -> its annotated type (resolved)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(schema_keys(kind, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = kind
    return out


KEYS = {k: v for k, v in schema_keys().items() if k not in ("run_dir",)}
MODELS = cli.group_options("model")
HARDWARE = cli.group_options("hardware")
# no NUL: a command line cannot carry one (execve takes C strings)
text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"),
               max_size=12)
nasty = st.sampled_from(["", "null", "???", "${oops}", "a b", "'", "\"x\"", "[1,2]", "{a: 1}", "1e400", "-0",
                         "nan", "inf", "-inf", "0x10", "1_000", "true", "ÿ", "=", ",", "/nonexistent/x.json"])
ints = st.one_of(st.integers(-3, 70), st.integers(-2**70, 2**70), st.sampled_from([0, -1, 2**31, 2**63, 10**30]))


def misspell(word: str) -> st.SearchStrategy[str]:
    i = st.integers(0, max(0, len(word) - 1))
    return st.one_of(
        i.map(lambda n: word[:n] + word[n + 1:]),  # a letter dropped
        i.map(lambda n: word[:n] + "x" + word[n:]),  # a letter inserted
        st.just(word.upper()), st.just(word.replace("_", "-")), st.just(word + "s"),
    )


def value_for(kind) -> st.SearchStrategy[str]:
    origin = typing.get_origin(kind)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if origin is typing.Union and args:
        kind = args[0]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        names = [m.name for m in kind]
        return st.one_of(st.sampled_from(names), st.sampled_from(names).flatmap(misspell), text, nasty)
    if kind is bool:
        return st.one_of(st.sampled_from(["true", "false", "yes", "0", "maybe"]), nasty)
    if kind is int:
        return st.one_of(ints.map(str), nasty)
    if kind is float:
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), ints.map(str), nasty)
    return st.one_of(text, nasty, ints.map(str))


@st.composite
def override(draw) -> str:
    key = draw(st.sampled_from(sorted(KEYS)))
    value = draw(value_for(KEYS[key]))
    key = draw(st.one_of(st.just(key), st.just(key), st.just(key), misspell(key), st.just("+" + key), text))
    return f"{key}={value}"


@st.composite
def command_line(draw) -> list[str]:
    model = draw(st.one_of(st.sampled_from(MODELS), st.sampled_from(MODELS).flatmap(misspell), text, nasty))
    argv = [] if draw(st.integers(0, 9)) == 0 else [f"model={model}"]
    argv.append(f"hardware={draw(st.one_of(st.sampled_from(HARDWARE), st.sampled_from(HARDWARE).flatmap(misspell)))}")
    argv += draw(st.lists(override(), max_size=4))
    return draw(st.permutations(argv))


def outcome(argv: list[str]) -> str | None:
    """None for a valid config, else the one-line message the CLI would print."""
    try:
        cli.prepare_argv(argv)
    except ConfigError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - what the CLI does: explain() or a traceback
        msg = cli.explain(err)
        if msg is None:
            raise
        return msg
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command_line())
def test_random_command_lines_give_a_config_or_one_clear_line(tmp_path_factory, argv):
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.getbasetemp())  # relative paths in random values resolve here
    try:
        message = outcome(argv)
    finally:
        os.chdir(cwd)
    if message is not None:
        assert message.strip() and "\n" not in message, (argv, message)
        assert "Traceback" not in message


@pytest.mark.parametrize("argv,fragment", [
    (["model=tiny-llama", "hardware=cpu", "training.seq_len=0"], "training.seq_len=0"),
    (["model=tiny-llama", "hardware=cpu", "checkpoint.every_steps=-2"], "checkpoint.every_steps=-2"),
    (["model=tiny-llama", "hardware=cpu", "launch.max_restarts=-1"], "launch.max_restarts=-1"),
    (["model=tiny-llama", "hardware=cpu", "max_fallbacks=-1"], "max_fallbacks=-1"),
    (["model=tiny-llama", "hardware=cpu", "training.learning_rate=nan"], "training.learning_rate=nan"),
    (["model=tiny-llama", "hardware=cpu", "launch.master_port=70000"], "launch.master_port=70000"),
    (["model=tiny-llama", "hardware=cpu", "worker.simulate_oom_above_bytes=0"], "worker.simulate_oom_above_bytes"),
    (["model=tiny-llama", "hardware=cpu", "hardware.peak_tflops.bf16=-1"], "hardware.peak_tflops.bf16"),
    (["model=tiny-llama", "hardware=cpu", "data.path=/nonexistent/corpus.txt"], "data.path=/nonexistent/corpus.txt"),
    (["model=tiny-llama", "hardware=cpu", "resume=/nonexistent/run"], "resume=/nonexistent/run"),
    (["model=tiny-llama", "hardware=cpu", "resume=3"], "resume=3"),
])
def test_each_bad_value_names_its_key(argv, fragment):
    message = outcome(argv)
    assert message is not None and fragment in message and "\n" not in message, message


@pytest.mark.parametrize("argv,allowed", [
    (["model.trust_remote_code=true"], True),
    (["++model.trust_remote_code=True"], True),
    (["model.trust_remote_code=yes"], True),
    (["model.trust_remote_code=true", "model.trust_remote_code=false"], False),
    (["gpus=2"], False),
    (["model.name=model.trust_remote_code=true"], False),
])
def test_trust_remote_code_only_from_the_command_line(argv, allowed):
    """The config has trust_remote_code on (as a recipe or model file could set it); it is accepted
    only when the command line itself turns it on."""
    from launcher import app

    config = cli.compose(["model=tiny-llama", "hardware=cpu", "model.trust_remote_code=true"])
    found = [p for p in validate.problems(config, argv) if "trust_remote_code" in p]
    assert (not found) == allowed, found


def test_no_tracing_in_validation(monkeypatch):
    """Validation must not plan (tracing would make bad input slow)."""
    import launcher.planner as planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned during validation"))
    assert outcome(["model=tiny-llama", "hardware=cpu", "training.seq_len=64"]) is None


@settings(max_examples=3, deadline=None)
@given(st.lists(override(), max_size=3))
def test_cli_subprocess_bad_input_is_one_line(tmp_path_factory, extra):
    """As a user runs it: a surely-unknown key among random ones -> exit 2, one error line, no traceback,
    no run directory."""
    cwd = tmp_path_factory.mktemp("cli")
    argv = ["model=tiny-llama", "hardware=cpu", *extra, "training.sequence_length=64"]
    r = subprocess.run([sys.executable, "-m", "launcher", *argv], cwd=cwd, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, (argv, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (cwd / "runs").exists()
