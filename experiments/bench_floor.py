"""What a bench point's record says against the roofline: the floor of its step per device (experiments/roofline.py,
at the best measured and the datasheet ceilings), the fraction achieved, and its throughput; the roofline weight
format of a model; the tokens a benchmark-mode step counts (DeepInfer's 3.25 accepted per verify of 3 drafts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from experiments.bench import Point

DEEPINFER_ACCEPTED = 3.25


def weight_format(cfg) -> str:
    """The roofline's weight format of a model (float32 models are costed as bf16, noted): the bytes it holds,
    and bf16 MMA (the engine dequantises FP8 / FP4 weights to bf16 before multiplying)."""
    return {("model", "dense"): "bf16", ("model", "fp4"): "bf16-fp4-experts", ("fp8", "dense"): "fp8-dense",
            ("fp8", "fp4"): "fp8-fp4-experts"}[cfg.dense_weights, cfg.expert_weights]


def roofline_of(cfg, dtype: str, p: Point, rec: dict) -> tuple[dict, float, dict]:
    """Roofline of the step (per device), achieved fraction = floor / median, and throughput figures."""
    from .hardware import H200_DATASHEET
    from .roofline import roofline
    from .roofline_formats import uniform_mma

    def floors(ceilings=None):
        return roofline(cfg, p.phase, p.batch, p.context, p.rows, weight_format(cfg), "bf16", p.mesh,
                        forced_balance=p.mode == "deepinfer", drafter=p.kind == "spec", ceilings=ceilings)

    res, sheet = floors(), floors(H200_DATASHEET)
    t = res["totals"]
    med_s = rec["step_ms"]["median"] / 1e3
    ndev = int(np.prod(p.mesh))
    line = {"floor_ms": t["floor_s"] * 1e3, "memory_ms": t["memory_s"] * 1e3, "compute_ms": t["compute_s"] * 1e3,
            "bound": t["bound"], "bytes_per_device": t["bytes"], "flops_per_device": t["flops"],
            "weight_bytes": t["weight_bytes"], "kv_read_bytes": t["kv_read_bytes"],
            "weight_format": res["weight_dtype"], "kv_format": res["kv_dtype"],
            "forced_balance": res["forced_balance"], "drafter": res["drafter"],
            "ceilings": {k: v for k, v in res["ceilings"].items()},
            "by_component_ms": {k: round(c["floor_s"] * 1e3, 4) for k, c in res["components"].items()},
            "datasheet": {"floor_ms": sheet["totals"]["floor_s"] * 1e3,
                          "fraction": sheet["totals"]["floor_s"] / med_s,
                          "ceilings": dict(sheet["ceilings"]),
                          "by_component_ms": {k: round(c["floor_s"] * 1e3, 4)
                                              for k, c in sheet["components"].items()}}}
    frac = t["floor_s"] / med_s
    extra: dict[str, Any] = {"achieved_TBps": t["bytes"] / med_s / 1e12,
                             "achieved_TFLOPps": t["flops"] / med_s / 1e12}
    peak = res["ceilings"][uniform_mma(res["weight_dtype"]) + "_flops"]
    if p.phase == "prefill":
        tok = p.batch * p.new_tokens
        extra.update(tokens_per_step=tok, tokens_per_s=tok / med_s, tokens_per_s_per_device=tok / med_s / ndev,
                     mfu=t["flops"] / med_s / peak)
    elif p.mode == "deepinfer":
        tok = p.batch * DEEPINFER_ACCEPTED if p.num_draft == 3 else p.batch * (1 + 0.75 * p.num_draft)
        extra.update(accepted_per_step_assumed=tok / p.batch, tokens_per_step=tok, tokens_per_s=tok / med_s,
                     tokens_per_s_per_device=tok / med_s / ndev)
    else:
        acc = rec.get("acceptance", {}).get("mean_accepted_length")
        if acc is None:  # realistic verify-only step: count only the target's own token
            acc = 1.0
        tok = p.batch * acc
        extra.update(accepted_per_step_measured=acc, tokens_per_step=tok, tokens_per_s=tok / med_s,
                     tokens_per_s_per_device=tok / med_s / ndev)
    return line, frac, extra
