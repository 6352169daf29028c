"""What a plan says about strategies it leaves out or ranks lower: a tensor- or pipeline-parallel
template with no layout on the cluster is a line naming the GPU counts that would allow one, and a
candidate as fast as the chosen one says it lost on memory, not on speed."""
from launcher import planner
from launcher.app import model_spec
from launcher.cli import compose
from launcher.report_table import short_verdict
from launcher.types import Candidate, MemoryEstimate, SpeedEstimate, Strategy


def _notes(*overrides, noted=()):
    config = compose(["model=tiny-llama", "hardware=a100-80g", "training.seq_len=64", *overrides])
    return planner.unexpanded_notes(config, model_spec(config), list(noted))


def test_one_gpu_names_why_colossalai_tensor_and_pipeline_parallelism_are_left_out():
    """On one GPU cai_tp and cai_pp have no layout; they used to vanish from the plan without a
    word (fsdp2_tp, refused by its rules, had a line)."""
    notes = _notes("gpus=1")
    (tp,) = [n for n in notes if n.startswith("cai_tp not planned: ")]
    (pp,) = [n for n in notes if n.startswith("cai_pp not planned: ")]
    assert "tp sizes valid for this model: [2]" in tp and "use gpus=" in tp
    assert "pipeline sizes valid for this model: [2]" in pp and "use gpus=" in pp
    assert not any(n.endswith("strategy=auto") for n in notes)  # the plan is auto already


def test_templates_with_a_layout_or_a_line_already_get_no_other_line():
    assert _notes("gpus=2") == []
    assert _notes("gpus=1", "strategy=ddp") == []  # asked for by name: nothing else is planned
    noted = ["cai_tp tp=3 not planned: tp_size=3 does not divide the 4 attention heads",
             "fsdp2_tp tp=3 not planned: tp_size=3 does not divide the 4 attention heads"]  # planner.plan's lines
    assert [n.split()[0] for n in _notes("gpus=3", noted=noted)] == ["cai_pp"]


def _candidate(name: str, tokens_per_s: float, total_gib: float) -> Candidate:
    total = int(total_gib * 2**30)
    return Candidate(Strategy(name, "ddp"), 1, 1, MemoryEstimate(total, total, total, 0, {}, "backward"),
                     SpeedEstimate(1.0, 0.0, 1.0, tokens_per_s), True, "fits")


def test_a_candidate_as_fast_as_the_chosen_lost_on_memory():
    """On one GPU every strategy can have the same estimated speed; the ranking then takes the
    smaller device total, and the verdict said '1.00x slower'."""
    spec = model_spec(compose(["model=tiny-llama", "training.seq_len=64"]))
    best = _candidate("zero3", 20520.0, 22.35)
    tie = planner.explain_loss(_candidate("single", 20520.0, 26.04), best, spec)
    assert tie.reason == ("fits; as fast as the chosen (the same estimated tokens/s), more memory: "
                          "26.04 GiB > 22.35 GiB device total")
    assert short_verdict(tie, False) == "as fast; 26.04 > 22.35 GiB"
    same = planner.explain_loss(_candidate("cai_ddp", 20520.0, 22.35), best, spec)
    assert same.reason == ("fits; ties with the chosen on speed and memory (22.35 GiB device total): the chosen "
                           "comes first in the strategy list")
    assert short_verdict(same, False) == "ties with the chosen"
    slower = planner.explain_loss(_candidate("ddp", 20000.0, 20.0), best, spec)
    assert slower.reason == "fits; lost on speed: 1.026x slower than the chosen"


def test_a_plan_with_nothing_traced_gives_no_parameter_count():
    """When every strategy is left out before its trace the header read '(0.00M params)'."""
    from launcher.report_table import title
    from launcher.types import Plan

    empty = Plan(model={"name": "llama-2-7b"}, hardware="a100-80g", gpus=8, nodes=1, candidates=(), chosen=None,
                 notes=())
    assert title(empty, 80 * 2**30, "cuda") == "llama-2-7b on 8 x a100-80g: 80.00 GiB per GPU"
    counted = Plan(model={"name": "gpt2", "num_params": 124_439_808, "num_trainable_params": 124_439_808},
                   hardware="cpu", gpus=2, nodes=1, candidates=(), chosen=None, notes=())
    assert title(counted, 2**30, "cpu").startswith("gpt2 (0.12B params) on 2 CPU processes")


def test_fsdp2_tp_plans_only_degrees_the_heads_allow():
    """BioGPT-Large has 25 heads: on 4 GPUs no tensor-parallel degree divides them. fsdp2_tp then
    fell back to its template (tp_size=2), and the plan died in the tracer with a traceback."""
    import pytest

    from launcher.errors import ConfigError

    def planned(*overrides):
        config = compose(["model=biogpt-large", "hardware=a100-80g", *overrides])
        return [(s.name, s.tp_size) for s in planner.strategies_for(config, model_spec(config))]

    assert not [s for s in planned("gpus=4") if s[0] == "fsdp2_tp"]
    assert ("fsdp2_tp", 5) in planned("gpus=5")
    assert not [s for s in planned("gpus=1") if s[0] == "fsdp2_tp"]  # one GPU: no degree above 1
    with pytest.raises(ConfigError, match=r"strategy=fsdp2_tp: .*25 attention heads.*valid for this model: \[5\]"):
        planned("gpus=4", "strategy=fsdp2_tp")
    with pytest.raises(ConfigError, match=r"fsdp2\.tp_size=2: tp_size=2 does not divide the 25 attention heads"):
        planned("gpus=4", "strategy=fsdp2_tp", "fsdp2.tp_size=2")
    with pytest.raises(ConfigError, match=r"fsdp2\.tp_size=1: "):
        planned("gpus=4", "fsdp2.tp_size=1")
    notes = planner.unexpanded_notes(compose(["model=biogpt-large", "hardware=a100-80g", "gpus=4"]),
                                     model_spec(compose(["model=biogpt-large", "gpus=4"])), [])
    assert any(n.startswith("fsdp2_tp not planned: ") for n in notes)
