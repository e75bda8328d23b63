"""bench.py's command line: what a run may ask for (phases, modes, steps, the batch-invariant mode), the options
and their defaults per backend, and the list and mesh parsers the other tools share."""

from __future__ import annotations

import argparse

from . import compile_cache

MODES = ("deepinfer", "realistic")
PHASES = ("prefill", "decode")
STEPS = ("verify", "spec")
INVARIANCE = ("off", "on", "both")


def int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in str(s).replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {s!r}")


def choice_list(choices: tuple):
    def parse(s: str) -> list[str]:
        if s == "both":
            return list(choices) if choices != PHASES else ["decode", "prefill"]
        items = [x for x in s.split(",") if x]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected 'both' or a comma list of {', '.join(choices)}; got {s!r}")
        return items
    return parse


def parse_mesh(s: str) -> tuple[int, int, int]:
    try:
        t = tuple(int(x) for x in str(s).split(","))
        assert len(t) == 3 and min(t) >= 1
        return t
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(f"mesh must be dp,ep,tp (positive), got {s!r}")


def defaults(backend: str, quick: bool) -> dict:
    gpu = backend == "gpu"
    d = {"preset": "v4-flash-4l" if gpu else "tiny-v4", "dtype": "bfloat16" if gpu else "float32",
         "impl": "pallas" if gpu else "reference"}
    if quick:
        d.update(batch=[2], context=64 if not gpu else 4096, new_tokens=16 if not gpu else 512, warmup=1,
                 repeats_prefill=10, repeats_decode=10)
    else:
        d.update(batch=[8, 64] if gpu else [2, 4], context=32768 if gpu else 128, new_tokens=4096 if gpu else 32,
                 warmup=3, repeats_prefill=10, repeats_decode=60)
    return d


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """bench.py's options (`description`: its help text)."""
    from model.config import ATTENTION_IMPLS
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="ModelConfig preset (default v4-flash-4l on GPU, tiny-v4 on CPU)")
    p.add_argument("--layers", type=int, help="scale to N backbone layers keeping the layer pattern")
    p.add_argument("--phase", type=choice_list(PHASES), default="both",
                   help="prefill, decode, both (= decode,prefill) or a comma list, run in that order")
    p.add_argument("--mode", type=choice_list(MODES), default="deepinfer",
                   help="deepinfer, realistic, both (= deepinfer,realistic) or a comma list")
    p.add_argument("--batch", type=int_list, help="sequences per step, global (comma list)")
    p.add_argument("--prefill-batch", type=int_list, help="prefill batch list (default: --batch)")
    p.add_argument("--context", type=int_list, help="cached positions before the step (comma list)")
    p.add_argument("--new-tokens", type=int, help="prefill rows per sequence per step (default 4096 on GPU)")
    p.add_argument("--num-draft", type=int, default=3, help="decode: drafts verified per step (default 3)")
    p.add_argument("--step", choices=STEPS, help="decode: time the target's verify step or the whole "
                   "speculative iteration (default: verify in deepinfer mode, spec in realistic mode)")
    p.add_argument("--replay", action="store_true", help="[V4.1] decoder-side bounded replay in prefill")
    p.add_argument("--dtype", choices=("bfloat16", "float32"))
    p.add_argument("--moe-impl", choices=("reference", "pallas"))
    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS,
                   help="pallas: the faster of triton and mgpu per call; mgpu: the Mosaic GPU window-attention "
                        "kernel (V4 widths, bf16, Hopper)")
    p.add_argument("--expert-weights", choices=("dense", "fp4"), help="routed experts held dense or FP4-packed")
    p.add_argument("--dense-weights", choices=("model", "fp8"),
                   help="the release's FP8 tensors held in the model dtype or FP8 + block scales")
    p.add_argument("--dense-impl", choices=("reference", "pallas"),
                   help="FP8 projections: dequantised in-graph (reference) or multiplied from their bytes (pallas)")
    p.add_argument("--mhc-impl", choices=("reference", "pallas"),
                   help="hyper-connections: XLA ops (reference) or two fused kernels per sublayer (pallas; default on GPU)")
    p.add_argument("--quant-sim", action="store_true", help="the official numerics: act_quant'd FP8 / FP4 GEMM "
                   "inputs (FP8 x FP8 kernels) and the KV fake-quant steps")
    p.add_argument("--head-dtype", choices=("float32", "bfloat16"),
                   help="LM head GEMM inputs: float32 (the official model, default) or bfloat16 (f32 accumulation)")
    p.add_argument("--batch-invariant", choices=INVARIANCE, default="off",
                   help="the fast mode (off), the batch-invariant mode (on: ModelConfig.batch_invariant on the "
                        "reference paths and the MoE kernels) or both in one call, each configuration fast mode first")
    p.add_argument("--index-keys", choices=("model", "fp4"),
                   help="indexer key cache: model dtype (default) or MXFP4 rows as the release stores them")
    p.add_argument("--kernel-times", type=int, default=0, metavar="STEPS",
                   help="prefill / verify: STEPS more steps under CUPTI; record per-kernel times (GPU only)")
    p.add_argument("--trace", metavar="DIR",
                   help="prefill / verify: two more steps under jax.profiler, one timeline per configuration in "
                        "DIR/<configuration> (open with TensorBoard's profile plugin or Perfetto): kernels, copies, "
                        "host work and the gaps between them")
    p.add_argument("--loop-steps", type=int, default=0, metavar="N",
                   help="verify: also N steps in one device loop per call (a while loop on a traced count, as the "
                        "sampling loop runs), each step's ids the next one's tokens: a step's cost without the host "
                        "between steps")
    p.add_argument("--engram-vocab", type=int, help="[V4.1] Engram hash vocabulary (smaller tables, same rows "
                   "read per token), e.g. 160000 for V4.1 widths on one GPU")
    p.add_argument("--mesh", type=parse_mesh, default=(1, 1, 1), help="dp,ep,tp (default 1,1,1: one device)")
    p.add_argument("--repeats", type=int, help="timed steps (default: prefill 10, decode 60)")
    p.add_argument("--warmup", type=int, help="untimed steps after compilation (default 3)")
    p.add_argument("--real-prefill", action="store_true", help="prefill real random prompts instead of a "
                   "synthetic context (small contexts)")
    p.add_argument("--checkpoint", help="a save_orbax directory (e.g. a trained drafter) instead of random weights")
    p.add_argument("--scan-layers", action="store_true", help="run repeated layer groups as one scanned body "
                   "each (ModelConfig.scan_layers) instead of every layer traced on its own")
    compile_cache.add_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: small shapes, 1 warm-up, 10 repeats")
    p.add_argument("--no-memory-check", action="store_true", help="run even where the memory estimate says no")
    p.add_argument("--out", help="results directory (default experiments/results; $OUT also gets a copy)")
    p.add_argument("--tag", default="", help="added to the results file name")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--plot", action="store_true", help="also draw the records (experiments/plots.py: the step by "
                   "component beside its floors) as a PNG beside the JSON (needs matplotlib)")
    p.add_argument("--time-budget", type=float, help="seconds: start no new configuration after this (the ones "
                   "left are recorded as skipped), so a run under a hard limit ends with its table written")
    return p.parse_args(argv)
