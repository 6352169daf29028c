"""Recipes: shipped ones are valid, compose, plan and stay documented; a recipe that tries to run
code (or change what the command decides) is rejected with one line naming the file and the key;
a run exports into a recipe that reproduces it and never overwrites one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher import cli, recipes
from launcher.errors import ConfigError

SHIPPED = recipes.shipped()
GOOD = """\
# @package _global_
# Fine-tune tiny-llama on 2 CPU processes.
# Command: python -m launcher recipe=good mode=run
defaults:
  - override /model: tiny-llama
  - override /hardware: cpu
gpus: 2
training:
  seq_len: 64
provenance:
  estimate: {}
  measured: null
"""


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_four_required_recipes_are_shipped():
    assert {"bloom-1b1-4gpu-llmem", "llama-3.1-8b-lora-1gpu", "llama-2-70b-2x8gpu", "cpu-demo"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_is_valid_and_says_what_and_how(name):
    path = recipes.RECIPE_DIR / f"{name}.yaml"
    data = recipes.load_recipe(path)
    desc, command = recipes.header_lines(path)[:2]
    assert desc.startswith("Fine-tune ")
    assert command.startswith(f"Command: python -m launcher recipe={name}")
    est = data["provenance"]["estimate"]
    assert {"strategy", "peak_allocated_gib", "tokens_per_s", "date"} <= set(est)
    measured = data["provenance"]["measured"]
    if measured is not None:  # only from a real run: per-rank peaks and the versions used
        assert len(measured["peak_allocated_gib_per_rank"]) == cli.compose(recipes.translate_argv([f"recipe={name}"])[0]).gpus
        assert {"torch", "date"} <= set(measured["versions"]) | set(measured)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_composes_with_command_line_winning(name):
    config = cli.compose(recipes.translate_argv([f"recipe={name}"])[0])
    data = recipes.load_recipe(recipes.RECIPE_DIR / f"{name}.yaml")
    choices = {k.split("/")[-1]: v for e in data["defaults"] for k, v in e.items()}
    assert config.model.name == choices["model"] and config.hardware.name == choices["hardware"]
    assert config.gpus == data["gpus"]
    argv, _ = recipes.translate_argv([f"recipe={name}", "training.seq_len=96", "gpus=1", "nodes=1"])
    override = cli.compose(argv)
    assert override.training.seq_len == 96 and override.gpus == 1


def test_readme_is_up_to_date():
    assert (recipes.RECIPE_DIR / "README.md").read_text() == recipes.readme_text(), \
        "regenerate with: python -m launcher.recipes readme"
    for name in SHIPPED:
        assert f"[{name}]({name}.yaml)" in recipes.readme_text()


EVIL = [
    ("_target_: os.system\n", "_target_"),
    ("training:\n  _target_: os.system\n  _args_: ['touch /tmp/pwned']\n", "training._target_"),
    ("model:\n  hf_config:\n    x: {_target_: os.system}\n", "model.hf_config.x._target_"),
    ("hydra:\n  callbacks:\n    x: {_target_: os.system}\n", "hydra"),
    ("training:\n  seq_len: ${oc.env:SEQ}\n", "training.seq_len"),
    ("data:\n  path: ${eval:'__import__(\"os\").system(\"id\")'}\n", "data.path"),
    ("model:\n  trust_remote_code: true\n", "model.trust_remote_code"),
    ("training:\n  seqlen: 5\n", "training.seqlen"),
    ("mode: run\n", "mode"),
    ("resume: /some/run\n", "resume"),
    ("defaults:\n  - override /hydra/callbacks: x\n", "defaults[0]"),
    ("defaults:\n  - /hydra/launcher: submitit_slurm\n", "defaults[0]"),
    ("defaults:\n  - override /model: ../../etc/passwd\n", "defaults[0]"),
]


@pytest.mark.parametrize("body,key", EVIL, ids=[k for _, k in EVIL])
def test_recipe_that_could_run_code_is_rejected(tmp_path, body, key):
    text = "# @package _global_\n# Fine-tune x.\n" + body + "provenance:\n  estimate: {}\n  measured: null\n"
    path = _write(tmp_path, text, "evil.yaml")
    with pytest.raises(ConfigError) as err:
        recipes.load_recipe(path)
    msg = str(err.value)
    assert msg.startswith(f"recipe {path}: {key}") and "\n" not in msg, msg


def test_recipe_without_package_header_or_provenance_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="header"):
        recipes.load_recipe(_write(tmp_path, GOOD.replace("# @package _global_\n", "")))
    with pytest.raises(ConfigError, match="provenance"):
        recipes.load_recipe(_write(tmp_path, GOOD.split("provenance:")[0]))


def test_cli_rejects_target_recipe_with_one_line_and_writes_nothing(cli, tmp_path):
    evil = _write(tmp_path, GOOD.replace("gpus: 2\n", "gpus: 2\n_target_: os.system\n"), "evil.yaml")
    r = cli(f"recipe={evil}", "mode=plan")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: recipe {evil}: _target_: not allowed: recipes are data, nothing in them is instantiated"]
    assert "Traceback" not in r.stderr and not (cli.cwd / "runs").exists()


def test_trust_remote_code_only_from_the_command_line(tmp_path):
    path = _write(tmp_path, GOOD)
    argv, _ = recipes.translate_argv([f"recipe={path}", "model.trust_remote_code=true"])
    assert cli.compose(argv).model.trust_remote_code is True


def test_unknown_recipe_names_the_choices():
    with pytest.raises(ConfigError, match="no such recipe.*cpu-demo"):
        recipes.translate_argv(["recipe=cpu-dem"])


def test_recipe_hardware_is_not_replaced_by_detection(tmp_path):
    argv = cli.prepare_argv([f"recipe={_write(tmp_path, GOOD)}", "mode=plan"])
    assert not any(a.startswith("hardware=") for a in argv)
    assert cli.compose(argv).hardware.name == "cpu"


def _fake_run(tmp_path: Path) -> Path:
    """A run directory as the app writes it (.hydra, plan.json, run.json, summary.json, versions.json)
    for a recipe-composed config, with numbers chosen here."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    argv, _ = recipes.translate_argv([f"recipe={_write(tmp_path, GOOD)}", "training.learning_rate=0.01"])
    overrides = [a for a in argv if not a.startswith("hydra.")]
    searchpath = next(a for a in argv if a.startswith("hydra.searchpath="))
    with initialize_config_dir(str(cli.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, searchpath], return_hydra_config=True)
    (run / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml({"hydra": cfg.hydra}))
    body = OmegaConf.to_container(cfg, resolve=False)
    del body["hydra"]
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(body))
    cand = {"strategy": "zero2", "micro_batch_size": 4, "grad_accum_steps": 1,
            "memory": {"peak_allocated_bytes": 3 * 2**29, "device_total_bytes": 2**31},
            "speed": {"tokens_per_s": 1234.56}}
    (run / "plan.json").write_text(json.dumps({"candidates": [cand], "chosen": 0}))
    (run / "run.json").write_text(json.dumps({"strategy": "zero2", "micro_batch_size": 4, "device": "cpu"}))
    (run / "summary.json").write_text(json.dumps({
        "measured_peak_allocated_bytes": [2**30, 2**29], "mean_tokens_per_s": 999.0, "steps": 6,
        "first_loss": 5.5, "last_loss": 4.25}))
    (run / "versions.json").write_text(json.dumps({"torch": "9.9.9", "deepspeed": "1.2.3"}))
    return run


def test_export_reproduces_the_run_and_never_overwrites(tmp_path):
    from launcher import recipe_export

    run = _fake_run(tmp_path)
    out = tmp_path / "out"
    dest = recipe_export.export(run, "mine", out)
    data = recipes.load_recipe(dest)
    assert data["defaults"] == [{"override /model": "tiny-llama"}, {"override /hardware": "cpu"},
                                {"override /peft": "none"}]
    assert data["gpus"] == 2 and data["strategy"] == "zero2"
    assert data["training"] == {"seq_len": 64, "learning_rate": 0.01, "micro_batch_size": 4}
    assert data["provenance"]["estimate"]["peak_allocated_gib"] == 1.5
    assert data["provenance"]["estimate"]["tokens_per_s"] == 1234.6
    measured = data["provenance"]["measured"]
    assert measured["peak_allocated_gib_per_rank"] == [1.0, 0.5] and measured["tokens_per_s"] == 999.0
    assert measured["versions"] == {"torch": "9.9.9", "deepspeed": "1.2.3"}
    assert recipes.header_lines(dest)[1] == "Command: python -m launcher recipe=mine mode=run"
    config = cli.compose(recipes.translate_argv([f"recipe={dest}"])[0])
    assert (config.strategy.name, config.training.micro_batch_size, config.training.learning_rate) == ("zero2", 4, 0.01)
    before = dest.read_text()
    with pytest.raises(ConfigError, match="already exists and is never overwritten"):
        recipe_export.export(run, "mine", out)
    assert dest.read_text() == before


def test_recipe_from_on_the_command_line(cli, tmp_path):
    run = _fake_run(tmp_path)
    r = cli(f"recipe_from={run}", "recipe_name=exported", f"recipe_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "exported.yaml").is_file() and "wrote" in r.stdout
    r = cli(f"recipe_from={run}", "recipe_name=exported", f"recipe_dir={tmp_path / 'out'}")
    assert r.returncode == 2 and "never overwritten" in r.stderr


@pytest.mark.parametrize("name,out,fragment", [
    ("../outside", "out", "recipe_name=../outside: use letters"),  # wrote tmp_path/outside.yaml, out of recipe_dir
    ("mine", "file/sub", "recipe_dir="),  # under a file: NotADirectoryError as a traceback
])
def test_export_refuses_a_path_as_name_and_a_directory_it_cannot_make(tmp_path, name, out, fragment):
    from launcher import recipe_export

    run = _fake_run(tmp_path)
    (tmp_path / "file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=fragment):
        recipe_export.export(run, name, tmp_path / out)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_searchpaths_are_merged():
    argv = recipes.merge_searchpaths(["a=1", "hydra.searchpath=[file:///x]", "hydra.searchpath=[file:///y]"])
    assert argv == ["a=1", "hydra.searchpath=[file:///x,file:///y]"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_plans_and_its_estimate_is_current(name):
    """`python -m launcher recipe=NAME mode=plan report=json` chooses a fitting candidate whose numbers are
    the recipe's recorded estimate (refresh with: python -m launcher.recipes estimate NAME)."""
    plan = recipes.plan_recipe(name)
    assert plan["chosen"] is not None
    chosen = plan["candidates"][plan["chosen"]]
    recorded = recipes.load_recipe(recipes.RECIPE_DIR / f"{name}.yaml")["provenance"]["estimate"]
    assert (chosen["strategy"], chosen["micro_batch_size"]) == (recorded["strategy"], recorded["micro_batch_size"])
    current = recipes.estimate_entry(chosen, recorded["date"])
    assert current["peak_allocated_gib"] == pytest.approx(recorded["peak_allocated_gib"], rel=0.05), current


@pytest.mark.integration
def test_cpu_demo_recipe_trains(cli):
    r = cli("recipe=cpu-demo", "mode=run", "training.max_steps=6", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["measured_peak_allocated_bytes"]) == 2 and all(summary["measured_peak_allocated_bytes"])
