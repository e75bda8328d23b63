"""Where a step's time goes: every GPU kernel of a compiled step, timed by CUPTI, attributed to a component of
the model by the compiled program's own op names, and sorted into kinds (GEMM, our Pallas kernels, glue).

    breakdown = profile_step(compiled, run_once, steps=3)   # run_once() -> outputs (blocked on)

The model opens a `jax.named_scope` per component (model/transformer.py, attention.py, moe.py, layers.py:
`attention`, `attn_core`, `proj`, `indexer`, `compressor`, `moe`, `router`, `experts`, `shared_expert`,
`mhc`, `head`, `engram`, `embed`; pallas_kernels/moe.py: `dispatch`, `combine`), so every HLO instruction's
`op_name` metadata carries the path of scopes it was traced under. XLA names a fusion's kernel after the fusion
instruction (`loop_convert_fusion.3` -> `loop_convert_fusion_3`), so a kernel's scopes are read from the
instruction of its name.

Our Pallas kernels and library GEMMs are the program's custom calls, matched to the kernels XLA does not name
in execution order: all of them when the counts agree, else the library GEMMs (cuBLAS calls against nvjet / xmma
kernels) and our kernels each on their own where their counts agree (a Mosaic GPU call may launch several
kernels), the rest by the kernel's own name.

A component's time is the sum of its kernels; the step's wall-clock time minus the sum of all kernels is the host /
launch gap (one stream: kernels do not overlap).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable

import numpy as np

# the model's components (experiments/roofline.py COMPONENTS, plus embed and other), in report order
COMPONENTS = ("moe_experts", "shared_expert", "router", "attn_proj", "attn_core", "indexer", "compressor", "mhc",
              "head", "engram", "embed", "other")
# scope -> component, the first rule whose scope is on the op's path wins
_SCOPE_RULES = (("shared_expert", "shared_expert"), ("dispatch", "router"), ("combine", "router"),
                ("router", "router"), ("experts", "moe_experts"), ("indexer", "indexer"),
                ("compressor", "compressor"), ("engram", "engram"), ("head", "head"), ("proj", "attn_proj"),
                ("attn_core", "attn_core"), ("attention", "attn_core"), ("mhc", "mhc"), ("embed", "embed"))
# kernel kinds of XLA's own kernels, by the fusion name's hero op (first match wins)
_GLUE_KINDS = (("transpose", "transpose"), ("concatenate", "concatenate"), ("convert", "convert"),
               ("sort", "sort"), ("dynamic_update_slice", "in-place update"), ("scatter", "scatter / gather"),
               ("gather", "scatter / gather"), ("copy", "copy"), ("reduce", "reduce"))
_LIBRARY_GEMM = re.compile(r"^(sm\d+_xmma|nvjet|cutlass|gemm|ampere|volta|turing|cublas|sm90_)", re.I)
_LIBRARY_AUX = re.compile(r"(splitKreduce|reduce_1Block|gemvx|gemv2)", re.I)
# the runtime's own copy kernels (memcpy32_post, memcpy128, ...: no custom call of their own, they serve the op
# before them)
_RUNTIME_COPY = re.compile(r"^(memcpy|memset)\w*$", re.I)
_MANGLED_GEMM = re.compile(r"^_Z\w*(cutlass|cublasLt|xmma)", re.I)   # C++-mangled library GEMM kernels
_CUB = re.compile(r"^(_ZN\d*cub|cub::)", re.I)                        # XLA's sorts on cub (several kernels a call)


def _call_class(kernel: str) -> str:
    """Which custom calls a kernel that XLA does not name belongs to: library GEMMs, cub sorts, or our kernels."""
    if _LIBRARY_GEMM.match(kernel) or _MANGLED_GEMM.match(kernel):
        return "gemm"
    return "cub" if _CUB.match(kernel) else "ours"


def _target_class(target: str) -> str:
    t = target.lower()
    return "gemm" if "cublas" in t else "cub" if "cub" in t else "ours"
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"(?<![\w\[])([a-z][a-z0-9\-_]*)\(")


def kernel_name(hlo_name: str) -> str:
    """The kernel name XLA gives an instruction's kernel ('.' and '-' become '_')."""
    return re.sub(r"[.\-]", "_", hlo_name)


def parse_hlo(text: str) -> tuple[dict[str, dict], list[str]]:
    """Compiled HLO text -> ({kernel name: {op, target, op_name}}, the custom calls (library GEMMs, Pallas
    kernels) in execution order (command-buffer and while bodies expanded once))."""
    comps: dict[str, list[dict]] = {}
    entry, current = None, None
    for line in text.splitlines():
        head = line.strip()
        if line[:1] not in (" ", "\t") and head.endswith("{") and "->" in head:   # a computation's header
            name = head.split()[1] if head.startswith("ENTRY") else head.split()[0]
            current = name.lstrip("%").split("(")[0]
            comps[current] = []
            if head.startswith("ENTRY"):
                entry = current
            continue
        m = _LINE.match(line)
        if current is None or m is None:
            continue
        rest = m.group("rest")
        op = _OPCODE.search(rest)
        meta = re.search(r'op_name="([^"]*)"', rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        calls = re.findall(r"(?:to_apply|body|calls)=%?([\w.\-]+)", rest)
        operands = re.findall(r"%([\w.\-]+)", rest[op.end():rest.find(")", op.end())] if op else "")
        comps[current].append({"name": m.group("name"), "op": op.group(1) if op else "", "calls": calls,
                               "operands": operands, "target": target.group(1) if target else "",
                               "op_name": meta.group(1) if meta else ""})
    named = {i["name"]: i for c in comps.values() for i in c}
    for c in comps.values():
        for ins in c:   # without metadata: the op names inside the computation it calls, else its operands' names
            if not ins["op_name"] and ins["calls"]:
                names = [i["op_name"] for callee in ins["calls"] for i in comps.get(callee, ()) if i["op_name"]]
                ins["op_name"] = names[-1] if names else ""
            if not ins["op_name"]:   # producers come first in the text: their names are final here
                ins["op_name"] = next((named[o]["op_name"] for o in ins["operands"]
                                       if o in named and named[o]["op_name"]), "")
    info = {kernel_name(i["name"]): i for c in comps.values() for i in c}
    order: list[str] = []

    def expand(comp: str, depth: int = 0) -> None:
        for ins in comps.get(comp, []):
            if ins["op"] in ("call", "while") and depth < 8:
                for callee in ins["calls"]:
                    expand(callee, depth + 1)
            elif ins["op"] == "custom-call":
                order.append(kernel_name(ins["name"]))

    if entry is not None:
        expand(entry)
    return info, order


# a weight's path in the model state (`st['layers'][0]['attn']['wkv']['weight'].value`) -> pseudo scopes
_PARAM_SCOPES = (("shared_experts", "shared_expert"), ("experts", "experts"), ("gate", "router"),
                 ("indexer", "indexer"), ("compressor", "compressor"), ("engram", "engram"), ("head", "head"),
                 ("hc_", "mhc"), ("wq_", "proj"), ("wkv", "proj"), ("wo_", "proj"), ("attn", "attention"),
                 ("embed", "embed"))


def component_of(op_name: str) -> str:
    """The component of an op from the scopes on its path (`_SCOPE_RULES`), else "other"."""
    if op_name.startswith("cache."):   # a cache array's own ops: index keys feed the indexer, the rest attention
        return "indexer" if ".index." in op_name else "attn_core"
    if op_name.startswith("st["):
        keys = re.findall(r"\[\\?'([^'\\]+)\\?'\]", op_name)
        op_name = "/".join(scope for key in keys for pat, scope in _PARAM_SCOPES if key.startswith(pat))
    parts = set(op_name.split("/"))
    for scope, comp in _SCOPE_RULES:
        if scope in parts:
            return comp
    return "other"


def kind_of(kernel: str, ins: dict | None) -> str:
    """"gemm" (library or XLA's GEMM fusions), "pallas" (our kernels), or a glue kind of XLA's own kernels."""
    if _LIBRARY_GEMM.match(kernel) or _MANGLED_GEMM.match(kernel) or _LIBRARY_AUX.search(kernel):
        return "gemm"
    if _CUB.match(kernel):
        return "sort"
    if _RUNTIME_COPY.match(kernel):
        return "copy"
    if ins is None or ins["op"] == "custom-call":
        t = ins["target"].lower() if ins else ""
        return "gemm" if ("cublas" in t or "gemm" in t) else "sort" if "cub" in t else "pallas"
    if "gemm_fusion" in kernel or "triton_gemm" in kernel or "dot" in kernel.split("_fusion")[0]:
        return "gemm"
    for key, kind in _GLUE_KINDS:
        if key in kernel:
            return kind
    return "elementwise / other"


def _lookup(kernel: str, info: dict) -> dict | None:
    name = kernel
    while name:
        if name in info:
            return info[name]
        stripped = re.sub(r"_+\d+$", "", name)   # XLA's copies of a kernel: `sort_53_1__1`, `..._2`
        if stripped == name:
            return None
        name = stripped
    return None


# our kernels' own names -> component, where the program order cannot place them
# (pallas_kernels' `name=`s; Mosaic GPU kernels are all `body_mosaic_gpu_kernel`, mostly the MoE's)
_KERNEL_NAMES = (("sparse_mqa", "attn_core"), ("indexer_", "indexer"), ("mhc_", "mhc"), ("moe_take_rows", "router"),
                 ("moe_act_quant", "router"), ("moe_transpose", "router"), ("moe_", "moe_experts"),
                 ("mosaic_gpu", "moe_experts"))


def attribute(kernels: list[tuple[str, float]], info: dict, custom_calls: list[str]) -> list[dict]:
    """One step's CUPTI kernels [(name, ms)] in launch order -> [{kernel, ms, component, kind, op_name}].

    XLA's own kernels are found by name. The others (library GEMMs, our Pallas kernels) are the program's custom
    calls: matched in execution order when their counts agree, else each class on its own (library GEMMs, cub sorts
    -- a run of consecutive cub kernels is one call -- and our kernels) where its counts agree, else by the kernel's
    own name."""
    own = [_lookup(k, info) for k, _ in kernels]
    # kernels that serve the op before them: a library GEMM's split-K reduction, the runtime's copies
    helper = [own[i] is None and bool(_LIBRARY_AUX.search(k) or _RUNTIME_COPY.match(k))
              for i, (k, _) in enumerate(kernels)]
    foreign = [i for i in range(len(kernels)) if own[i] is None and not helper[i]]
    placed = {}
    if len(foreign) == len(custom_calls):
        placed = {i: info.get(name) for i, name in zip(foreign, custom_calls)}
    else:
        for cls in ("gemm", "cub", "ours"):
            units: list[list[int]] = []
            for n, i in enumerate(foreign):
                if _call_class(kernels[i][0]) != cls:
                    continue
                if cls == "cub" and units and units[-1][-1] == foreign[n - 1]:   # helpers between do not count
                    units[-1].append(i)
                else:
                    units.append([i])
            calls = [name for name in custom_calls if _target_class(info.get(name, {}).get("target", "")) == cls]
            if len(units) == len(calls):
                placed.update({i: info.get(name) for unit, name in zip(units, calls) for i in unit})
    out, last = [], None
    for i, (k, ms) in enumerate(kernels):
        ins = own[i] or placed.get(i)
        if helper[i]:
            ins = last
        last = ins
        if ins is not None and ins["op_name"]:
            comp = component_of(ins["op_name"])
        else:
            comp = next((c for pat, c in _KERNEL_NAMES if pat in k.lower()), "other")
        out.append({"kernel": k, "ms": ms, "kind": kind_of(k, ins), "component": comp,
                    "op_name": (ins["op_name"] if ins else "")[-160:]})
    return out


def summarise(steps: list[list[dict]], wall_ms: float, devices: int = 1) -> dict:
    """Attributed kernels of several steps + the step's wall-clock median -> per-step components, kinds, gap,
    and the kernels ranked (mean ms per step), per device: CUPTI times every device's kernels of the process, so a
    mesh's kernel times are divided by its `devices` (which run the same program side by side)."""
    n = len(steps) * devices
    by_comp: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    per_kernel: dict[tuple, list] = {}
    for step in steps:
        for r in step:
            by_comp[r["component"]][r["kind"]] += r["ms"] / n
            key = (r["kernel"], r["component"], r["kind"])
            per_kernel.setdefault(key, [0.0, 0, r["op_name"]])
            per_kernel[key][0] += r["ms"] / n
            per_kernel[key][1] += 1 / n
    kernel_ms = float(np.median([sum(r["ms"] for r in s) for s in steps])) / devices
    comps = {c: {"ms": round(sum(by_comp[c].values()), 4),
                 "by_kind": {k: round(v, 4) for k, v in sorted(by_comp[c].items(), key=lambda kv: -kv[1])}}
             for c in COMPONENTS if c in by_comp}
    kinds: dict[str, float] = defaultdict(float)
    for c in by_comp.values():
        for k, v in c.items():
            kinds[k] += v
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    return {"steps": len(steps), "devices": devices, "per_device": True, "wall_ms": round(wall_ms, 4),
            "kernel_ms_per_step": round(kernel_ms, 4),
            "gap_ms": round(wall_ms - kernel_ms, 4), "components": comps,
            "kinds": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [[k[0][:80], k[1], k[2], round(v[0], 4), round(v[1], 2), v[2]] for k, v in ranked[:80]]}


def from_kernel_names(kernels: dict, wall_ms: float) -> dict:
    """A breakdown from a record's bare kernel list (`{"steps", "top": [[name, ms per step, calls], ...]}`, what
    --kernel-times recorded before kernels were attributed through the program): components only where a kernel's
    own name tells (our Pallas kernels; library GEMMs as "gemm"), XLA's kernels by kind under "other"."""
    rows = []
    for name, ms, *_ in kernels["top"]:
        kind = kind_of(name, None if (_LIBRARY_GEMM.match(name) or _is_our_kernel(name)) else {"op": "fusion"})
        comp = next((c for pat, c in _KERNEL_NAMES if pat in name.lower()), "other") if kind == "pallas" else "other"
        rows.append({"kernel": name, "ms": ms, "kind": kind, "component": comp, "op_name": ""})
    res = summarise([rows], wall_ms)
    res["steps"] = kernels.get("steps", 1)
    res["attribution"] = "kernel names only"
    res["per_device"] = False   # the list as recorded: every device's kernels of the process
    del res["devices"]
    return res


def _is_our_kernel(name: str) -> bool:
    return any(pat in name.lower() for pat, _ in _KERNEL_NAMES) and "fusion" not in name


def cupti_steps(run_once: Callable[[], Any], steps: int) -> list[list[tuple[str, float]]]:
    """`steps` calls of run_once() under CUPTI -> each call's kernels [(name, ms)] in completion order.

    CUPTI is driven through jax's Mosaic GPU extension (private `_cupti_init` / `_cupti_get_timings`, what
    `mosaic.gpu.profiler.measure` wraps; `measure` itself runs its function twice on the same arguments, which a
    step that donates its cache cannot do)."""
    import jax

    if jax.default_backend() != "gpu":
        raise RuntimeError(f"CUPTI needs a GPU (backend: {jax.default_backend()})")
    from jax._src.lib import mosaic_gpu as mgpu_lib

    if mgpu_lib is None:
        raise RuntimeError("CUPTI is reached through jax's Mosaic GPU library, absent here")
    ext = mgpu_lib._mosaic_gpu_ext
    out = []
    for _ in range(steps):
        ext._cupti_init()
        try:
            jax.block_until_ready(run_once())
        finally:
            kernels = ext._cupti_get_timings(True) or []
        out.append([(str(name), float(ms)) for name, ms in kernels])
    return out


def profile_step(hlo_text: str, run_once: Callable[[], Any], steps: int, wall_ms: float, devices: int = 1) -> dict:
    """The breakdown of a compiled step (its `compiled.as_text()`) per device of its `devices`, or {"error": ...}
    where CUPTI is absent."""
    try:
        raw = cupti_steps(run_once, steps)
    except Exception as e:  # noqa: BLE001 - no CUPTI (CPU) or a profiler failure: the timing stands alone
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    info, order = parse_hlo(hlo_text)
    steps = [attribute(s, info, order) for s in raw]
    res = summarise(steps, wall_ms, devices)
    res["custom_calls"] = len(order)
    res["attribution"] = "program op names"
    res["raw_step"] = [[r["kernel"][:60], round(r["ms"], 4), r["component"], r["kind"]] for r in steps[0]]
    return res
