"""The markdown report of a roofline record (experiments/roofline.py): the per-component table, the floors and
the estimate, what each device sends, the expert placement, the replicated weights and the memory per device."""

from __future__ import annotations

from experiments.roofline_formats import uniform_mma


def _fmt_bytes(b):
    return f"{b / 1e9:.3f}"


def markdown(res: dict, accepted: float | None = None) -> str:
    t, mem = res["totals"], res["memory"]
    mesh = res["mesh"]
    head = (f"### Roofline: {res['config']} ({res['layers']} layers), {res['phase']}, batch {res['batch']} x "
            f"{res['new_tokens']} rows, context {res['context']}, weights {res['weight_dtype']}, KV "
            f"{res['kv_dtype']}, mesh dp{mesh['dp']}/ep{mesh['ep']}/tp{mesh['tp']}, "
            f"{'forced-balance' if res['forced_balance'] else 'uniform random'} routing"
            f"{', with drafter' if res['drafter'] else ''}\n\n"
            f"Per device. Ceilings: {_ceilings_line(res['ceilings'])}.\n\n")
    lines = ["| component | weights GB | KV read GB | KV write GB | other GB | total GB | TFLOP | memory ms | compute ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in res["components"].items():
        lines.append(f"| {name} | {_fmt_bytes(c['weight_bytes'])} | {_fmt_bytes(c['kv_read_bytes'])} | "
                     f"{_fmt_bytes(c['kv_write_bytes'])} | {_fmt_bytes(c['other_bytes'])} | {_fmt_bytes(c['bytes'])} | "
                     f"{c['flops'] / 1e12:.3f} | {c['memory_s'] * 1e3:.3f} | {c['compute_s'] * 1e3:.3f} |")
    lines.append(f"| **total** | {_fmt_bytes(t['weight_bytes'])} | {_fmt_bytes(t['kv_read_bytes'])} | "
                 f"{_fmt_bytes(t['kv_write_bytes'])} | {_fmt_bytes(t['other_bytes'])} | **{_fmt_bytes(t['bytes'])}** | "
                 f"**{t['flops'] / 1e12:.3f}** | **{t['memory_s'] * 1e3:.3f}** | **{t['compute_s'] * 1e3:.3f}** |")
    exp = res["components"].get("moe_experts", {}).get("parts", {}).get("routed", {})
    comm = res["communication"]
    tail = [
        "",
        f"**Floor {t['floor_s'] * 1e3:.3f} ms per step ({t['bound']}-bound, set by {t['floor_component']})**: "
        f"memory {t['memory_s'] * 1e3:.3f} ms, compute {t['compute_s'] * 1e3:.3f} ms, communication "
        f"{t['comm_s'] * 1e3:.3f} ms (all overlapped; {t['floor_serial_s'] * 1e3:.3f} ms with communication "
        f"serial); arithmetic intensity {t['arithmetic_intensity']:.0f} FLOP/B.",
    ]
    est = res.get("estimate")
    if est:
        ranked = sorted(est["by_group_s"].items(), key=lambda kv: -kv[1])
        tail.append(f"**Estimate {est['estimate_s'] * 1e3:.3f} ms** (this engine's efficiencies measured on the H200, "
                    f"terms added; dominated by {est['dominant']}): "
                    + ", ".join(f"{g} {sec * 1e3:.3f}" for g, sec in ranked) + ".")
    if comm["bytes"]:
        tail.append(f"Sent per device per step ({res['transport']}, dispatch {res['dispatch_dtype']}): "
                    f"{comm['bytes'] / 1e9:.3f} GB, {comm['nvlink_bytes'] / 1e9:.3f} GB over NVLink "
                    f"({comm['nvlink_s'] * 1e3:.3f} ms) and {comm['scaleout_bytes'] / 1e9:.3f} GB over the scale-out "
                    f"network ({comm['scaleout_s'] * 1e3:.3f} ms): " + ", ".join(
                        f"{k} {v / 1e9:.3f}" for k, v in comm["parts"].items()) + " GB.")
    for n_exp, pl in res["placement"].items():
        if pl["redundant"] or res["mesh"]["ep"] > 1:
            tail.append(f"Experts ({n_exp} per layer): {pl['slots']} slots, {pl['slots_per_device']} per device; "
                        f"imbalance {pl['imbalance']:.3f} ({pl['rule']}).")
    rep = res["replication"]
    if rep["replicas"] > 1:
        tail.append(f"Data-parallel attention: every device reads its own copy of "
                    f"{rep['dense_weight_bytes_per_device'] / 1e9:.2f} GB of non-expert weights ({rep['replicas']} "
                    f"copies, {100 * rep['share_of_step_bytes']:.0f}% of a device's bytes).")
    tail.append(f"Rows per device per step {t['rows_per_device']:g}: {t['rows_per_s_at_floor']:,.0f} rows/s at the "
                "floor.")
    if res["phase"] == "decode":
        acc = accepted if accepted is not None else (3.25 if res["new_tokens"] == 4 else float(res["new_tokens"]))
        seqs = t["rows_per_device"] / res["new_tokens"]
        tail.append(f"Decode at {acc:g} accepted tokens per step: {seqs * acc / t['floor_s']:,.0f} tokens/s per device "
                    f"(sequences x accepted / floor).")
    else:
        pk = uniform_mma(res["weight_dtype"])  # the format's MMA
        tail.append(f"All FLOPs at the {pk} peak: {t['flops_at_uniform_peak_s'] * 1e3:.3f} ms; MFU of a step at the floor "
                    f"{t['flops'] / t['floor_s'] / res['ceilings'][pk + '_flops'] * 100:.0f}% of the {pk} peak.")
    if exp:
        tail.append(f"Routed experts touched per device per layer: {exp.get('experts_touched_per_device', 0) / max(res['layers'], 1):.1f}.")
    tail.append(f"Memory per device: weights {mem['weights_bytes'] / 1e9:.1f} GB (drafter {mem['draft_weights_bytes'] / 1e9:.1f}"
                f"{'' if mem['draft_weights_included'] else ' not included'}) + "
                f"cache {mem['cache_bytes'] / 1e9:.1f} GB ({mem['cache_bytes_per_sequence'] / 1e6:.1f} MB/sequence at "
                f"{mem['cache_max_len']} positions) = {mem['total_bytes'] / 1e9:.1f} GB of "
                f"{mem['capacity_bytes'] / 1e9:.1f} GB: {'fits' if mem['fits'] else 'DOES NOT FIT'}.")
    tail.append(f"Parameters: {res['params']['backbone'] / 1e9:.2f} B backbone, {res['params']['active_per_token'] / 1e9:.2f} B "
                f"active per token (head included, embedding excluded).")
    for n in res["notes"]:
        tail.append(f"Note: {n}.")
    return head + "\n".join(lines + tail) + "\n"


def _ceilings_line(c: dict) -> str:
    fp4 = f" / fp4 {c['fp4_flops'] / 1e12:.0f}" if c.get("fp4_flops") else ""
    links = (f"; NVLink {c['nvlink_Bps'] / 1e9:.0f} GB/s per direction over {c['nvlink_domain']} GPUs, scale-out "
             f"{c['scaleout_Bps'] / 1e9:.0f} GB/s" if c.get("nvlink_Bps") else "")
    return (f"{c['name']}: HBM {c['hbm_Bps'] / 1e12:.2f} TB/s, bf16 {c['bf16_flops'] / 1e12:.0f} / fp8 "
            f"{c['fp8_flops'] / 1e12:.0f}{fp4} TFLOP/s{links}")
