"""The peer: HF transformers' `DeepseekV4ForCausalLM` (PyTorch eager) on the same device and workload
shapes as experiments/bench.py, so the ratio to the peer is measured in the same run
(BENCHMARKS.md section 2).

    python -m experiments.peer_hf --quick                                         # CPU smoke run (tiny-v4)
    python -m experiments.peer_hf --preset v4-flash --layers 2 --phase prefill --batch 1 --new-tokens 4096
    python -m experiments.peer_hf --preset v4-flash --layers 2 --phase decode --batch 8,64 --context 1024 \\
        --rows 1,4 --ours experiments/results/bench_<stamp>_gpu.json

The model: the jaxinfer config (`--preset`, `--layers` as in bench.py) written as an HF config
(`ModelConfig.to_hf_dict`), made by transformers directly on the device, in bf16 on a GPU (float32 on
CPU), eval mode, no gradients, then given random weights that route tokens over many experts
(`randomize_`), as bench.py's random models do.

Phases (every step does the same work; inputs are random token ids):
  prefill  a fresh cache, `batch` sequences of `--new-tokens` tokens in one forward (use_cache=True).
           `--context` > 0 first prefills that many positions and times the chunk after them.
  decode   a cache holding `--context` positions per sequence (filled by an untimed prefill), then one
           forward of `--rows` new tokens per sequence (1: plain decoding; 1 + num_draft: a verify step).
           Each timed step starts from a copy of the filled cache (the copy is not timed).

Timing: `--warmup` untimed steps, then `--repeats` timed ones, each closed by a device synchronise; medians
and p10/p90. Each record carries experiments/roofline.py's floor of the same step (bf16 weights, uniform
routing, one device) and the achieved fraction; `--ours` takes bench.py records and adds the speed-up of
ours over the peer for every matching (phase, batch, context, rows, layers) point. Output: JSON + markdown under
experiments/results/peer_hf_<stamp>_<device>.{json,md} (and $OUT when set).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

from experiments import records as records_io
from experiments.bench import summary_ms
from experiments.bench_cli import int_list


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="ModelConfig preset (default v4-flash-4l on GPU, tiny-v4 on CPU)")
    p.add_argument("--layers", type=int, help="scale to N backbone layers keeping the layer pattern")
    p.add_argument("--phase", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--batch", type=int_list, default=[1], help="sequences per step (comma list)")
    p.add_argument("--context", type=int_list, default=[0], help="cached positions before the step (comma list)")
    p.add_argument("--new-tokens", type=int, default=4096, help="prefill rows per sequence")
    p.add_argument("--rows", type=int_list, default=[1], help="decode rows per sequence (1, or 1 + drafts)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours", help="bench.py JSON records to compare with (same shapes)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-v4, small shapes, 1 warm-up, 3 repeats")
    p.add_argument("--out", help="results directory (default experiments/results; $OUT also gets a copy)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the peer model

def hf_model(cfg, device, dtype, seed: int = 0):
    """transformers' DeepseekV4ForCausalLM of `cfg` (a V4 ModelConfig) with random weights on `device`."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    hf_cfg = DeepseekV4Config(**cfg.to_hf_dict())
    hf_cfg.num_nextn_predict_layers = 0  # the peer has no drafter: time the backbone only
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in `dtype` (no float32 copy of a 14B-parameter model)
    try:
        with torch.device(device):
            model = DeepseekV4ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    model = model.to(dtype).eval()
    randomize_(model, seed)
    return model


def randomize_(model, seed: int) -> None:
    """Give the peer weights that route like a trained model's, on its device: transformers' init leaves
    the hash layers' token -> expert table and the router degenerate (every token to the same experts,
    so a decode step would read a few experts' weights instead of the hundreds real routing touches).
    Matrices ~ N(0, 1/fan_in), router bias ~ 0.3 N(0, 1), `tid2eid` rows = distinct random experts."""
    import torch

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        for name in sorted(tensors):
            t = tensors[name]
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                scores = torch.rand(t.shape[0], model.config.n_routed_experts, generator=g, device=t.device)
                t.copy_(torch.argsort(scores, dim=-1)[:, :t.shape[1]].to(t.dtype))
            elif leaf == "e_score_correction_bias":
                t.normal_(0.0, 0.3, generator=g)
            elif t.is_floating_point() and t.dim() >= 2 and "rotary" not in name:
                t.normal_(0.0, t.shape[-1] ** -0.5, generator=g)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_point(model, phase: str, batch: int, context: int, rows: int, vocab: int, warmup: int, repeats: int,
               seed: int) -> dict:
    """Median step time of one (phase, batch, context, rows) point; rows = new tokens per sequence."""
    import torch

    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (batch, n), generator=g).to(device)  # noqa: E731
    with torch.inference_mode():
        base = None
        if context:
            base = model(input_ids=ids(context), use_cache=True).past_key_values
        step_ids = ids(rows)
        times = []
        for i in range(warmup + repeats):
            cache = copy.deepcopy(base) if base is not None else None
            _sync(device)
            t0 = time.perf_counter()
            model(input_ids=step_ids, past_key_values=cache, use_cache=True)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    ms = summary_ms(times)
    return {"phase": phase, "batch": batch, "context": context, "rows": rows, "median_s": ms["median"] / 1e3,
            "p10_s": ms["p10"] / 1e3, "p90_s": ms["p90"] / 1e3, "repeats": repeats, "warmup": warmup,
            "tokens_per_s": batch * rows * 1e3 / ms["median"]}


# ----------------------------------------------------------------------------- comparison

def attach_roofline(rec: dict, cfg) -> dict:
    from experiments.roofline import roofline

    res = roofline(cfg, rec["phase"], rec["batch"], rec["context"], rec["rows"], "bf16")
    floor = res["totals"]["floor_s"]
    rec["roofline"] = {"floor_s": floor, "bound": res["totals"]["bound"],
                       "fraction": floor / rec["median_s"]}
    return rec


def _key(phase, batch, context, rows):
    return (phase, int(batch), int(context), int(rows))


def ours_index(path: str, layers: int) -> dict:
    """bench.py records (a JSON list) -> {(phase, batch, context, rows): (median step s, mode)} for the
    finished single-device records with `layers` layers; realistic mode (real routing, as the peer's) is
    preferred over deepinfer mode where both exist."""
    out = {}
    for r in json.loads(Path(path).read_text()):
        if r.get("status") != "ok" or r.get("layers") != layers or r.get("devices", 1) != 1:
            continue
        k = _key(r["phase"], r["batch"], r["context"], r["new_tokens"])
        if k not in out or r["mode"] == "realistic":
            out[k] = (r["step_ms"]["median"] / 1e3, r["mode"])
    return out


def markdown(records: list[dict], meta: dict) -> str:
    lines = [f"# HF transformers peer: {meta['config']} ({meta['layers']} layers), {meta['device']}, "
             f"{meta['dtype']}, torch {meta['torch']}, transformers {meta['transformers']}", "",
             "| phase | batch | context | rows | HF median ms | tokens/s | roofline floor ms | HF / roofline "
             "| ours ms | ours speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ours = r.get("ours_median_s")
        lines.append(f"| {r['phase']} | {r['batch']} | {r['context']} | {r['rows']} | {1e3 * r['median_s']:.2f} "
                     f"| {r['tokens_per_s']:.0f} | {1e3 * r['roofline']['floor_s']:.3f} "
                     f"| {100 * r['roofline']['fraction']:.1f}% | "
                     + (f"{1e3 * ours:.2f} | {r['median_s'] / ours:.1f}x |" if ours else "- | - |"))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    import transformers

    from experiments.layer_scaling import scale_layers
    from model import ModelConfig

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    if args.quick:
        args.preset = args.preset or "tiny-v4"
        args.batch, args.context, args.rows = [2], [0, 32], [1, 4]
        args.new_tokens, args.warmup, args.repeats = 16, 1, 3
    cfg = ModelConfig.preset(args.preset or ("v4-flash-4l" if gpu else "tiny-v4"))
    if args.layers:
        cfg = scale_layers(cfg, args.layers)
    model = hf_model(cfg, device, dtype, args.seed)
    meta = {"config": cfg.name, "layers": cfg.num_layers, "device": torch.cuda.get_device_name() if gpu else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__, "command": " ".join(sys.argv),
            "params": sum(p.numel() for p in model.parameters())}
    ours = ours_index(args.ours, cfg.num_layers) if args.ours else {}
    phases = ("prefill", "decode") if args.phase == "both" else (args.phase,)
    records = []
    for phase in phases:
        for batch in args.batch:
            for context in args.context:
                for rows in ([args.new_tokens] if phase == "prefill" else args.rows):
                    rec = attach_roofline(time_point(model, phase, batch, context, rows, cfg.vocab_size,
                                                     args.warmup, args.repeats, args.seed), cfg)
                    if _key(phase, batch, context, rows) in ours:
                        rec["ours_median_s"], rec["ours_mode"] = ours[_key(phase, batch, context, rows)]
                    records.append(rec)
                    print(f"[peer_hf] {phase} B{batch} ctx {context} rows {rows}: {1e3 * rec['median_s']:.2f} ms "
                          f"({100 * rec['roofline']['fraction']:.1f}% of the roofline)", flush=True)
    out = {"meta": meta, "records": records}
    records_io.save(out, markdown(records, meta), "peer_hf", "gpu" if gpu else "cpu", args.out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
