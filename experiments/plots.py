"""Pictures of bench records (matplotlib, headless): where a step's time goes against its floor, sweeps against
their swept axis, and a model's floor by component.

    python -m experiments.plots breakdown experiments/results/bench_20261130-052033_gpu_h200_kernels.json
    python -m experiments.plots sweep experiments/results/sweep_h200x2-ep.jsonl

Each PNG is written beside its records unless `--out` names it.

* `plot_breakdown(records)`: per record, the measured step stacked by component (`--kernel-times`: the record's
  `profile`, or for records that hold only kernel names `step_profile.from_kernel_names`, which names our own
  kernels' components and puts library GEMMs and XLA's kernels, by kind, under "other"), beside the floor at the
  record's measured ceilings and at the datasheet's; and each component's time against its two floors.
* `plot_sweep(records)`: tokens/s per GPU and % of the floor against the swept axis (batch, mesh, weight format,
  ...), one column per phase.
* `plot_roofline(results)`: `experiments.roofline.roofline` results as HBM time and GEMM time by component.

Floors are drawn only where the ceilings belong to the device that ran (`ceiling_applies`): a CPU run's
pictures say the H200 ceilings do not apply instead of plotting ~0.01%. Every function returns the figure and
the artists it drew, keyed by what they show, so a test can read back what was plotted. Figures are built
without pyplot (`matplotlib.figure.Figure`, rendered by Agg): no display, no global state; a notebook shows one
with `display(fig)`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from experiments.hardware import H200_DATASHEET, H200_MEASURED
from experiments.step_profile import from_kernel_names

# one colour per component in every picture (step_profile's and roofline's component names)
COLOURS = {
    "moe_experts": "#1f77b4", "shared_expert": "#9ecae1", "router": "#17becf", "attn_proj": "#ff7f0e",
    "attn_core": "#d62728", "indexer": "#9467bd", "compressor": "#c5b0d5", "mhc": "#bcbd22", "head": "#2ca02c",
    "engram": "#8c564b", "embed": "#c49c94", "kv_write": "#f7b6d2", "drafter": "#7f7f7f",
    "other: GEMM": "#525252", "other: Pallas": "#6b6ecf", "other: XLA glue": "#a3a3a3",
    "kernels not listed": "#e0e0e0", "host / launch gap": "#ffffff",
}
ORDER = tuple(COLOURS)
OTHER_KINDS = {"gemm": "other: GEMM", "pallas": "other: Pallas"}  # every other kind is XLA's glue
ATTRIBUTIONS = {
    "program op names": "every kernel attributed through the compiled program's op names",
    "kernel names only": "our kernels by name; library GEMMs and XLA's kernels only by kind, under other",
}


# ----------------------------------------------------------------------------------------------- records

def read_records(path: str | Path) -> list[dict]:
    """A bench JSON file (a list of records) or a sweep's JSON lines -> its records with status "ok"."""
    text = Path(path).read_text()
    recs = json.loads(text) if str(path).endswith(".json") else [json.loads(x) for x in text.splitlines() if x.strip()]
    if not isinstance(recs, list):
        raise ValueError(f"{path}: not a list of bench records")
    return [r for r in recs if r.get("status") == "ok"]


def ceiling_applies(rec: dict, ceilings: dict) -> bool:
    """Whether a ceiling profile (experiments/hardware.py: "H200 ...") belongs to the device the record ran on."""
    device = f"{rec.get('env', {}).get('backend', '')} {rec.get('env', {}).get('device', '')}".lower()
    return ceilings["name"].split()[0].lower() in device


def step_breakdown(rec: dict) -> dict | None:
    """A profiled record's step per device: {"wall_ms", "segments": {component or "other: <kind>" or "kernels not
    listed" or "host / launch gap": ms}, "named": the components its attribution can name, "attribution",
    "devices"}; None where the record has no per-kernel times.

    CUPTI times the kernels of every device of the process: a mesh's kernel times are divided by its devices (profiles
    from experiments/step_profile are per device already).
    Records that list only their largest kernels (`kernels.top`) show the rest as "kernels not listed"."""
    wall = rec["step_ms"]["median"]
    listed_total = None
    if "components" in rec.get("profile", {}):
        prof = rec["profile"]
    elif "top" in rec.get("kernels", {}):
        prof = from_kernel_names(rec["kernels"], wall)
        listed_total = rec["kernels"].get("kernel_ms_per_step")
    else:
        return None
    n = 1 if prof.get("per_device") else int(rec.get("devices", 1))
    segs: dict[str, float] = {}
    for name, comp in prof["components"].items():
        if name != "other":
            segs[name] = comp["ms"] / n
            continue
        for kind, ms in comp["by_kind"].items():
            key = OTHER_KINDS.get(kind, "other: XLA glue")
            segs[key] = segs.get(key, 0.0) + ms / n
    kernels = prof["kernel_ms_per_step"]
    unlisted = max(0.0, listed_total - kernels) if listed_total else 0.0
    if unlisted > 0.005 * wall * n:   # more than the rounding of the listed times
        segs["kernels not listed"] = unlisted / n
    else:
        unlisted = 0.0
    segs["host / launch gap"] = max(0.0, wall - (kernels + unlisted) / n)
    return {"wall_ms": wall, "segments": segs, "named": {c for c in prof["components"] if c != "other"},
            "attribution": prof.get("attribution", "program op names"), "devices": n}


def roofline_of_record(rec: dict, ceilings: dict) -> dict:
    """The roofline of a record's step (the call experiments/bench.py roofline_of makes) at other ceilings."""
    from experiments.bench import resolve_config
    from experiments.roofline import roofline

    ro = rec["roofline"]
    cfg = resolve_config(rec["preset"], rec.get("layers"), rec.get("moe_impl"), rec.get("attention_impl"),
                         rec.get("expert_weights"), rec.get("dense_weights"), rec.get("engram_vocab_size"),
                         rec.get("head_dtype"), rec.get("index_key_format"))
    mesh = tuple(rec["mesh"][a] for a in ("dp", "ep", "tp"))
    return roofline(cfg, rec["phase"], rec["batch"], rec["context"], rec["new_tokens"], ro["weight_format"],
                    ro["kv_format"], mesh, ro["forced_balance"], ceilings, drafter=ro["drafter"])


def floors(rec: dict) -> dict:
    """{"measured", "datasheet"}: each {"ceilings", "floor_ms", "by_component_ms", "recomputed"}. The measured
    ceilings' floors are the record's own; the datasheet's too where the record holds them (`roofline.datasheet`),
    else recomputed by today's experiments/roofline.py."""
    ro = rec["roofline"]
    out = {}
    for which, held, ceilings in (("measured", ro, ro["ceilings"]),
                                  ("datasheet", ro.get("datasheet"), H200_DATASHEET)):
        if held and "by_component_ms" in held:
            out[which] = {"ceilings": held.get("ceilings", ceilings), "floor_ms": held["floor_ms"],
                          "by_component_ms": dict(held["by_component_ms"]), "recomputed": False}
        else:
            res = roofline_of_record(rec, ceilings)
            out[which] = {"ceilings": res["ceilings"], "floor_ms": res["totals"]["floor_s"] * 1e3,
                          "by_component_ms": {k: c["floor_s"] * 1e3 for k, c in res["components"].items()},
                          "recomputed": True}
    return out


def ceilings_text(c: dict) -> str:
    return (f"{c['name']}: HBM {c['hbm_Bps'] / 1e12:.1f} TB/s, bf16 {c['bf16_flops'] / 1e12:.0f} / "
            f"fp8 {c['fp8_flops'] / 1e12:.0f} TFLOP/s")


def weights_text(rec: dict) -> str:
    """Short weight format: "bf16", "bf16 + fp4 experts", ..."""
    from experiments.bench_report import weight_label

    return weight_label(rec).replace("bfloat16", "bf16").replace("float32", "f32")


def record_label(rec: dict) -> str:
    mesh = "x".join(str(rec["mesh"][a]) for a in ("dp", "ep", "tp"))
    rows = f"B{rec['batch']} x {rec['new_tokens']}"
    mode = rec["mode"] + ("" if rec["phase"] == "prefill" else f" {rec['step']}")
    return (f"{rec['phase']} {mode} {rows}, ctx {rec['context']}\n{rec['config']}, {weights_text(rec)}"
            f"{'' if mesh == '1x1x1' else ', mesh ' + mesh}")


def _figure(rows: int, cols: int, figsize: tuple, **kw) -> tuple:
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots(rows, cols, **kw)


def _save(fig, path: str | Path | None) -> None:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------- breakdown

def _stack_order(names) -> list[str]:
    return sorted(names, key=lambda s: ORDER.index(s) if s in ORDER else len(ORDER))


def _segment_patch(name: str) -> dict:
    return {"facecolor": COLOURS.get(name, "#ffffff"), "edgecolor": "#333333", "linewidth": 0.4,
            "hatch": "//" if name in ("host / launch gap", NOT_PROFILED) else None}


NOT_PROFILED = "not profiled (--kernel-times on a GPU)"


def plot_breakdown(records: list[dict], path: str | Path | None = None, title: str = "") -> tuple:
    """Left: per record, the measured step stacked by component beside its floor at the record's measured
    ceilings and at the datasheet's, stacked the same way (floors only where the ceilings belong to the device).
    Then one panel per record: each component's measured time (bar) against its two floors (ticks).

    A floor bar stacks each component's own floor (the larger of its HBM and GEMM times); they can sum above the
    step's floor (the larger of all HBM and all GEMM time: a compute-bound head overlaps memory-bound experts),
    which is the black line across the bar.

    -> (figure, {"stack": {(record index, "step" | "measured" | "datasheet", segment): Rectangle},
                 "floor_line": {(record index, "measured" | "datasheet"): LineCollection at the step's floor},
                 "component": {(record index, component, segment): Rectangle},
                 "floor_tick": {(record index, "measured" | "datasheet", component): LineCollection}})."""
    if not records:
        raise ValueError("plot_breakdown needs at least one record with status ok")
    parts = [(r, step_breakdown(r), floors(r)) for r in records]
    applies = [ceiling_applies(r, fl["measured"]["ceilings"]) for r, _, fl in parts]
    n = len(records)
    detailed = [i for i, (_, bd, _) in enumerate(parts) if bd]   # a panel per profiled record
    fig = Figure(layout="constrained")
    if len(detailed) <= 1:   # side by side
        fig.set_size_inches(2.5 + 3 * n + 6.2 * len(detailed), 6.4)
        axes = fig.subplot_mosaic([["stack"] + [f"c{i}" for i in detailed]],
                                  width_ratios=[1.6 * n] + [2.0] * len(detailed))
    else:   # the stacks above, a row of component panels below
        fig.set_size_inches(6.4 * len(detailed), 11.5)
        axes = fig.subplot_mosaic([["stack"] * len(detailed), [f"c{i}" for i in detailed]], height_ratios=[1.2, 1])
        for i in detailed[1:]:   # one time scale for comparing the records' components
            axes[f"c{i}"].sharex(axes[f"c{detailed[0]}"])
    ax = axes["stack"]
    drawn = {"stack": {}, "floor_line": {}, "component": {}, "floor_tick": {}}
    used: set[str] = set()
    xt, xl = [], []
    for i, ((rec, bd, fl), ok) in enumerate(zip(parts, applies)):
        bars = [("step", bd["segments"] if bd else {NOT_PROFILED: rec["step_ms"]["median"]})]
        if ok:
            bars += [(w, fl[w]["by_component_ms"]) for w in ("measured", "datasheet")]
        for j, (which, segs) in enumerate(bars):
            x, bottom = 4 * i + j, 0.0
            for name in _stack_order(segs):
                if segs[name] > 0:
                    drawn["stack"][(i, which, name)] = ax.bar(x, segs[name], 0.8, bottom=bottom,
                                                              **_segment_patch(name))[0]
                    used.add(name)
                    bottom += segs[name]
            label = f"{rec['step_ms']['median']:.2f}"
            if which != "step":   # components' own floors can sum above the step's (their resources overlap)
                floor = fl[which]["floor_ms"]
                drawn["floor_line"][(i, which)] = ax.hlines(floor, x - 0.45, x + 0.45, colors="k", linewidth=2)
                label = f"{floor:.2f}" + (f"\n(sum {bottom:.2f})" if bottom > floor * 1.01 else "")
            ax.text(x, bottom, label, ha="center", va="bottom", fontsize=8)
            xt.append(x)
            xl.append({"step": "step", "measured": "floor\nmeasured", "datasheet": "floor\ndatasheet"}[which])
        ax.text(4 * i + (len(bars) - 1) / 2, -0.1, record_label(rec), transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=8)
        if not ok:
            ax.text(4 * i + 1.5, 0.5, _not_applied(rec, fl), transform=ax.get_xaxis_transform(), fontsize=8,
                    va="center", ha="center", color="#555555", wrap=True)
        if i in detailed:
            _component_panel(axes[f"c{i}"], i, rec, bd, fl if ok else None, drawn)
    ax.set_xticks(xt, xl, fontsize=8)
    ax.set_ylabel("ms per step, per device")
    ax.set_xlim(-0.7, 4 * n - 1.3)
    ax.margins(y=0.08)
    ax.set_title("the step by component beside its floors (ms); black line: the step's floor" if drawn["floor_line"]
                 else "the step (ms)", fontsize=9)
    handles = [Patch(label=name, **_segment_patch(name)) for name in _stack_order(used)]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 9), fontsize=8, frameon=False)
    fig.suptitle(_breakdown_title(parts, applies, title), fontsize=8.5)
    _save(fig, path)
    return fig, drawn


def _not_applied(rec: dict, fl: dict) -> str:
    return (f"the {fl['measured']['ceilings']['name'].split()[0]} ceilings\ndo not apply to\n"
            f"{rec.get('env', {}).get('device', '?')}:\nno floor drawn")


def _breakdown_title(parts, applies, title: str) -> str:
    rec0 = parts[0][0]
    env = rec0.get("env", {})
    lines = [(title + ": " if title else "") + f"{env.get('device', '?')} x{rec0.get('devices', 1)}, jax "
             f"{env.get('jax', '?')}, git {str(env.get('git_revision'))[:10]}"]
    lines += [f"attribution: {a} ({ATTRIBUTIONS.get(a, a)})"
              for a in sorted({bd["attribution"] for _, bd, _ in parts if bd})]
    shown = [fl for (_, _, fl), ok in zip(parts, applies) if ok]
    for which in ("measured", "datasheet"):
        texts = sorted({ceilings_text(fl[which]["ceilings"]) for fl in shown})
        if not texts:
            continue
        source = ("recomputed by today's experiments/roofline.py" if any(fl[which]["recomputed"] for fl in shown)
                  else "the record's")
        if which == "measured" and any(fl[which]["ceilings"]["hbm_Bps"] != H200_MEASURED["hbm_Bps"] for fl in shown):
            source += f"; today's {ceilings_text(H200_MEASURED)}"
        lines.append(f"floor {which}: {'; '.join(texts)} ({source})")
    if any(bd and bd["devices"] > 1 for _, bd, _ in parts):
        lines.append("per device: a mesh's CUPTI kernel times (all its devices) divided by its devices")
    return "\n".join(lines)


def _component_panel(ax, i: int, rec: dict, bd: dict | None, fl: dict | None, drawn: dict) -> None:
    """One record: each component's measured ms (bars; "other" stacked by kind) and its floors (ticks). Where
    the attribution names only some components, the others' floors count against "other"."""
    floor = {w: dict(fl[w]["by_component_ms"]) for w in ("measured", "datasheet")} if fl else {}
    named = bd["named"] if bd else set()
    by_names_only = bd is not None and bd["attribution"] == "kernel names only"
    if by_names_only:   # the components the kernel names cannot tell: their kernels are under "other"
        for w in floor:
            floor[w]["other"] = sum(v for k, v in floor[w].items() if k not in named)
    rows = {}
    for name, ms in (bd["segments"] if bd else {NOT_PROFILED: rec["step_ms"]["median"]}).items():
        rows.setdefault("other" if name.startswith("other: ") else name, {})[name] = ms
    for name, v in floor.get("measured", {}).items():
        if v > 0 and (not by_names_only or name in named or name == "other"):
            rows.setdefault(name, {})
    order = _stack_order(rows)
    if "other" in order:   # "other" after the named components, before the gap
        order.remove("other")
        order.insert(next((k for k, r in enumerate(order) if r in ("kernels not listed", "host / launch gap",
                                                                     NOT_PROFILED)), len(order)), "other")
    for y, row in enumerate(order):
        left = 0.0
        for seg in _stack_order(rows[row]):
            drawn["component"][(i, row, seg)] = ax.barh(y, rows[row][seg], 0.6, left=left, **_segment_patch(seg))[0]
            left += rows[row][seg]
        f = floor.get("measured", {}).get(row)
        note = f"{left:.2f}" if rows[row] else ""
        if rows[row] and f:
            note += f" ({left / f:.2f}x floor{': beats the ceilings' if left < f else ''})"
        ax.text(max(left, f or 0, floor.get("datasheet", {}).get(row) or 0), y, "  " + note, va="center", fontsize=7)
        for which, style in (("measured", "solid"), ("datasheet", "dashed")):
            v = floor.get(which, {}).get(row)
            if v:
                drawn["floor_tick"][(i, which, row)] = ax.vlines(v, y - 0.42, y + 0.42, colors="k", linestyles=style,
                                                                 linewidth=1.6)
    ax.set_yticks(range(len(order)), order, fontsize=8)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlabel("ms per step, per device")
    ax.margins(x=0.4)
    ax.grid(axis="x", alpha=0.3)
    if fl:
        ax.legend(handles=[Line2D([], [], color="k", lw=1.6, label="floor, measured ceilings"),
                           Line2D([], [], color="k", lw=1.6, ls="dashed", label="floor, datasheet")],
                  fontsize=7, loc="lower right")
    sub = record_label(rec).replace("\n", ", ")
    if by_names_only:
        sub += "\nother's floor: the components whose kernels are not named"
    ax.set_title(sub, fontsize=8)


# ----------------------------------------------------------------------------------------------- sweeps

def _mesh(r: dict) -> str:
    return "x".join(str(r["mesh"][a]) for a in ("dp", "ep", "tp"))


# the axes a sweep can vary, in the order the x axis is chosen: (name, value of a record, axis label, legend text)
SWEEP_AXES = (
    ("batch", lambda r: r["batch"], "batch (sequences per step)", lambda v: f"B{v}"),
    ("mesh", _mesh, "mesh dp x ep x tp", lambda v: f"mesh {v}"),
    ("weights", weights_text, "weight format", str),
    ("context", lambda r: r["context"], "context (cached positions)", lambda v: f"ctx {v}"),
    ("num_draft", lambda r: r["num_draft"], "drafts per step", lambda v: f"k={v}"),
    ("new_tokens", lambda r: r["new_tokens"], "new tokens per sequence", lambda v: f"new {v}"),
    ("mode", lambda r: f"{r['mode']} {r['step']}", "mode", str),
    ("config", lambda r: r["config"], "model", str),
)


def sweep_axes(recs: list[dict]) -> list[str]:
    """The SWEEP_AXES whose values differ among `recs`."""
    return [name for name, fn, *_ in SWEEP_AXES if len({fn(r) for r in recs}) > 1]


def _sort_key(v):
    if isinstance(v, str) and all(p.isdigit() for p in v.split("x")):   # a mesh: by devices, then dp, ep, tp
        ints = [int(p) for p in v.split("x")]
        return (math.prod(ints), ints)
    return (0, v)


def plot_sweep(records: list[dict], path: str | Path | None = None, title: str = "") -> tuple:
    """Tokens/s per GPU (top row) and % of the floor (bottom row) against the swept axis, one column per phase:
    one line per combination of the other swept axes (legend: those axes and the weight format); % of the floor
    at the record's measured ceilings (solid) and the datasheet's (dashed), drawn only where the ceilings belong
    to the device that ran.

    -> (figure, {(phase, "tokens" | "measured" | "datasheet", legend label): Line2D})."""
    ok = [r for r in records if r.get("status", "ok") == "ok"]
    if not ok:
        raise ValueError("plot_sweep needs at least one record with status ok")
    phases = [ph for ph in ("decode", "prefill") if any(r["phase"] == ph for r in ok)]
    fig, axes = _figure(2, len(phases), figsize=(6.4 * len(phases), 7.6), squeeze=False, sharex="col")
    drawn = {}
    ceilings = set()
    for col, ph in enumerate(phases):
        recs = [r for r in ok if r["phase"] == ph]
        varied = sweep_axes(recs)
        xname = next((a for a in varied if a != "mode" and a != "config"), varied[0] if varied else "batch")
        xi = [a[0] for a in SWEEP_AXES].index(xname)
        _, xfn, xlabel, _ = SWEEP_AXES[xi]
        keys = [a for a in SWEEP_AXES if a[0] in varied and a[0] != xname]
        if xname != "weights" and not any(a[0] == "weights" for a in keys):
            keys.append(SWEEP_AXES[2])   # the weight format is in every label
        xs = sorted({xfn(r) for r in recs}, key=_sort_key)
        numeric = all(isinstance(x, int) for x in xs)
        pos = (lambda v: v) if numeric else (lambda v: xs.index(v))
        lines: dict[str, list[dict]] = {}
        for r in recs:
            lines.setdefault(", ".join(fmt(fn(r)) for _, fn, _, fmt in keys), []).append(r)
        top, bottom = axes[0][col], axes[1][col]
        not_applied = []
        for k, (label, rs) in enumerate(sorted(lines.items())):
            rs.sort(key=lambda r: _sort_key(xfn(r)))
            colour = colormaps["tab10"](k % 10)
            x = [pos(xfn(r)) for r in rs]
            drawn[(ph, "tokens", label)] = top.plot(x, [r["tokens_per_s_per_device"] for r in rs], marker="o",
                                                    color=colour, label=label)[0]
            fits = [r for r in rs if ceiling_applies(r, r["roofline"]["ceilings"])]
            not_applied += [r for r in rs if r not in fits]
            if not fits:
                continue
            fl = [floors(r) for r in fits]
            for which, style, face in (("measured", "-", colour), ("datasheet", "--", "none")):
                y = [100 * f[which]["floor_ms"] / r["step_ms"]["median"] for f, r in zip(fl, fits)]
                drawn[(ph, which, label)] = bottom.plot([pos(xfn(r)) for r in fits], y, marker="o", ls=style,
                                                        color=colour, markerfacecolor=face)[0]
                ceilings |= {(which, ceilings_text(f[which]["ceilings"]) + (" (recomputed by today's "
                              "experiments/roofline.py)" if f[which]["recomputed"] else "")) for f in fl}
        top.tick_params(labelbottom=True)   # shared x axis, labelled in both rows
        for ax in (top, bottom):
            if numeric:
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [str(v) for v in xs])
                ax.minorticks_off()
            else:
                ax.set_xticks(range(len(xs)), xs)
                ax.set_xlim(-0.5, len(xs) - 0.5)
            ax.set_xlabel(xlabel)
            ys = [y for line in ax.get_lines() for y in line.get_ydata()]
            ax.set_ylim(0, 1.12 * max(ys) if ys else 1)
            ax.grid(alpha=0.3)
        implied = {"weights", "new_tokens" if ph == "decode" else "num_draft"}   # in the labels / 1 + drafts / 0
        const = [fmt(fn(recs[0])) for name, fn, _, fmt in SWEEP_AXES if name not in varied and name not in implied]
        top.set_title(f"{ph}: " + ", ".join(const), fontsize=9)
        assumed = any(r["mode"] == "deepinfer" and r["phase"] == "decode" for r in recs)
        unit = "GPU" if all(r.get("env", {}).get("backend") == "gpu" for r in recs) else "device"
        top.set_ylabel(f"tokens/s per {unit}" + ("\n(deepinfer: 3.25 accepted per step)" if assumed else ""))
        if any(lines):   # one unlabelled line: nothing to tell apart
            top.legend(fontsize=7, loc="best")
        bottom.set_ylabel("% of the floor (floor / median step)")
        if not_applied:
            devices = sorted({r.get("env", {}).get("device", "?") for r in not_applied})
            bottom.text(0.5, 0.5, f"{len(not_applied)} point(s) ran on {', '.join(devices)}:\nthe "
                        f"{not_applied[0]['roofline']['ceilings']['name'].split()[0]} ceilings do not apply, "
                        "no % of the floor", transform=bottom.transAxes, ha="center", va="center", fontsize=9,
                        color="#555555")
            if not bottom.get_lines():
                bottom.set_yticks([])
        if any(k[0] == ph and k[1] == "measured" for k in drawn):
            handles = [Line2D([], [], color="k", ls="-", marker="o", label="measured ceilings"),
                       Line2D([], [], color="k", ls="--", marker="o", markerfacecolor="none", label="datasheet")]
            bottom.legend(handles=handles, fontsize=7, loc="best")
    envs = sorted({(e.get("device", "?"), e.get("device_count", 1), e.get("backend", "?"), e.get("jax", "?"),
                    str(e.get("git_revision"))[:10]) for e in (r.get("env", {}) for r in ok)})
    lines = [f"{title or ok[0].get('sweep', '')}: " + "; ".join(f"{d} x{n} ({b}), jax {j}, git {g}"
                                                              for d, n, b, j, g in envs[:3])
             + (f" and {len(envs) - 3} more runs" if len(envs) > 3 else "")]
    lines += [f"floor {w}: " + "; ".join(sorted(t for w2, t in ceilings if w2 == w)) for w in ("measured", "datasheet")
              if any(w2 == w for w2, _ in ceilings)]
    fig.suptitle("\n".join(lines), fontsize=9)
    _save(fig, path)
    return fig, drawn


# ----------------------------------------------------------------------------------------------- roofline

def plot_roofline(results: dict[str, dict], path: str | Path | None = None, title: str = "") -> tuple:
    """`experiments.roofline.roofline` results by label: per result, the HBM time (bytes / bandwidth) and the GEMM
    time (FLOPs / peak) stacked by component; the floor is the taller bar. One panel per phase.

    -> (figure, {(label, "memory" | "compute", component): Rectangle})."""
    if not results:
        raise ValueError("plot_roofline needs at least one roofline result")
    phases = [ph for ph in ("decode", "prefill") if any(r["phase"] == ph for r in results.values())]
    fig, axes = _figure(1, len(phases), figsize=(2.6 + 3.0 * len(results), 5.6), squeeze=False)
    drawn, used = {}, set()
    for ax, ph in zip(axes[0], phases):
        items = [(label, r) for label, r in results.items() if r["phase"] == ph]
        xt, xl = [], []
        for i, (label, res) in enumerate(items):
            for j, (which, key) in enumerate((("memory", "memory_s"), ("compute", "compute_s"))):
                x, bottom = 3 * i + j, 0.0
                for name, comp in res["components"].items():
                    ms = comp[key] * 1e3
                    if ms <= 0:
                        continue
                    drawn[(label, which, name)] = ax.bar(x, ms, 0.8, bottom=bottom, color=COLOURS.get(name, "#fff"),
                                                         edgecolor="#333333", linewidth=0.4)[0]
                    used.add(name)
                    bottom += ms
                bound = res["totals"]["bound"] == which
                ax.text(x, bottom, f"{bottom:.1f}" + ("\nfloor" if bound else ""), ha="center", va="bottom",
                        fontsize=8, fontweight="bold" if bound else None)
                xt.append(x)
                xl.append({"memory": "HBM", "compute": "GEMM"}[which])
            mesh = res["mesh"]
            per_device = res["batch"] / (mesh["dp"] * mesh["ep"])
            ax.text(3 * i + 0.5, -0.1, f"{res['config']}\n{res['weight_dtype']}, KV {res['kv_dtype']}\n"
                    f"{per_device:g} seq/device x {res['new_tokens']} rows\nat context {res['context']}\n"
                    f"mesh {mesh['dp']}x{mesh['ep']}x{mesh['tp']}", transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=8)
        ax.set_xticks(xt, xl, fontsize=8)
        ax.set_ylabel("ms per step, per device")
        ax.margins(y=0.12)
        ax.set_title(ph, fontsize=9)
    handles = [Patch(facecolor=COLOURS[n], edgecolor="#333333", linewidth=0.4, label=n) for n in ORDER if n in used]
    fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    first = next(iter(results.values()))
    fig.suptitle((title + "\n" if title else "") + "HBM time = bytes / bandwidth, GEMM time = FLOPs / peak, by "
                 f"component; the taller bar is the floor. Ceilings: {ceilings_text(first['ceilings'])}", fontsize=9)
    _save(fig, path)
    return fig, drawn


# ----------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("breakdown", "sweep"), help="breakdown: bench JSON records -> the step by "
                   "component against its floors; sweep: a sweep's JSON lines -> tokens/s per GPU and %% of the floor")
    p.add_argument("files", nargs="+", help="records (their ok records are drawn together)")
    p.add_argument("--out", help="PNG path (default: beside the first file)")
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    recs = [r for f in args.files for r in read_records(f)]
    if not recs:
        raise SystemExit(f"no records with status ok in {', '.join(args.files)}")
    out = Path(args.out or Path(args.files[0]).with_suffix(".png"))
    (plot_breakdown if args.what == "breakdown" else plot_sweep)(recs, out, title=Path(args.files[0]).name)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
