"""The plan as a person sees it: the terminal table at 120 columns, and plan.html in a real
headless Chromium (charts drawn, nothing loaded from the network, a screenshot that is not blank)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.unit.test_exports import TINY_ZERO3, trace_cache

BLOOM = ("model=bloom-1b1", "gpus=4")
SEGMENT_NAMES = ["parameters", "gradients", "optimizer states", "activations", "buffers", "allocator cache",
                 "runtime (context, NCCL, workspaces)"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run the CLI in a shared directory (one trace cache); returns (CompletedProcess, run dir)."""
    root = tmp_path_factory.mktemp("report")
    count = iter(range(100))

    def _run(*args, columns="120"):
        name = f"run{next(count)}"
        r = run_cli(*args, f"hydra.run.dir={name}", f"cache_dir={trace_cache(tmp_path_factory)}", cwd=root,
                    env={"COLUMNS": columns})
        assert r.returncode == 0, r.stderr[-2000:]
        return r, root / name
    return _run


@pytest.fixture(scope="module")
def bloom(runs):
    return runs(*BLOOM)


def table_rows(stdout: str) -> list[list[str]]:
    """The rows of the printed table: lines that start with a candidate number."""
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["#", "strategy"])
    rows = []
    for ln in lines[start + 1:]:
        if not ln.strip() or not ln.split()[0].isdigit():
            break
        rows.append(ln.split())
    return rows


def test_table_fits_120_columns_one_row_per_strategy(bloom):
    r, run_dir = bloom
    width = max(len(ln) for ln in (r.stdout + r.stderr).splitlines())
    assert width <= 120, [ln for ln in (r.stdout + r.stderr).splitlines() if len(ln) > 120]
    plan = json.loads((run_dir / "plan.json").read_text())
    layouts = {(c["strategy"], c["layout"]["tp_size"], c["layout"]["pp_size"], c["trains_label"])
               for c in plan["candidates"]}
    rows = table_rows(r.stdout)
    assert len(rows) == len(layouts) < len(plan["candidates"])
    shown = [int(row[0]) for row in rows]
    assert plan["chosen"] in shown and len(set(shown)) == len(shown)
    for i in shown:  # each row is its strategy's fastest fitting candidate: none of its group is faster
        c = plan["candidates"][i]
        same = [d for d in plan["candidates"] if (d["strategy"], d["layout"], d["trains_label"])
                == (c["strategy"], c["layout"], c["trains_label"]) and d["fits"]]
        assert not same or c["speed"]["tokens_per_s"] >= max(d["speed"]["tokens_per_s"] for d in same) - 1e-6
    chosen_row = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == [str(plan["chosen"])])
    assert "chosen" in chosen_row


def test_the_headline_command_plans_bloom_tensor_parallel_at_tp_2_and_4(bloom):
    """`model=bloom-1b1 gpus=4`: BLOOM's 16 heads and 250,880-entry vocabulary divide by 2 and 4,
    so ColossalAI tensor parallelism is a candidate at both degrees, with an estimate."""
    _, run_dir = bloom
    plan = json.loads((run_dir / "plan.json").read_text())
    tp = {c["layout"]["tp_size"] for c in plan["candidates"]
          if c["strategy"] == "cai_tp" and c["memory"]["peak_allocated_bytes"] > 0}
    assert {2, 4} <= tp, tp


def test_short_verdicts_and_wide_report(runs, bloom):
    r, _ = bloom
    assert "largest term" not in r.stdout and "x slower" in r.stdout
    wide, run_dir = runs(*BLOOM, "report=wide", columns="250")
    header = next(ln for ln in wide.stdout.splitlines() if ln.split()[:2] == ["#", "strategy"])
    for col in ("params", "grads", "optim", "activ", "buffers", "runtime", "host", "tokens/s", "verdict"):
        assert col in header.split()
    # the planner's whole reason, not the short verdict
    assert re.search(r"fits; lost on speed: \d+\.\d{3}x slower than the chosen", wide.stdout), wide.stdout


@pytest.mark.parametrize("reason,short", [
    ("OOM: 110.30 GiB > 76.00 GiB usable (5% margin); largest term: activations 100.08 GiB", "OOM: 110.30 > 76.00 GiB"),
    ("OOM: 900.00 MiB > 1.20 GiB usable (5% margin); largest term: activations 800.00 MiB", "OOM: 900.00 MiB > 1.20 GiB"),
    ("fits; lost on speed: 6.454x slower than the chosen", "6.45x slower"),
    ("fits; not launchable: ColossalAI 0.5.0's pipeline forwards target transformers 4.51", "fits; not launchable here"),
    ("host RAM: offload needs 900.00 GiB per node > 512.00 GiB", "host RAM 900 > 512 GiB"),
    ("host RAM: building the whole model on each rank needs 2055.12 GiB per node > 2048.00 GiB",
     "host RAM 2056 > 2048 GiB"),
    ("host RAM: offload needs 2048.40 GiB per node > 2048.00 GiB", "host RAM 2049 > 2048 GiB"),
])
def test_short_verdict(reason, short):
    from launcher.report_table import short_verdict
    from launcher.types import Candidate, MemoryEstimate, SpeedEstimate, Strategy

    c = Candidate(Strategy("zero2", "deepspeed", zero_stage=2), 1, 1, MemoryEstimate(0, 0, 0, 0, {}, "backward"),
                  SpeedEstimate(0, 0, 1, 1), False, reason)
    assert short_verdict(c, chosen=False) == short


def test_notes_with_one_reason_print_as_one_line():
    """Eight `not planned` lines for ColossalAI under LoRA (4 plugins x 2 training variants) print
    as one; strategies that share a reason but not the variants get their own line; notes of
    another shape and the order of first appearance are kept."""
    from launcher.report_table import grouped_notes

    lora = "does not run peft=lora: LoRA with ColossalAI plugins is not modelled; use ddp or DeepSpeed zero0-3"
    tp3 = "tp_size=3 does not divide the 4 attention heads"
    notes = [f"fsdp2_tp tp=3 not planned: {tp3}", f"cai_tp tp=3 not planned: {tp3}"]
    notes += [f"{s} ({v}) not planned: {lora}" for v in ("lora r=8", "lora r=8 +ckpt")
              for s in ("cai_ddp", "cai_zero1", "cai_zero2", "cai_gemini")]
    notes += ["fsdp2_tp (lora r=8) not planned: " + lora,
              "fsdp2_tp not planned: training.liger_kernel", "cai_tp not planned: training.liger_kernel",
              "cai_pp not planned at micro-batch 3 (for some layouts): 1F1B"]
    assert grouped_notes(notes) == [
        f"fsdp2_tp tp=3, cai_tp tp=3 not planned: {tp3}",
        f"cai_ddp, cai_zero1, cai_zero2, cai_gemini (lora r=8; lora r=8 +ckpt) not planned: {lora}",
        f"fsdp2_tp (lora r=8) not planned: {lora}",
        "fsdp2_tp, cai_tp not planned: training.liger_kernel",
        "cai_pp not planned at micro-batch 3 (for some layouts): 1F1B"]


def test_cpu_processes_not_gpus(runs):
    r, _ = runs(*TINY_ZERO3, "mode=plan")
    title = next(ln for ln in r.stdout.splitlines() if "tiny-llama" in ln)
    assert "2 CPU processes" in title and "per process" in title
    lines = r.stdout.splitlines()
    table = lines[:next(i for i, ln in enumerate(lines) if ln.startswith(("note:", "chosen:")))]
    chosen = next(ln for ln in lines if ln.startswith("chosen:"))
    assert "GPU" not in "\n".join(table + [chosen]) and "per CPU process" in "\n".join(table)
    assert "per process" in chosen


def test_progress_line_shows_after_the_delay_only():
    import io
    import time

    from rich.console import Console

    from launcher.progress import working

    out = io.StringIO()
    with working("tracing the model", console=Console(file=out, force_terminal=True, width=100), delay=0.05):
        time.sleep(0.4)
    assert "tracing the model" in out.getvalue()
    quick = io.StringIO()
    with working("tracing the model", console=Console(file=quick, force_terminal=True, width=100), delay=5):
        pass
    assert "tracing" not in quick.getvalue()


def test_memory_segments_add_up_to_the_device_total(bloom):
    """The stacked bar of each candidate is its whole device total, no term left out or doubled."""
    from launcher.report_html import segments

    _, run_dir = bloom
    for c in json.loads((run_dir / "plan.json").read_text())["candidates"]:
        total = c["memory"]["device_total_bytes"]
        assert sum(segments(c).values()) == pytest.approx(total, rel=0.002), c["strategy"]


def chromium() -> str | None:
    return os.environ.get("LAUNCHER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def open_page(path: Path, shot: Path):
    """Load `path` in headless Chromium; (console errors, non-file requests, page facts)."""
    pytest.importorskip("playwright.sync_api", reason="playwright not installed: scripts/setup installs it")
    if not chromium():
        pytest.skip("Chromium not installed: apt-get install -y chromium (scripts/setup does it as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium())
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors, requests = [], []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda q: None if q.url.startswith("file:") else requests.append(q.url))
        page.goto(path.as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0")
        facts = page.evaluate("""() => {
            const points = id => [...document.querySelectorAll('#' + id + ' .trace.bars')]
                .map(t => t.querySelectorAll('.point').length);
            return {
              memory: points('memory'),
              legend: [...document.querySelectorAll('#memory .legendtext')].map(e => e.textContent),
              chosen_label: [...document.querySelectorAll('#speed .textpoint')].map(e => e.textContent),
              speed_points: document.querySelectorAll('#speed .scatterlayer .point').length,
              measured: points('measured-0'),
              curves: [...document.querySelectorAll('[id^=measured-] .gtitle')].map(e => e.textContent),
              verdict_rows: document.querySelectorAll('#verdicts tbody tr').length,
            };
        }""")
        page.screenshot(path=str(shot))
        browser.close()
    return errors, requests, facts


def not_blank(png: Path) -> None:
    from PIL import Image

    img = Image.open(png).convert("RGB")
    pixels = list(img.get_flattened_data())
    coloured = sum(1 for p in pixels if max(p) - min(p) > 40)
    assert coloured / len(pixels) > 0.05 and len(set(pixels)) > 100, (coloured, len(set(pixels)))


def test_plan_html_renders_in_chromium(bloom, tmp_path):
    _, run_dir = bloom
    plan = json.loads((run_dir / "plan.json").read_text())
    errors, requests, facts = open_page(run_dir / "plan.html", tmp_path / "plan.png")
    assert errors == [] and requests == []
    n = len(plan["candidates"])
    assert facts["memory"] == [n] * 7  # one stacked bar per candidate, seven segments each
    assert sorted(facts["legend"]) == sorted(SEGMENT_NAMES)
    assert facts["speed_points"] == n + 1  # every candidate, and the chosen one's star
    chosen = plan["candidates"][plan["chosen"]]
    assert facts["chosen_label"] == [f"#{plan['chosen']} {chosen['strategy']} full m{chosen['micro_batch_size']}"]
    assert facts["verdict_rows"] == n and facts["measured"] == [] and facts["curves"] == []
    not_blank(tmp_path / "plan.png")


def test_measured_peaks_and_curves_after_a_run(bloom, tmp_path):
    """After mode=measure: measured per-rank peaks next to the estimate, loss and throughput."""
    from launcher import report_html

    _, plan_dir = bloom
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(plan_dir / "plan.json", run_dir)
    (run_dir / "measure.json").write_text(json.dumps({"memory": [
        {"rank": r, "estimated_peak_bytes": 40 * 2**30, "measured_peak_bytes": (41 + r) * 2**30} for r in range(4)]}))
    (run_dir / "timing").mkdir()
    (run_dir / "timing" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0 + s}) + "\n" for s in range(1, 6)))
    report_html.write(run_dir, 0.05, "cuda")
    errors, requests, facts = open_page(run_dir / "plan.html", tmp_path / "measured.png")
    assert errors == [] and requests == []
    assert facts["measured"] == [4, 4]  # estimated and measured bar per rank
    assert any("loss" in t.lower() for t in facts["curves"]) and any("throughput" in t for t in facts["curves"])


@pytest.mark.integration
def test_plan_html_after_a_real_run(runs, tmp_path):
    """mode=run on 2 CPU processes rewrites plan.html with the measured peaks of both ranks and
    the loss and throughput of every step."""
    r, run_dir = runs("model=tiny-llama", "gpus=2", "hardware=cpu", "mode=run", "strategy=ddp", "training.seq_len=32",
                      "training.micro_batch_size=2", "training.max_steps=3")
    assert "trained 3 steps" in r.stdout
    errors, requests, facts = open_page(run_dir / "plan.html", tmp_path / "run.png")
    assert errors == [] and requests == []
    assert facts["measured"] == [2, 2]  # estimated and measured bar for rank 0 and rank 1
    assert len(facts["curves"]) == 3 and any("loss" in t.lower() for t in facts["curves"])
