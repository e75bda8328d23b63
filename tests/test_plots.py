"""experiments/plots.py: every picture rendered from committed records, the files checked, and what was drawn read
back from the matplotlib artists and compared with the records it came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.text import Text  # noqa: E402

from experiments import plots  # noqa: E402
from experiments.hardware import H200_DATASHEET  # noqa: E402
from experiments.roofline import roofline  # noqa: E402
from experiments.step_profile import from_kernel_names  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "experiments" / "results"
# committed H200 `--kernel-times` records (kernel names only: from before kernels were attributed through the program)
BF16_KERNELS = RESULTS / "bench_20261130-052033_gpu_h200_kernels.json"      # decode B256 + prefill B1, bf16
FP4_KERNELS = RESULTS / "bench_20261130-052134_gpu_h200_fp4_kernels.json"   # decode B256, FP4 experts
EP2_KERNELS = RESULTS / "bench_20261130-232518_gpu_h200x2_ep2_kernels.json"  # the same on mesh 1x2x1 (two H200s)


def as_cpu_run(rec: dict) -> dict:
    """The record as if it had run on the CPU (the H200 ceilings then do not apply)."""
    return {**rec, "env": {**rec["env"], "backend": "cpu", "device": "cpu"}}


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 20_000, (path, len(data))


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.findobj(Text))


def _hline_y(lines) -> float:
    (start, end), = lines.get_segments()
    return float(start[1])


def _vline_x(lines) -> float:
    (start, end), = lines.get_segments()
    return float(start[0])


def test_breakdown_of_a_record_with_kernel_names_only(tmp_path):
    recs = plots.read_records(BF16_KERNELS)
    fig, drawn = plots.plot_breakdown(recs, tmp_path / "bd.png", title=BF16_KERNELS.name)
    _png(tmp_path / "bd.png")
    assert "attribution: kernel names only" in fig.get_suptitle()
    for i, rec in enumerate(recs):
        wall = rec["step_ms"]["median"]
        prof = from_kernel_names(rec["kernels"], wall)
        # the step: our kernels by component, "other" by kind, the rest of the wall time as the gap
        step = {seg: r.get_height() for (j, which, seg), r in drawn["stack"].items() if (j, which) == (i, "step")}
        for comp in ("moe_experts", "attn_core", "indexer"):
            assert step[comp] == pytest.approx(prof["components"][comp]["ms"])
        assert step["other: GEMM"] == pytest.approx(prof["components"]["other"]["by_kind"]["gemm"])
        assert sum(step.values()) == pytest.approx(wall, rel=1e-6)
        assert step["host / launch gap"] == pytest.approx(wall - rec["kernels"]["kernel_ms_per_step"], abs=0.05)
        # bars sit on each other in stacking order
        rects = [r for (j, which, _), r in drawn["stack"].items() if (j, which) == (i, "step")]
        assert [r.get_y() for r in rects[1:]] == pytest.approx([r.get_y() + r.get_height() for r in rects[:-1]])
        # floors: the record's at its measured ceilings, the datasheet's recomputed by experiments/roofline.py
        measured = {seg: r.get_height() for (j, which, seg), r in drawn["stack"].items() if (j, which) == (i, "measured")}
        assert measured == pytest.approx({k: v for k, v in rec["roofline"]["by_component_ms"].items() if v > 0})
        assert _hline_y(drawn["floor_line"][(i, "measured")]) == pytest.approx(rec["roofline"]["floor_ms"])
        sheet = plots.roofline_of_record(rec, H200_DATASHEET)
        assert _hline_y(drawn["floor_line"][(i, "datasheet")]) == pytest.approx(sheet["totals"]["floor_s"] * 1e3)
        ds = {seg: r.get_height() for (j, which, seg), r in drawn["stack"].items() if (j, which) == (i, "datasheet")}
        assert ds == pytest.approx({k: c["floor_s"] * 1e3 for k, c in sheet["components"].items() if c["floor_s"] > 0})
        # the component panel: the same times as bars, each named component's floors as ticks; "other"'s floor is
        # the floors of the components whose kernels the names cannot tell
        assert drawn["component"][(i, "moe_experts", "moe_experts")].get_width() == pytest.approx(
            prof["components"]["moe_experts"]["ms"])
        floors = rec["roofline"]["by_component_ms"]
        assert _vline_x(drawn["floor_tick"][(i, "measured", "moe_experts")]) == pytest.approx(floors["moe_experts"])
        unnamed = sum(v for k, v in floors.items() if k not in ("moe_experts", "attn_core", "indexer"))
        assert _vline_x(drawn["floor_tick"][(i, "measured", "other")]) == pytest.approx(unnamed)
    # the recorded ceilings are named, and the datasheet's are said to be recomputed
    title = fig.get_suptitle()
    assert "HBM 3.4 TB/s" in title and "HBM 4.8 TB/s" in title and "recomputed" in title


def test_breakdown_of_a_mesh_is_per_device(tmp_path):
    (rec,) = plots.read_records(EP2_KERNELS)
    assert rec["devices"] == 2 and rec["kernels"]["kernel_ms_per_step"] > rec["step_ms"]["median"]
    fig, drawn = plots.plot_breakdown([rec], tmp_path / "ep2.png")
    _png(tmp_path / "ep2.png")
    step = {seg: r.get_height() for (_, which, seg), r in drawn["stack"].items() if which == "step"}
    prof = from_kernel_names(rec["kernels"], rec["step_ms"]["median"])
    assert step["moe_experts"] == pytest.approx(prof["components"]["moe_experts"]["ms"] / 2)
    assert step["host / launch gap"] == pytest.approx(
        rec["step_ms"]["median"] - rec["kernels"]["kernel_ms_per_step"] / 2, abs=0.05)
    assert "per device" in fig.get_suptitle()


def test_breakdown_of_an_attributed_record_uses_its_own_floors(tmp_path):
    """The shape --kernel-times records now: `profile` by component and the datasheet floor in the record."""
    (rec,) = [r for r in plots.read_records(BF16_KERNELS) if r["phase"] == "decode"]
    profile = {"steps": 3, "wall_ms": 25.0, "kernel_ms_per_step": 22.0, "gap_ms": 3.0, "attribution": "program op names",
               "components": {"moe_experts": {"ms": 12.0, "by_kind": {"pallas": 11.5, "transpose": 0.5}},
                              "head": {"ms": 4.0, "by_kind": {"gemm": 4.0}},
                              "attn_proj": {"ms": 5.0, "by_kind": {"gemm": 4.0, "convert": 1.0}},
                              "other": {"ms": 1.0, "by_kind": {"concatenate": 1.0}}},
               "kinds": {}, "top": []}
    datasheet = {"floor_ms": 11.0, "ceilings": H200_DATASHEET,
                 "by_component_ms": {"moe_experts": 9.0, "head": 1.0, "attn_proj": 1.0}}
    rec = {**rec, "step_ms": {**rec["step_ms"], "median": 25.0}, "profile": profile,
           "roofline": {**rec["roofline"], "datasheet": datasheet}}
    del rec["kernels"]
    fig, drawn = plots.plot_breakdown([rec], tmp_path / "new.png")
    _png(tmp_path / "new.png")
    step = {seg: r.get_height() for (_, which, seg), r in drawn["stack"].items() if which == "step"}
    assert step == pytest.approx({"moe_experts": 12.0, "head": 4.0, "attn_proj": 5.0, "other: XLA glue": 1.0,
                                  "host / launch gap": 3.0})
    sheet = {seg: r.get_height() for (_, which, seg), r in drawn["stack"].items() if which == "datasheet"}
    assert sheet == pytest.approx(datasheet["by_component_ms"])
    assert _hline_y(drawn["floor_line"][(0, "datasheet")]) == pytest.approx(11.0)
    assert _vline_x(drawn["floor_tick"][(0, "measured", "head")]) == pytest.approx(rec["roofline"]["by_component_ms"]["head"])
    title = fig.get_suptitle()
    assert "attribution: program op names" in title and "recomputed" not in title


def test_breakdown_of_a_cpu_run_draws_no_h200_floor(tmp_path):
    recs = [as_cpu_run(r) for r in plots.read_records(BF16_KERNELS)]
    fig, drawn = plots.plot_breakdown(recs, tmp_path / "cpu.png")
    _png(tmp_path / "cpu.png")
    assert {which for (_, which, _) in drawn["stack"]} == {"step"} and not drawn["floor_line"]
    assert not drawn["floor_tick"]
    assert "H200 ceilings\ndo not apply" in _texts(fig)


def test_sweep_tokens_per_gpu_and_floor_fraction(tmp_path):
    """Decode B256 on one and two H200s, bf16 and FP4 experts: the mesh is the x axis, a line per weight format."""
    recs = [r for f in (BF16_KERNELS, FP4_KERNELS, EP2_KERNELS) for r in plots.read_records(f)]
    fig, lines = plots.plot_sweep(recs, tmp_path / "sweep.png", title="kernel records")
    _png(tmp_path / "sweep.png")
    decode = [r for r in recs if r["phase"] == "decode"]
    assert plots.sweep_axes(decode) == ["mesh", "weights"]
    meshes = ["1x1x1", "1x2x1"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == meshes
    for label in ("bf16", "bf16 + fp4 experts"):
        pts = sorted((r for r in decode if plots.weights_text(r) == label), key=lambda r: plots._mesh(r))
        line = lines[("decode", "tokens", label)]
        assert list(line.get_xdata()) == [meshes.index(plots._mesh(r)) for r in pts]
        assert list(line.get_ydata()) == pytest.approx([r["tokens_per_s_per_device"] for r in pts])
        assert list(lines[("decode", "measured", label)].get_ydata()) == pytest.approx(
            [100 * r["roofline_fraction"] for r in pts])
        sheet = [100 * plots.roofline_of_record(r, H200_DATASHEET)["totals"]["floor_s"] * 1e3 / r["step_ms"]["median"]
                 for r in pts]
        assert list(lines[("decode", "datasheet", label)].get_ydata()) == pytest.approx(sheet)
    assert len(lines[("decode", "tokens", "bf16 + fp4 experts")].get_xdata()) == 2
    # the one prefill record: its own column
    (pre,) = [r for r in recs if r["phase"] == "prefill"]
    assert list(lines[("prefill", "tokens", "bf16")].get_ydata()) == pytest.approx([pre["tokens_per_s_per_device"]])
    title = fig.get_suptitle()
    assert "NVIDIA H200" in title and "HBM 3.4 TB/s" in title and "HBM 4.8 TB/s" in title


def test_sweep_of_a_cpu_run_says_the_ceiling_does_not_apply(tmp_path):
    recs = [as_cpu_run(r) for f in (BF16_KERNELS, FP4_KERNELS) for r in plots.read_records(f)]
    fig, lines = plots.plot_sweep(recs, tmp_path / "cpu_sweep.png")
    _png(tmp_path / "cpu_sweep.png")
    assert {kind for _, kind, _ in lines} == {"tokens"}, "no % of the floor against H200 ceilings"
    assert "the H200 ceilings do not apply" in _texts(fig)
    assert "tokens/s per device" in _texts(fig)


def test_roofline_by_component_of_the_real_models(tmp_path):
    from model import ModelConfig

    results = {p: roofline(ModelConfig.preset(p), "decode", 64, 131072, 4, "fp4-experts", "fp8")
               for p in ("v4-flash", "v41-flash")}
    fig, bars = plots.plot_roofline(results, tmp_path / "roof.png")
    _png(tmp_path / "roof.png")
    for label, res in results.items():
        for which in ("memory", "compute"):
            got = {comp: r.get_height() for (lab, w, comp), r in bars.items() if (lab, w) == (label, which)}
            assert got == pytest.approx({k: c[f"{which}_s"] * 1e3 for k, c in res["components"].items()
                                         if c[f"{which}_s"] > 0})


def test_cli_writes_the_png_beside_the_records(tmp_path):
    src = tmp_path / EP2_KERNELS.name
    src.write_text(EP2_KERNELS.read_text())
    assert plots.main(["breakdown", str(src)]) == src.with_suffix(".png")
    _png(src.with_suffix(".png"))
    with pytest.raises(SystemExit, match="no records with status ok"):
        empty = tmp_path / "empty.json"
        empty.write_text(json.dumps([{"status": "refused"}]))
        plots.main(["breakdown", str(empty)])
