"""A calibrated estimate beside the floor: each group of kernels' efficiency on our H200 (its floor / the time its
kernels took in a committed `bench.py --kernel-times` record), applied to the floors of a step on any hardware.

    cal = calibrate("decode", "fp4")          # CALIBRATION's records for decode steps with FP4 experts
    est = estimate(res, cal)                  # res = roofline.roofline(...) on the target hardware

Groups. A record's kernels are attributed to the model's components by experiments/step_profile.py. Records
that hold only kernel names (`kernels.top`, what --kernel-times wrote before its program attribution) go
through `step_profile.from_kernel_names`, which names our Pallas kernels and sees library / XLA GEMMs only as
"gemm", so the groups of the floor's parts are:

  moe_experts      the routed experts (component moe_experts; our grouped-GEMM kernels)
  attn_core        the attention core (our sparse attention kernels)
  indexer_scores   the indexer's scores (part indexer.scores; our indexer kernel)
  gemm             every other matrix product: projections, shared expert, router gate, head, compressor and
                   indexer projections, Engram wkv, mHC coefficients (library and XLA GEMMs)
  rest             the parts no kernel of its own computes: KV writes, compressor pooling, norms, mHC mixing,
                   table rows (inside XLA's fusions)

Records with `profile.components` (attributed by the compiled program's op names) time every component: there
each component is its own group ("embed" counts as "head") and "other" is the unattributed time.

The unattributed time (XLA's own non-GEMM kernels: converts, transposes, concatenates, sorts, reductions; our
router / dispatch kernels; kernels a truncated list left out) is spread over the groups in proportion to their
floors: every group pays the same overhead per unit of floor. Kernel times of a record on several devices are
the sum over its devices (CUPTI sees every device of the process) and are divided by their number. The host /
launch gap (wall clock minus the kernels per device) is charged per layer pass, independent of the hardware.

Efficiency of a group = sum of its floors (on the H200 as measured) / sum of its times over the calibration
records. Records on a mesh (MESH_RECORDS) then calibrate what a single device cannot show, against the groups of
their own phase and format:
  comm     the collectives (NCCL kernels) against roofline_mesh's bytes at the H200's NVLink bandwidth;
  foreign  the rest of the step's time beyond the groups, the collectives and the gap, per (row, choice) of
           other devices that the gather / replicate transports hand every device's expert kernels, as HBM
           byte-equivalents (seconds x the H200's HBM bandwidth) so that it scales with the target's HBM.

Estimate of a step = sum over groups of its floor on the target / efficiency + communication floor / comm
efficiency + foreign (row, choice) pairs x their cost + gap per layer pass x passes: the terms add up (this
engine does not overlap its collectives with its kernels).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from experiments import roofline_mesh
from experiments.hardware import H200_MEASURED

RESULTS = Path(__file__).resolve().parent / "results"
# (phase, routed experts' format) -> single-device records (file under experiments/results, index in its list)
CALIBRATION = {
    ("decode", "fp4"): (("bench_20261130-052134_gpu_h200_fp4_kernels.json", 0),),
    ("decode", "bf16"): (("bench_20261130-052033_gpu_h200_kernels.json", 0),),
    ("prefill", "bf16"): (("bench_20261130-052033_gpu_h200_kernels.json", 1),),
}
# records on a mesh: the collectives and the gather transport's foreign rows (EP=2, gather, decode, FP4 experts)
MESH_RECORDS = (("bench_20261130-232518_gpu_h200x2_ep2_kernels.json", 0),)


def load_record(name: str, index: int) -> dict:
    """Record `index` of experiments/results/<name> (a list of bench records)."""
    recs = json.loads((RESULTS / name).read_text())
    recs = recs if isinstance(recs, list) else [recs]
    if index >= len(recs):
        raise ValueError(f"{name} holds {len(recs)} records, no record {index}")
    return recs[index]


def expert_format(rec: dict) -> str:
    """"fp4" | "bf16": how a bench record's model holds its routed experts."""
    return "fp4" if rec.get("expert_weights") == "fp4" else "bf16"


def record_roofline(rec: dict, ceilings: dict | None = None) -> dict:
    """The floor of a bench record's step (the configuration bench.py ran, its routed rows moved the way this
    engine moved them) on `ceilings` (default the H200 as measured)."""
    from experiments.bench import resolve_config
    from experiments.bench_floor import weight_format
    from experiments.roofline import roofline

    cfg = resolve_config(rec["preset"], rec.get("layers"), expert_weights=rec.get("expert_weights"),
                         dense_weights=rec.get("dense_weights"), engram_vocab=rec.get("engram_vocab_size"),
                         head_dtype=rec.get("head_dtype"), index_key_format=rec.get("index_key_format"))
    mesh = tuple(int(rec["mesh"][a]) for a in ("dp", "ep", "tp"))
    rows = rec["batch"] * rec["new_tokens"] / (mesh[0] * mesh[1])
    return roofline(cfg, rec["phase"], rec["batch"], rec["context"], rec["new_tokens"], weight_format(cfg), "bf16",
                    mesh, forced_balance=rec["mode"] == "deepinfer", ceilings=ceilings or H200_MEASURED,
                    drafter=rec.get("step") == "spec", transport=roofline_mesh.engine_transport(rows))


def group_of(component: str, part: str, rec: dict, by_component: bool) -> str:
    """The calibration group of a floor's part (drafter parts by the component they name)."""
    if component == "drafter":
        component, part = part.split(".", 1)
    if by_component or component in ("moe_experts", "attn_core"):
        return component
    if component == "indexer" and part == "scores":
        return "indexer_scores"
    return "gemm" if rec.get("gemm_flops", 0.0) > 0 else "rest"


def group_floors(res: dict, by_component: bool) -> dict[str, float]:
    """Floor seconds of a roofline result by group: each part at max(bytes / HBM, its compute time)."""
    hbm = res["ceilings"]["hbm_Bps"]
    out: dict[str, float] = {}
    for name, comp in res["components"].items():
        for part, rec in comp["parts"].items():
            g = group_of(name, part, rec, by_component)
            out[g] = out.get(g, 0.0) + max(rec["bytes"] / hbm, rec["compute_s"])
    return out


def _is_collective(kernel: str) -> bool:
    return "nccl" in kernel.lower()


def measured(rec: dict) -> dict:
    """A record's kernel time per device and step, seconds: {"groups": {group: s}, "unattributed", "comm", "gap",
    "by_component"}."""
    from experiments.step_profile import from_kernel_names

    ndev = int(rec["mesh"]["dp"]) * int(rec["mesh"]["ep"]) * int(rec["mesh"]["tp"])
    wall_ms = rec["step_ms"]["median"]
    prof = rec.get("profile") or {}
    if "components" in prof:
        def group(component):
            return "head" if component == "embed" else component

        groups_ms: dict[str, float] = {}
        for c, v in prof["components"].items():
            groups_ms[group(c)] = groups_ms.get(group(c), 0.0) + v["ms"]
        comm_ms = 0.0
        for name, component, _, ms, *_ in prof.get("top", []):   # collectives out of the component that traced them
            if _is_collective(name):
                comm_ms += ms
                groups_ms[group(component)] -= ms
        kernel_ms = prof["kernel_ms_per_step"]
        other = groups_ms.pop("other", 0.0)
        by_component = True
    elif "kernels" in rec:
        kern = rec["kernels"]
        comm_ms = sum(r[1] for r in kern["top"] if _is_collective(r[0]))
        comps = from_kernel_names({**kern, "top": [r for r in kern["top"] if not _is_collective(r[0])]},
                                  wall_ms)["components"]
        groups_ms = {"moe_experts": comps.get("moe_experts", {}).get("ms", 0.0),
                     "attn_core": comps.get("attn_core", {}).get("ms", 0.0),
                     "indexer_scores": comps.get("indexer", {}).get("ms", 0.0),
                     "gemm": sum(c["by_kind"].get("gemm", 0.0) for c in comps.values())}
        kernel_ms = kern.get("kernel_ms_per_step", sum(r[1] for r in kern["top"]))
        other = kernel_ms - comm_ms - sum(groups_ms.values())
        by_component = False
    else:
        raise ValueError(f"record {rec.get('key', '?')} has no kernel times (bench.py --kernel-times)")
    return {"groups": {g: ms / 1e3 / ndev for g, ms in groups_ms.items()}, "unattributed": other / 1e3 / ndev,
            "comm": comm_ms / 1e3 / ndev, "gap": (wall_ms - kernel_ms / ndev) / 1e3, "by_component": by_component}


@functools.lru_cache(maxsize=None)
def _kernel_calibration(records: tuple) -> dict:
    """Group efficiencies and the gap per layer pass from single-device records."""
    floors: dict[str, float] = {}
    times: dict[str, float] = {}
    gap = passes = 0.0
    kinds = set()
    used = []
    for name, index in records:
        rec = load_record(name, index)
        m = measured(rec)
        kinds.add(m["by_component"])
        res = record_roofline(rec)
        fl = group_floors(res, m["by_component"])
        total = sum(fl.values())
        for g, f in fl.items():   # its kernels + its share of the unattributed time
            floors[g] = floors.get(g, 0.0) + f
            times[g] = times.get(g, 0.0) + m["groups"].get(g, 0.0) + m["unattributed"] * f / total
        gap += m["gap"]
        passes += res["totals"]["layers_run"]
        used.append({"record": name, "index": index, "phase": rec["phase"], "step_ms": rec["step_ms"]["median"],
                     "floor_ms": res["totals"]["floor_s"] * 1e3, "measured_s": m, "floor_by_group_s": fl})
    if len(kinds) > 1:
        raise ValueError("calibration records mix kernel-name and program-op-name attributions")
    return {"groups": {g: floors[g] / times[g] for g in floors}, "gap_per_layer_s": gap / passes,
            "by_component": kinds.pop(), "records": used}


def _group_time(res: dict, kernels: dict) -> dict[str, float]:
    """Seconds of each group of a roofline result at the calibrated efficiencies."""
    out = {}
    for g, f in group_floors(res, kernels["by_component"]).items():
        if g not in kernels["groups"]:
            raise ValueError(f"the calibration has no efficiency for {g!r} (records: "
                             f"{[r['record'] for r in kernels['records']]})")
        out[g] = f / kernels["groups"][g]
    return out


@functools.lru_cache(maxsize=None)
def _mesh_calibration(records: tuple) -> dict:
    """The collectives' efficiency and the foreign rows' cost from mesh records."""
    floor = time = foreign_s = foreign = 0.0
    used = []
    for name, index in records:
        rec = load_record(name, index)
        key = (rec["phase"], expert_format(rec))
        if key not in CALIBRATION:
            raise ValueError(f"mesh record {name} #{index}: no single-device calibration for {key}")
        kernels = _kernel_calibration(CALIBRATION[key])
        m = measured(rec)
        res = record_roofline(rec)
        comm_floor = res["communication"]["comm_s"]
        if comm_floor and m["comm"]:
            floor, time = floor + comm_floor, time + m["comm"]
        modelled = sum(_group_time(res, kernels).values()) + m["comm"] + kernels["gap_per_layer_s"] * res[
            "totals"]["layers_run"]
        rows = res["communication"]["foreign_row_choices"]
        if rows:
            foreign_s += rec["step_ms"]["median"] / 1e3 - modelled
            foreign += rows
        used.append({"record": name, "index": index, "step_ms": rec["step_ms"]["median"],
                     "comm_floor_s": comm_floor, "comm_s": m["comm"], "foreign_row_choices": rows,
                     "modelled_s": modelled})
    return {"comm": floor / time if time else None,
            "foreign_byte_equivalent": foreign_s * H200_MEASURED["hbm_Bps"] / foreign if foreign else None,
            "records": used}


def calibrate(phase: str, expert_fmt: str, records: tuple | None = None,
              mesh_records: tuple = MESH_RECORDS) -> dict:
    """Efficiencies for steps of `phase` with `expert_fmt` ("fp4" | "bf16") routed experts: {"groups":
    {group: efficiency}, "gap_per_layer_s", "comm", "foreign_byte_equivalent", "by_component", "records"}.

    records: single-device ((file, index), ...), default CALIBRATION[(phase, expert_fmt)]; mesh_records: the
    records on a mesh for the collectives and the foreign rows."""
    if records is None:
        if (phase, expert_fmt) not in CALIBRATION:
            raise ValueError(f"no calibration record for {phase} steps with {expert_fmt} experts; "
                             f"calibrated: {sorted(CALIBRATION)}")
        records = CALIBRATION[(phase, expert_fmt)]
    kernels = _kernel_calibration(tuple(records))
    for r in kernels["records"]:
        if r["phase"] != phase:
            raise ValueError(f"{r['record']} #{r['index']} is a {r['phase']} record, not {phase}")
    mesh = _mesh_calibration(tuple(mesh_records))
    return {"phase": phase, "expert_format": expert_fmt, "groups": kernels["groups"],
            "gap_per_layer_s": kernels["gap_per_layer_s"], "by_component": kernels["by_component"],
            "comm": mesh["comm"], "foreign_byte_equivalent": mesh["foreign_byte_equivalent"],
            "records": kernels["records"], "mesh_records": mesh["records"]}


def estimate(res: dict, cal: dict) -> dict:
    """The calibrated estimate of a roofline result on its own hardware: {"estimate_s", "by_group_s", "dominant"}."""
    by_group = _group_time(res, cal)
    comm = res["communication"]
    if comm["comm_s"]:
        if cal["comm"] is None:
            raise ValueError("the step communicates but no calibration record timed collectives")
        by_group["comm"] = comm["comm_s"] / cal["comm"]
    if comm["foreign_row_choices"]:
        if cal["foreign_byte_equivalent"] is None:
            raise ValueError("the step's transport hands devices other devices' rows, which no record calibrates")
        by_group["foreign_rows"] = comm["foreign_row_choices"] * cal["foreign_byte_equivalent"] / res["ceilings"][
            "hbm_Bps"]
    by_group["gap"] = cal["gap_per_layer_s"] * res["totals"]["layers_run"]
    return {"estimate_s": sum(by_group.values()), "by_group_s": by_group, "dominant": max(by_group, key=by_group.get)}


def check(phase: str, expert_fmt: str, records: list[tuple[str, int]]) -> list[dict]:
    """The estimate against bench records' measured step times (on the H200s they ran on)."""
    cal = calibrate(phase, expert_fmt)
    used = {(r["record"], r["index"]) for r in cal["records"] + cal["mesh_records"]}
    out = []
    for name, index in records:
        rec = load_record(name, index)
        est = estimate(record_roofline(rec), cal)["estimate_s"] * 1e3
        out.append({"record": name, "index": index, "calibrated_on": (name, index) in used,
                    "step_ms": rec["step_ms"]["median"], "estimate_ms": est,
                    "error": est / rec["step_ms"]["median"] - 1})
    return out


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Print a calibration and check its estimate against bench records.")
    p.add_argument("--phase", default="decode")
    p.add_argument("--experts", default="fp4", help="routed experts' format of the calibration (fp4 | bf16)")
    p.add_argument("records", nargs="*", metavar="FILE#INDEX", help="bench records under experiments/results")
    args = p.parse_args(argv)
    cal = calibrate(args.phase, args.experts)
    print("efficiency by group:", ", ".join(f"{g} {e:.3f}" for g, e in sorted(cal["groups"].items())))
    print(f"collectives {cal['comm']:.3f}; host / launch gap {cal['gap_per_layer_s'] * 1e3:.3f} ms per layer pass; "
          f"foreign (row, choice) {cal['foreign_byte_equivalent'] / 1e6:.2f} MB-equivalent of HBM traffic")
    print("calibrated on:", ", ".join(f"{r['record']}#{r['index']}" for r in cal["records"] + cal["mesh_records"]))
    print("| record | calibrated on | measured ms | estimate ms | error |\n|---|---|---:|---:|---:|")
    for r in check(args.phase, args.experts, [(f.split("#")[0], int(f.split("#")[1])) for f in args.records]):
        print(f"| {r['record']}#{r['index']} | {'yes' if r['calibrated_on'] else 'no'} | {r['step_ms']:.2f} | "
              f"{r['estimate_ms']:.2f} | {100 * r['error']:+.1f}% |")


if __name__ == "__main__":
    main()
