"""Published rack-scale figures for V4.1-Flash against our floor and estimate (docs/benchmarks.md, "Rack-scale
model").

    python -m experiments.roofline_published [--json FILE]

Each row is one published time and the `python -m experiments.roofline` flags of its configuration; the row's
floor is that command's `floor_ms` (every term overlapped) or, for a published component time, the floor of
the same components. Every floor must stay below its published time: a floor above a measured time means the
model is wrong. The table then reads floor / published (how close that engine is to the limit) and the component
that sets the floor (the largest share of its binding term).

Formats: the release's (FP8 dense, FP4 experts: `--weights fp4-experts`) and the most compact KV cache a V4.1
engine can hold (`--kv-dtype packed`: FP4 compressed entries and index keys), so that the floors are lower
bounds whatever cache format the engines chose. The drafter's own cost is left out (`--drafter` adds it):
the published decode steps include drafting, so leaving it out keeps the floor below them.

Sources (docs/benchmarks.md names them with the table; /work/shared/PEERS.md section b holds their context):
  * DeepInfer's benchmark mode rerun by SGLang on 64 GB300 (LMSYS blog 2026-10-24, "SGLang vs DeepInfer"):
    decode DP64 / EP64, 128K contexts, 3 static drafts, forced balance, 384 routed + 64 redundant experts,
    31.19 ms per step at 256 requests per GPU (SGLang: 28.88 ms); "level" at 8 requests per GPU (no time given).
  * vLLM's DeepInfer comparison (vLLM blog, October 2026): at DEP4, 128K, 64 requests per GPU on GB300 the MoE is
    62% of the target model's step and attention + indexer 13%; MoE 13.4 ms at DEP4, 6.0 ms at DEP32; target
    forward 8.9 ms at DEP32, 16 requests per GPU. Real routing with EPLB (uniform random routing here, no
    redundant experts: vLLM gave no count); its drafts per step are not given (3 assumed, as in the comparison).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

BASE = "--preset v41-flash --hardware gb300 --phase decode --context 131072 --num-draft 3 --weights fp4-experts " \
       "--kv-dtype packed"
DEEPINFER = BASE + " --forced-balance --redundant-experts 64 --mesh 1,64,1"
VLLM_DEP4 = BASE + " --mesh 1,4,1 --batch 256"
VLLM_DEP32 = BASE + " --mesh 1,32,1 --batch 512"
LMSYS = "LMSYS blog 2026-10-24, SGLang's rerun of DeepInfer on 64 GB300 (PEERS.md b1-b2)"
VLLM = "vLLM's October 2026 DeepInfer comparison on GB300 (PEERS.md b2; the post itself not reachable)"
STEP = ("*",)                                    # the whole step
MOE = ("moe_experts",)
ATTENTION = ("attn_core", "indexer")

# (label, flags, published ms or None, what it times: components or STEP, source)
ROWS = (
    ("DeepInfer decode, DP64/EP64, 256 req/GPU", DEEPINFER + " --batch 16384", 31.19, STEP, LMSYS),
    ("SGLang, same configuration", DEEPINFER + " --batch 16384", 28.88, STEP, LMSYS),
    ("DeepInfer decode, with the drafter's cost", DEEPINFER + " --batch 16384 --drafter", 31.19, STEP, LMSYS),
    ("DeepInfer, the default formats (bf16 weights and KV)",
     "--preset v41-flash --hardware gb300 --mesh 1,64,1 --phase decode --batch 16384 --context 131072 --num-draft 3 "
     "--redundant-experts 64 --forced-balance", 31.19, STEP, LMSYS),
    ("DeepInfer decode, 8 req/GPU (engines level)", DEEPINFER + " --batch 512", None, STEP, LMSYS),
    ("vLLM DEP4, 64 req/GPU: target step (13.4 / 0.62)", VLLM_DEP4, 13.4 / 0.62, STEP, VLLM),
    ("vLLM DEP4, 64 req/GPU: MoE (62%)", VLLM_DEP4, 13.4, MOE, VLLM),
    ("vLLM DEP4, 64 req/GPU: attention + indexer (13%)", VLLM_DEP4, 0.13 * 13.4 / 0.62, ATTENTION, VLLM),
    ("vLLM DEP32, 16 req/GPU: target forward", VLLM_DEP32, 8.9, STEP, VLLM),
    ("vLLM DEP32: MoE (at 16 req/GPU; the request count is not given)", VLLM_DEP32, 6.0, MOE, VLLM),
)
# EP width x requests per GPU, DeepInfer's workload (64 redundant experts at EP64, as it ran; none below)
SCALING_EP = (4, 8, 16, 32, 64)
SCALING_REQUESTS = (8, 64, 256)
SCALING_PUBLISHED = {(64, 256): 31.19}


def scaling_flags(ep: int, requests: int) -> str:
    return (BASE + f" --forced-balance --mesh 1,{ep},1 --batch {ep * requests}"
            + (" --redundant-experts 64" if ep == 64 else ""))


def run(flags: str) -> dict:
    """`python -m experiments.roofline FLAGS`'s record (with its estimate), without printing."""
    from experiments import roofline

    args = roofline.parse_args(shlex.split(flags))
    res = roofline.with_estimate(roofline.roofline_of_args(args))
    res["command"] = "python -m experiments.roofline " + flags
    return res


def floor_of(res: dict, what: tuple) -> tuple[float, str]:
    """(floor ms, the component that sets it) of the whole step or of a set of components."""
    t = res["totals"]
    if what == STEP:
        binding = {"memory": "memory_s", "compute": "compute_s"}.get(t["bound"])
        if binding is None:
            return t["floor_s"] * 1e3, f"communication: {t['floor_component']}"
        share = res["components"][t["floor_component"]][binding] / t[binding]
        return t["floor_s"] * 1e3, f"{t['bound']}: {t['floor_component']} ({100 * share:.0f}%)"
    comps = [res["components"][c] for c in what]
    mem = sum(c["memory_s"] for c in comps)
    comp = sum(c["compute_s"] for c in comps)
    return max(mem, comp) * 1e3, "memory" if mem >= comp else "compute"


def table() -> dict:
    """Every published row and the EP-width grid: {"rows": [...], "scaling": [...]}."""
    rows = []
    for label, flags, published, what, source in ROWS:
        res = run(flags)
        floor, sets = floor_of(res, what)
        est = res["estimate_ms"] if what == STEP else sum(
            res["estimate"]["by_group_s"].get(c, 0.0) for c in what) * 1e3
        rows.append({"label": label, "flags": flags, "published_ms": published, "source": source,
                     "times": "step" if what == STEP else " + ".join(what), "floor_ms": floor,
                     "floor_serial_ms": res["totals"]["floor_serial_s"] * 1e3 if what == STEP else None,
                     "estimate_ms": est, "estimate_dominant": res["estimate"]["dominant"] if what == STEP else None,
                     "sets_floor": sets, "fits": res["memory"]["fits"]})
    scaling = []
    for requests in SCALING_REQUESTS:
        for ep in SCALING_EP:
            res = run(scaling_flags(ep, requests))
            floor, sets = floor_of(res, STEP)
            scaling.append({"ep": ep, "requests_per_gpu": requests, "flags": scaling_flags(ep, requests),
                            "floor_ms": floor, "estimate_ms": res["estimate_ms"], "sets_floor": sets,
                            "published_ms": SCALING_PUBLISHED.get((ep, requests)), "fits": res["memory"]["fits"]})
    return {"rows": rows, "scaling": scaling}


def markdown(tab: dict) -> str:
    out = ["| configuration (GB300) | times | floor ms | floor, comm. serial ms | estimate ms | published ms | "
           "floor / published | the floor is set by | the estimate is dominated by |",
           "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in tab["rows"]:
        pub = f"{r['published_ms']:.2f}" if r["published_ms"] else "—"
        ratio = f"{r['floor_ms'] / r['published_ms']:.2f}" if r["published_ms"] else "—"
        serial = f"{r['floor_serial_ms']:.2f}" if r["floor_serial_ms"] is not None else ""
        out.append(f"| {r['label']} | {r['times']} | {r['floor_ms']:.2f} | {serial} | {r['estimate_ms']:.1f} | {pub} | "
                   f"{ratio} | {r['sets_floor']} | {r['estimate_dominant'] or ''} |")
    heads = " | ".join(f"{n} req/GPU: floor / estimate ms" for n in SCALING_REQUESTS)
    out += ["", f"| EP width (DEP) | {heads} |", "|---|" + "---:|" * len(SCALING_REQUESTS)]
    for ep in SCALING_EP:
        cells = []
        for n in SCALING_REQUESTS:
            r = next(x for x in tab["scaling"] if x["ep"] == ep and x["requests_per_gpu"] == n)
            pub = f" (published {r['published_ms']:.2f})" if r["published_ms"] else ""
            cells.append(f"{r['floor_ms']:.2f} / {r['estimate_ms']:.1f}{pub}, {r['sets_floor']}"
                         + ("" if r["fits"] else ", does not fit"))
        out.append(f"| {ep} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    from experiments.roofline import _git_revision

    tab = table()
    tab["command"] = "python -m experiments.roofline_published " + " ".join(argv if argv is not None else sys.argv[1:])
    tab["revision"] = _git_revision()
    print(markdown(tab))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(tab, f, indent=1)
    return tab


if __name__ == "__main__":
    main()
