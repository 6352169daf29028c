"""plan.html: the plan as pictures, one self-contained file (Plotly's JavaScript inlined).

Read from the run directory: plan.json (every candidate), and when present measure.json
(mode=measure) and metrics.jsonl (mode=run; memory/ and timing/ passes of mode=measure). Shows
1. per candidate, its memory stacked by what holds it, against the device and its usable share;
2. estimated throughput against memory, the chosen candidate marked;
3. measured per-rank peaks next to the estimate, loss and throughput per step, after a run;
4. every candidate's verdict and the chosen one's assumptions.
Works offline: nothing is loaded from the network.

The figures are Plotly figure dicts (what `plotly.graph_objects.Figure.to_plotly_json` gives for
the same figure, with Plotly's default template), written the way `plotly.io.to_html` writes them
(`figure_div`), with the plotly.js bundled in the plotly package inlined: the Python side of
Plotly, whose figure classes take longer to import and validate than a plan takes, is not used.
"""
from __future__ import annotations

import html
import importlib.util
import json
from pathlib import Path

FILE = "plan.html"
SEGMENTS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer_states", "optimizer states"),
            ("activations", "activations"), ("buffers", "buffers"), ("allocator_cache", "allocator cache"),
            ("runtime", "runtime (context, NCCL, workspaces)"))
COLORS = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#b279a2", "#9d755d")


def segments(c: dict) -> dict:
    """Bytes per stacked segment: the breakdown at the allocated peak, the caching allocator's
    unused reserve (peak reserved - peak allocated; 0 on CPU processes) and the runtime terms."""
    m = c["memory"]
    out = {k: m["breakdown"].get(k, 0) for k, _ in SEGMENTS if k != "allocator_cache"}
    out["allocator_cache"] = max(0, m["peak_reserved_bytes"] - m["peak_allocated_bytes"])
    return out


def label(i: int, c: dict) -> str:
    sizes = "".join(f" {k}={c['layout'][k + '_size']}" for k in ("tp", "pp") if c["layout"][k + "_size"] > 1)
    return f"#{i} {c['strategy']}{sizes} {c['trains_label']} m{c['micro_batch_size']}"


def unit_of(top: float) -> tuple[str, float]:
    return ("GiB", 2.0**30) if top >= 2**30 else ("MiB", 2.0**20)


def largest(plan: dict) -> int:
    return max([c["memory"]["device_total_bytes"] for c in plan["candidates"]], default=0)


def off_scale(plan: dict, usable: float) -> bool:
    """The usable memory is far above every candidate (CPU processes): drawing it would flatten
    every bar, so the charts are scaled to the candidates and say where the limit is."""
    return usable > 2 * largest(plan) > 0


def unit(plan: dict, usable: float = 0) -> tuple[str, float]:
    return unit_of(largest(plan) if off_scale(plan, usable) else max(largest(plan), capacity(plan)))


def capacity(plan: dict) -> int:
    return plan["candidates"][0]["memory"]["capacity_bytes"] if plan["candidates"] else 0


def hline(y: float, text: str, dash: str, where: str) -> tuple[dict, dict]:
    """(shape, annotation) of a horizontal line across the plot, as `Figure.add_hline` makes them
    (annotation_position 'top right' or 'bottom left')."""
    shape = {"line": {"color": "black", "dash": dash}, "type": "line", "x0": 0, "x1": 1, "xref": "x domain",
             "y0": y, "y1": y, "yref": "y"}
    x, xanchor, yanchor = (1, "right", "bottom") if where == "top right" else (0, "left", "top")
    return shape, {"showarrow": False, "text": text, "x": x, "xanchor": xanchor, "xref": "x domain", "y": y,
                   "yanchor": yanchor, "yref": "y"}


def memory_figure(plan: dict, usable: float) -> dict:
    name, scale = unit(plan, usable)
    cands = plan["candidates"]
    x = [label(i, c) for i, c in enumerate(cands)]
    data = [{"hovertemplate": f"%{{x}}<br>{title}: %{{y:.2f}} {name}<extra></extra>", "marker": {"color": color},
             "name": title, "x": x, "y": [segments(c)[key] / scale for c in cands], "type": "bar"}
            for (key, title), color in zip(SEGMENTS, COLORS)]
    layout: dict = {}
    title = f"Peak memory per {per(plan)} of every candidate (worst rank)"
    if off_scale(plan, usable):
        title += f"; usable {usable / 2**30:.2f} GiB, above every candidate"
    else:
        lines = [hline(value / scale, f"{text} {value / scale:.2f} {name}", dash, where)
                 for value, text, dash, where in ((capacity(plan), "device", "solid", "top right"),
                                                  (usable, "usable", "dash", "bottom left"))]
        layout = {"shapes": [sh for sh, _ in lines], "annotations": [a for _, a in lines]}
    layout.update({"xaxis": {"tickangle": -60}, "legend": {"orientation": "h", "y": 1.08}, "margin": {"b": 200},
                   "barmode": "stack", "title": {"text": title}, "yaxis": {"title": {"text": name}}, "height": 620})
    return {"data": data, "layout": layout}


def per(plan: dict) -> str:
    return "CPU process" if plan["device"] == "cpu" else "GPU"


def speed_figure(plan: dict, usable: float) -> dict:
    name, scale = unit(plan, usable)
    cands = plan["candidates"]
    data = []
    for fits, color in ((True, "#4c78a8"), (False, "#e45756")):
        idx = [i for i, c in enumerate(cands) if c["fits"] == fits]
        data.append({"hovertemplate": "%{text}<br>%{x:.2f} " + name + ", %{y:,.0f} tokens/s<extra></extra>",
                     "marker": {"color": color}, "mode": "markers", "name": "fits" if fits else "does not fit",
                     "text": [label(i, cands[i]) for i in idx],
                     "x": [cands[i]["memory"]["device_total_bytes"] / scale for i in idx],
                     "y": [cands[i]["speed"]["tokens_per_s"] for i in idx], "type": "scatter"})
    if plan["chosen"] is not None:
        c = cands[plan["chosen"]]
        data.append({"marker": {"color": "#54a24b", "line": {"width": 1}, "size": 18, "symbol": "star"},
                     "mode": "markers+text", "name": "chosen", "text": [label(plan["chosen"], c)],
                     "textposition": "top center", "x": [c["memory"]["device_total_bytes"] / scale],
                     "y": [c["speed"]["tokens_per_s"]], "type": "scatter"})
    layout: dict = {}
    if not off_scale(plan, usable):  # as Figure.add_vline makes it
        x = usable / scale
        layout = {"shapes": [{"line": {"dash": "dash"}, "type": "line", "x0": x, "x1": x, "xref": "x", "y0": 0, "y1": 1,
                              "yref": "y domain"}],
                  "annotations": [{"showarrow": False, "text": "usable", "x": x, "xanchor": "left", "xref": "x",
                                   "y": 1, "yanchor": "top", "yref": "y domain"}]}
    layout.update({"title": {"text": "Estimated throughput against memory"},
                   "xaxis": {"title": {"text": f"{name} per {per(plan)}"}},
                   "yaxis": {"title": {"text": "tokens/s (whole cluster)"}}, "height": 480})
    return {"data": data, "layout": layout}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def measured_figures(run_dir: Path, plan: dict) -> list[dict]:
    """Measured per-rank peaks next to the estimate; loss and throughput per step (of mode=run,
    or of mode=measure's timing pass, which runs without the memory tracker)."""
    figs = []
    rows = json.loads((run_dir / "measure.json").read_text())["memory"] if (run_dir / "measure.json").exists() else []
    metrics = next((m for m in (read_jsonl(run_dir / d / "metrics.jsonl") for d in (".", "timing", "memory")) if m), [])
    if not rows and metrics and plan["chosen"] is not None:
        est = plan["candidates"][plan["chosen"]]["memory"]["peak_allocated_bytes"]
        peaks = [max(r) for r in zip(*(m["peak_allocated_bytes"] for m in metrics if m.get("peak_allocated_bytes")))]
        rows = [{"rank": r, "estimated_peak_bytes": est, "measured_peak_bytes": p} for r, p in enumerate(peaks)]
    if rows:
        name, scale = unit_of(max(max(r["estimated_peak_bytes"], r["measured_peak_bytes"]) for r in rows))
        ranks = [f"rank {r['rank']}" for r in rows]
        data = [{"name": what, "x": ranks, "y": [r[f"{what}_peak_bytes"] / scale for r in rows], "type": "bar"}
                for what in ("estimated", "measured")]
        figs.append({"data": data, "layout": {
            "barmode": "group", "title": {"text": "Peak allocated memory per rank: estimated and measured"},
            "yaxis": {"title": {"text": name}}, "height": 400}})
    if metrics:
        steps = [m["step"] for m in metrics]
        for key, title in (("loss", "Training loss"), ("tokens_per_s", "Measured throughput (tokens/s)")):
            figs.append({"data": [{"mode": "lines+markers", "name": key, "x": steps, "y": [m.get(key) for m in metrics],
                                   "type": "scatter"}],
                         "layout": {"title": {"text": title}, "xaxis": {"title": {"text": "step"},
                                                                       "dtick": max(1, len(steps) // 10)},
                                    "height": 360}})
    return figs


def _plotly_file(*parts: str) -> Path:
    """A file of the installed plotly package (found without importing it)."""
    spec = importlib.util.find_spec("plotly")
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)


def to_json(value) -> str:
    """Compact JSON safe inside a <script> element, as `plotly.io.to_json_plotly` writes it (NaN
    and infinities as null; <, > and / escaped)."""
    out = json.dumps(value, separators=(",", ":"))
    if "NaN" in out or "Infinity" in out:
        out = json.dumps(json.loads(out, parse_constant=lambda _: None), separators=(",", ":"))
    return out.replace("<", "\\u003c").replace(">", "\\u003e").replace("/", "\\u002f")


def figure_div(fig: dict, div_id: str, include_plotlyjs: bool, template: dict) -> str:
    """The <div> `plotly.io.to_html(fig, full_html=False, include_plotlyjs="inline" or False,
    div_id=div_id, config={"displaylogo": False})` writes for this figure with `template`."""
    layout = {"template": template, **fig["layout"]}
    height = f"{layout['height']}px" if "height" in layout else "100%"
    load = ""
    if include_plotlyjs:
        js = _plotly_file("package_data", "plotly.min.js").read_text(encoding="utf-8")
        load = ("        <script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
                f"        <script>{js}</script>    ")
    config = json.dumps({"displaylogo": False, "responsive": True})
    script = (f'                if (document.getElementById("{div_id}")) {{                    Plotly.newPlot('
              f'                        "{div_id}",                        {to_json(fig["data"])},'
              f'                        {to_json(layout)},                        {config}                    )'
              "                }")
    return (f'<div style="height:{height}; width:100%;">                {load}            <div id="{div_id}" '
            'class="plotly-graph-div" style="height:100%; width:100%;"></div>            <script>'
            f"                window.PLOTLYENV=window.PLOTLYENV || {{}};                {script};            "
            "</script>        </div>").strip()


def verdict_table(plan: dict) -> str:
    name, scale = unit_of(largest(plan))
    head = "".join(f"<th>{h}</th>" for h in ("#", "candidate", f"total {name}", "tokens/s", "verdict"))
    body = []
    for i, c in enumerate(plan["candidates"]):
        verdict = "chosen: fastest that fits" if i == plan["chosen"] else c["reason"]
        cls = "chosen" if i == plan["chosen"] else ("fits" if c["fits"] else "oom")
        body.append(f"<tr class='{cls}'><td>{i}</td><td>{html.escape(label(i, c))}</td>"
                    f"<td>{c['memory']['device_total_bytes'] / scale:.2f}</td>"
                    f"<td>{c['speed']['tokens_per_s']:,.0f}</td><td>{html.escape(verdict)}</td></tr>")
    return f"<table id='verdicts'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def notes_html(plan: dict) -> str:
    from launcher.report_table import grouped_notes

    items = [f"<li>{html.escape(n)}</li>" for n in grouped_notes(plan.get("notes", []))]
    if plan["chosen"] is not None:
        items += [f"<li>{html.escape(n)}</li>" for n in plan["candidates"][plan["chosen"]]["memory"]["notes"]]
    return f"<ul id='assumptions'>{''.join(items)}</ul>"


STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}tr.chosen{background:#dff0d8;font-weight:bold}
tr.oom{color:#a94442}h1{font-size:1.4em}"""


def render(run_dir: Path, safety_margin: float | None, device: str, results_dir: Path | None = None) -> str:
    """The HTML text of plan.html for the run directory `run_dir`; measurements are read from
    `results_dir` (default `run_dir`; a fallback attempt's directory after an out-of-memory).
    `safety_margin`: the share of memory the planner kept free (None: none)."""
    plan = {**json.loads((run_dir / "plan.json").read_text()), "device": device}
    usable = capacity(plan) * (1 - (safety_margin or 0.0))
    figs = [("memory", memory_figure(plan, usable)), ("speed", speed_figure(plan, usable))]
    figs += [(f"measured-{k}", f) for k, f in enumerate(measured_figures(results_dir or run_dir, plan))]
    template = json.loads(_plotly_file("package_data", "templates", "plotly.json").read_text())
    parts = [figure_div(f, name, k == 0, template) for k, (name, f) in enumerate(figs)]
    chosen = plan["chosen"]
    headline = ("no candidate fits" if chosen is None else
                f"chosen: {html.escape(label(chosen, plan['candidates'][chosen]))}")
    where = f"{plan['gpus']} CPU processes" if device == "cpu" else f"{plan['gpus']} x {plan['hardware']}"
    title = f"{plan['model']['name']} on {where}"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}: {headline}</h1>{''.join(parts)}"
            f"<h2>Why each candidate won or lost</h2>{verdict_table(plan)}"
            f"<h2>Notes and assumptions</h2>{notes_html(plan)}</body></html>")


def write(run_dir: Path, safety_margin: float | None, device: str, results_dir: Path | None = None) -> Path:
    path = run_dir / FILE
    path.write_text(render(run_dir, safety_margin, device, results_dir))
    return path
