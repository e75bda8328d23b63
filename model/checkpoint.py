"""Checkpoints: safetensors in every layout transformers reads for this model; orbax.

Official names (docs/model.md §14) are the canonical names: our parameter tree mirrors them, with
two mechanical differences handled here — `hc_{attn,ffn,head}_{fn,base,scale}` are the
submodules `hc_attn.fn` etc., and routed experts are stacked (`ffn.experts.w1` [E, I, D] holds
`ffn.experts.{e}.w1.weight`). Stored names are translated name by name (`official_name`): official
names, HF module names (`model.layers.{l}.self_attn.q_a_proj.weight`, fused `mlp.experts.gate_up_proj`,
...) and transformers' default `save_pretrained` naming (official names under `model.`, a few HF ones).
`model.sharded.path_to_official` gives a state path's official name (the sharding tables use it too).

Loading never executes code: safetensors + JSON only. FP8 (E4M3 + UE8M0 block scales) and FP4
(E2M1 packed low-nibble-first + UE8M0 per 32) are dequantised tensor by tensor and cast straight
to the parameter dtype, except where the config holds them quantised (`_held_format`: FP4 routed
experts with cfg.expert_weights="fp4", the release's FP8 matrices with cfg.dense_weights="fp8"):
kept as shipped, or quantised on load. Missing, unexpected or mis-shaped tensors, a dtype that does not
belong (an integer tensor where a float one belongs, or the reverse) and, unless `check_finite=False`,
NaN / inf values raise errors naming the tensor.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.moe import (FP4_KERNEL_MAX_BYTE, fp4_kernel_scales, fp4_kernel_weights, fp4_scale_bytes,
                                 fp4_weight_bytes)

from sharding.row_lookup import HOST_MEMORY

from . import quant_io
from .config import ModelConfig
from .footprint import check_fits
from .runtime import make_runtime
from .sharded import (host_resident, local_expert_tensors, official_entries, path_to_official, place_loaded,
                      skipped_expert_names)
from .transformer import Transformer, abstract_model

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")
_ENGRAM_TABLE = re.compile(r"^layers\.(\d+)\.engram\.embed\.(weight|scale)$")   # [V4.1] a table and its scales


# ----------------------------------------------------------------------------- naming

def _hf_rules() -> list[tuple[re.Pattern, str]]:
    """HF-transformers module names (after the `model.` prefix) -> official names."""
    rules = [
        (r"^embed_tokens\.weight$", "embed.weight"),
        (r"^lm_head\.weight$", "head.weight"),
        (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
        (r"^layers\.(\d+)\.attn_hc\.(fn|base|scale)$", r"layers.\1.hc_attn_\2"),
        (r"^layers\.(\d+)\.ffn_hc\.(fn|base|scale)$", r"layers.\1.hc_ffn_\2"),
        (r"^layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attn_norm.weight"),
        (r"^layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
        (r"^layers\.(\d+)\.self_attn\.sinks$", r"layers.\1.attn.attn_sink"),
        (r"^layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers.\1.ffn.gate.bias"),
        (r"^layers\.(\d+)\.mlp\.gate\.(weight|tid2eid)$", r"layers.\1.ffn.gate.\2"),
        (r"^layers\.(\d+)\.mlp\.experts\.down_proj$", r"layers.\1.ffn.experts.w2"),
        (r"^layers\.(\d+)\.mlp\.experts\.gate_up_proj$", r"layers.\1.ffn.experts.gate_up"),
        (r"^layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.weight$", r"layers.\1.ffn.shared_experts.w1.weight"),
        (r"^layers\.(\d+)\.mlp\.shared_experts\.up_proj\.weight$", r"layers.\1.ffn.shared_experts.w3.weight"),
        (r"^layers\.(\d+)\.mlp\.shared_experts\.down_proj\.weight$", r"layers.\1.ffn.shared_experts.w2.weight"),
    ]
    attn = {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv",
            "kv_norm": "kv_norm", "o_a_proj": "wo_a", "o_b_proj": "wo_b"}
    for hf, off in attn.items():
        rules.append((rf"^layers\.(\d+)\.self_attn\.{hf}\.weight$", rf"layers.\1.attn.{off}.weight"))
    comp = {"kv_proj.weight": "wkv.weight", "gate_proj.weight": "wgate.weight", "position_bias": "ape",
            "kv_norm.weight": "norm.weight"}
    for hf, off in comp.items():
        hf_re = hf.replace(".", r"\.")
        rules.append((rf"^layers\.(\d+)\.self_attn\.compressor\.indexer\.{hf_re}$",
                      rf"layers.\1.attn.indexer.compressor.{off}"))
        rules.append((rf"^layers\.(\d+)\.self_attn\.compressor\.{hf_re}$",
                      rf"layers.\1.attn.compressor.{off}"))
    rules += [
        (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.q_b_proj\.weight$",
         r"layers.\1.attn.indexer.wq_b.weight"),
        (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight$",
         r"layers.\1.attn.indexer.weights_proj.weight"),
        # transformers' default save_pretrained (save_original_format=True) runs its official -> HF renames
        # backwards, and the backward `.norm.` <- `.kv_norm.` turns the attention's kv_norm into `attn.norm`
        (r"^(layers|mtp)\.(\d+)\.attn\.norm\.weight$", r"\1.\2.attn.kv_norm.weight"),
    ]
    return [(re.compile(p), r) for p, r in rules]


_HF_RULES = _hf_rules()


def official_name(name: str) -> str:
    """A tensor name of any layout transformers' `from_pretrained` reads for this model -> its official name:
    official names (`layers.0.attn.wq_a.weight`), HF module names (`model.layers.0.self_attn.q_a_proj.weight`,
    fused `mlp.experts.gate_up_proj` -> `ffn.experts.gate_up`) and transformers' default save (official names
    under `model.`, with HF's `embed_tokens`, `hc_head.hc_fn`, `norm` and `attn.norm` for the kv_norm). A name
    of none of them comes back without its `model.` prefix (the loader reports it as unexpected)."""
    base = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in _HF_RULES:
        if pattern.match(base):
            return pattern.sub(repl, base)
    return base


def _official_tensors(items: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Translate stored names to official names (`official_name`); split fused HF experts into per-expert
    tensors; two stored tensors with one official name raise."""
    sources: dict[str, str] = {}
    for name, arr in items:
        off = official_name(name)
        if off in sources and sources[off] != name:
            raise ValueError(f"tensors {sources[off]!r} and {name!r} both hold {off!r}")
        sources[off] = name
        if off.endswith(".experts.gate_up") or off.endswith(".experts.w2"):
            prefix, kind = off.rsplit(".", 1)
            if arr.ndim != 3:
                raise ValueError(f"tensor {name!r}: expected [experts, out, in], got shape {arr.shape}")
            if kind == "gate_up":
                if arr.shape[1] % 2:
                    raise ValueError(f"tensor {name!r}: fused gate_up rows {arr.shape[1]} not even")
                half = arr.shape[1] // 2
                for e in range(arr.shape[0]):
                    yield f"{prefix}.{e}.w1.weight", arr[e, :half]
                    yield f"{prefix}.{e}.w3.weight", arr[e, half:]
            else:
                for e in range(arr.shape[0]):
                    yield f"{prefix}.{e}.w2.weight", arr[e]
        else:
            yield off, arr


def _dequantised(items: Iterator[tuple[str, np.ndarray]], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Pair each quantised `.weight` with its `.scale` and yield logical tensors in the formats `cfg` holds
    (`_as_held`)."""
    pending: dict[str, np.ndarray] = {}
    plain: dict[str, np.dtype] = {}  # `.weight`s stored unquantised (a scale of theirs is misplaced)
    for name, arr in items:
        if name.endswith(".scale"):
            partner = name[:-len(".scale")] + ".weight"
        elif name.endswith(".weight") and (arr.dtype in (quant_io.F8_E4M3, quant_io.F8_E5M2)
                                           or arr.dtype in (np.int8, np.uint8)):
            partner = name[:-len(".weight")] + ".scale"
        else:
            if name.endswith(".weight"):
                plain[name] = arr.dtype
            yield from _as_held({name: arr}, cfg)
            continue
        if partner in pending:
            yield from _as_held({name: arr, partner: pending.pop(partner)}, cfg)
        else:
            pending[name] = arr
    for name, arr in pending.items():  # unpaired: dequantize_official names the problem
        weight = name[:-len(".scale")] + ".weight"
        if weight in plain:
            raise ValueError(f"tensor {name!r}: its weight {weight!r} is stored as {plain[weight]}, which carries "
                             "no scale (a scale belongs to an FP8 float8_e4m3fn or packed FP4 int8 weight): drop "
                             "the scale if the weight holds its values, or store the weight in its quantised format")
        quant_io.dequantize_official({name: arr})


# routed experts' FP4 leaves held in the swap kernels' layout: (held dtype, to it, back to the checkpoint's
# bytes, the checkpoint's [..., E, ...] shape and dtype from the held shape; a scanned group's leading axis kept)
_KERNEL_LAYOUTS = {
    "s": (jnp.bfloat16, fp4_kernel_scales, fp4_scale_bytes,
          lambda *lead, n, k: ((*lead, k, n), np.uint8)),      # held [..., E, in/32, out]
    "w": (jnp.uint16, fp4_kernel_weights, fp4_weight_bytes,
          lambda *lead, n, k: ((*lead, n, 2 * k), np.int8)),   # held [..., E, out, in/4]
}


def _kernel_layout(path: tuple, var) -> tuple | None:
    """_KERNEL_LAYOUTS' entry of a routed-expert FP4 leaf held in the kernels' layout, else None."""
    m = re.search(r"\.experts\.([sw])[123]$", ".".join(map(str, path)))
    layout = _KERNEL_LAYOUTS[m.group(1)] if m else None
    return layout[1:] if layout and var.dtype == layout[0] and var.ndim >= 3 else None


def _stored_shape(layout: tuple, shape: tuple) -> tuple:
    """(the checkpoint's shape, dtype) of a leaf held in a kernel layout of shape `shape`."""
    *lead, n, k = shape
    return layout[2](*lead, n=n, k=k)


def _held_format(cfg: ModelConfig, name: str) -> str | None:
    """How `cfg` holds the official tensor `name`: "fp4" (routed experts, cfg.expert_weights), "fp8" (the
    release's FP8 matrices, cfg.dense_weights), "fp8_rows" ([V4.1] Engram tables, cfg.engram_tables) or None
    (dequantised to the model dtype)."""
    if cfg.expert_weights == "fp4" and _EXPERT.match(name):
        return "fp4"
    if cfg.dense_weights == "fp8" and quant_io.release_fp8(name):
        return "fp8"
    if cfg.engram_tables == "fp8" and _ENGRAM_TABLE.match(name):
        return "fp8_rows"
    return None


def _as_held(pair: dict[str, np.ndarray], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """One stored tensor (+ its scale) -> logical tensors. Tensors the model holds quantised keep their bytes
    when stored in that format (FP4: packed int8 + UE8M0 per 32; FP8: E4M3 + UE8M0 on the model's
    cfg.fp8_block grid) with UE8M0 scales (uint8 exponent bytes in memory); otherwise they are dequantised and
    quantised again (exact for weights that were in the format before). The rest are dequantised."""
    wname = next(n for n in pair if not n.endswith(".scale"))
    fmt = _held_format(cfg, wname)
    if fmt is None:
        yield from quant_io.dequantize_official(pair).items()
        return
    w = pair[wname]
    sname = wname[:-len(".weight")] + ".scale"
    scale = pair.get(sname)
    if fmt == "fp4":
        stored = w.dtype in (np.int8, np.uint8)
    else:
        grid = (tuple(-(-n // cfg.fp8_block) for n in w.shape) if fmt == "fp8" else
                (*w.shape[:-1], -(-w.shape[-1] // 32)))   # FP8 rows: one scale per 32 values of a row
        stored = w.dtype == quant_io.F8_E4M3 and scale is not None and np.shape(scale) == grid
    if stored and scale is not None and np.asarray(scale).dtype in (quant_io.F8_E8M0, np.uint8):
        w, qs = w.view(np.int8) if fmt == "fp4" else w, np.asarray(scale)
    else:
        (_, dense), = quant_io.dequantize_official(pair).items()
        quantize = {"fp4": quant_io.quantize_fp4, "fp8_rows": quant_io.quantize_fp8_rows,
                    "fp8": lambda d: quant_io.quantize_fp8_blocks(d, cfg.fp8_block)}[fmt]
        w, qs = quantize(dense)
    qs = qs.view(np.uint8)
    if fmt == "fp4" and qs.size and qs.max() > FP4_KERNEL_MAX_BYTE:
        warnings.warn(f"{sname}: FP4 scales up to 2^{int(qs.max()) - 127}; the model holds routed experts' FP4 "
                      "scales as bf16 with the Mosaic GPU kernels' decode fold (pallas_kernels.moe."
                      "fp4_kernel_scales), which holds scales up to 2: larger ones become NaN (the Triton kernels, "
                      "moe_experts(backend='triton'), take any scale from the checkpoint's bytes)", stacklevel=2)
    yield wname, w
    yield sname, qs


# ----------------------------------------------------------------------------- loading

def load_checkpoint(directory, dtype="bfloat16", mesh=None, token_map: np.ndarray | None = None,
                    check_finite: bool = True, **config_overrides) -> Transformer:
    """config.json + *.safetensors (official names, HF module names or transformers' default save) ->
    Transformer with weights in `dtype`.

    A checkpoint without any `mtp.*` tensors (HF `save_pretrained` drops MTP) loads with
    `num_mtp_layers = 0`. `config_overrides` set runtime options of the config (e.g.
    `engram_placement="host"`, `quant_sim=True`, `attention_impl="pallas"`). `token_map`: the V4.1
    Engram compressed-token map (required when the compressed vocab differs from the vocab).
    mesh: a (dp, ep, tp) mesh -> arrays born sharded (model/sharded.py's tables) and the mesh's runtime
    (model/runtime.py); each process reads only the routed experts its devices hold and hands each device
    only its slice of the rest.
    `check_finite`: raise on a NaN / inf weight or scale, naming the tensor (one pass over the weights;
    False skips it). Without a mesh, a model that cannot fit the device raises before anything is read
    (`model.footprint.check_fits`).
    """
    directory = Path(directory)
    cfg = ModelConfig.from_hf(directory)
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    names = [n for f in quant_io.list_checkpoint_files(directory) for n in quant_io.read_safetensors_header(f)[0]]
    if not names:
        raise ValueError(f"{directory}: checkpoint holds no tensors")
    if not any(official_name(n).startswith("mtp.") for n in names):
        cfg = cfg.replace(num_mtp_layers=0, compress_ratios=cfg.compress_ratios[:cfg.num_layers])
    if mesh is None:
        check_fits(cfg, dtype)
    items = _official_tensors(quant_io.iter_checkpoint_tensors(directory))
    if mesh is not None:  # before dequantisation: other processes' experts are never read
        items = local_expert_tensors(items, cfg, mesh)
    return build_from_tensors(cfg, _dequantised(items, cfg), dtype=dtype, source=str(directory),
                              token_map=token_map, mesh=mesh, check_finite=check_finite)


def _check_tensor(source: str, name: str, arr: np.ndarray, want: np.dtype, check_finite: bool) -> None:
    """A stored tensor against the parameter it fills: integer vs floating-point kind (an int or bool tensor
    where a float belongs is an error, not a cast) and, with `check_finite`, NaN / inf values (UE8M0 scale
    bytes: 255 is NaN)."""
    floating = jnp.issubdtype(want, jnp.floating)
    if floating != jnp.issubdtype(arr.dtype, jnp.floating) or (not floating and arr.dtype == np.bool_):
        kind = "a floating-point tensor" if floating else f"an integer tensor ({np.dtype(want)})"
        raise ValueError(f"{source}: tensor {name!r} is stored as {arr.dtype}, but the model holds {kind} there")
    if not check_finite:
        return
    if floating:
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
    elif name.endswith(".scale") and arr.dtype == np.uint8:
        bad = int(np.count_nonzero(arr == 255))
    else:
        return
    if bad:
        raise ValueError(f"{source}: tensor {name!r} holds {bad} non-finite value(s) (NaN / inf) of {np.size(arr)}; "
                         "load with check_finite=False to skip this check")


def build_from_tensors(cfg: ModelConfig, tensors, dtype="bfloat16", source: str = "<tensors>",
                       token_map: np.ndarray | None = None, mesh=None, check_finite: bool = True) -> Transformer:
    """Official-named logical tensors (iterable of (name, array) or a dict) -> Transformer.

    With a `mesh`, routed experts held by other processes' devices need not be given, the arrays are
    created sharded (model.sharded.place_loaded) and the model runs with the mesh's runtime. Each tensor is
    checked by `_check_tensor`.
    """
    if token_map is None and cfg.engram_layer_ids and cfg.engram_compressed_vocab_size != cfg.vocab_size:
        raise ValueError(f"{source}: this V4.1 checkpoint needs the tokenizer's Engram token map: pass "
                         "token_map=model.engram.token_map_from_texts([tokenizer.decode([i]) for i in ...])")
    runtime = None if mesh is None else make_runtime(cfg, mesh)   # a layout the mesh cannot hold raises here
    abstract = abstract_model(cfg, dtype, token_map=token_map, runtime=runtime)
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    expected: dict[str, tuple[int, int | None]] = {}  # name -> (leaf index, expert index)
    buffers: list[np.ndarray | None] = [None] * len(flat)
    # leaves held otherwise than stored: routed experts' FP4 weights and scales (_KERNEL_LAYOUTS) are read as the
    # checkpoint's bytes and converted once all experts are in
    held = {i: layout for i, (path, var) in enumerate(flat) if (layout := _kernel_layout(path, var))}
    stored = {i: _stored_shape(layout, tuple(flat[i][1].shape)) for i, layout in held.items()}
    for i, (path, var) in enumerate(flat):
        for name, index in official_entries(path, tuple(var.shape), cfg):
            expected[name] = (i, index)
    seen: set[str] = set()
    unexpected: list[str] = []
    items = tensors.items() if isinstance(tensors, dict) else tensors
    for name, arr in items:
        if name not in expected:
            unexpected.append(name)
            continue
        if name in seen:
            raise ValueError(f"{source}: tensor {name!r} appears twice")
        seen.add(name)
        i, index = expected[name]
        var = flat[i][1]
        shape, np_dtype = stored.get(i, (tuple(var.shape), np.dtype(var.dtype)))
        want = tuple(shape[len(index):])
        if tuple(arr.shape) != want:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {want}")
        _check_tensor(source, name, arr, np_dtype, check_finite)
        if not index:
            buffers[i] = np.asarray(arr).astype(np_dtype)
        else:
            if buffers[i] is None:
                buffers[i] = np.empty(shape, np_dtype)
            buffers[i][index] = np.asarray(arr).astype(np_dtype)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors (not in a {cfg.name} model): "
                         f"{sorted(unexpected)[:10]}{' ...' if len(unexpected) > 10 else ''}")
    elsewhere = set() if mesh is None else skipped_expert_names(expected, cfg, mesh)
    missing = sorted(set(expected) - seen - elsewhere)
    if missing:
        raise ValueError(f"{source}: missing tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    with jax.default_device(jax.devices("cpu")[0]):   # host buffers stay on the host
        for i, layout in held.items():
            buffers[i] = np.asarray(layout[0](buffers[i]))
    if mesh is not None:
        return place_loaded(graphdef, flat, buffers, mesh, cfg)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=HOST_MEMORY)
    leaves = [(path, var.replace(jax.device_put(buf, host) if host_resident(cfg, path_to_official(path)) else
                                 jnp.asarray(buf))) for (path, var), buf in zip(flat, buffers)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


# ----------------------------------------------------------------------------- saving

def official_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters under official names, experts unstacked: as held (dense in the model dtype;
    FP8 / FP4 weights with their scales as float8_e8m0fnu, the official scale dtype)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        arr = var[...]
        if layout := _kernel_layout(path, var):
            arr = layout[1](arr)
        arr = np.asarray(jax.device_get(arr))
        if m := _ENGRAM_TABLE.match(path_to_official(path)):
            arr = arr[:model.layers[int(m.group(1))].engram.embed.rows]   # a split table's padding rows dropped
        if arr.dtype == np.uint8:  # UE8M0 exponent bytes in memory
            arr = arr.view(quant_io.F8_E8M0)
        for name, index in official_entries(path, arr.shape, model.config):
            out[name] = arr[index] if index else arr
    return out


def save_safetensors(model: Transformer, directory, config: dict | None = None) -> Path:
    """Write config.json (official style) + model.safetensors with official names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (directory / "config.json").write_text(json.dumps(config or cfg.to_official_dict(), indent=1))
    quant_io.write_safetensors(directory / "model.safetensors", official_tensors(model))
    return directory


# ----------------------------------------------------------------------------- orbax

LAYOUT_FILE = "layout.json"  # {"scan_layers": bool}; a state without one holds every layer on its own

def save_orbax(model: Transformer, path) -> Path:
    """Save the model's nnx state with orbax (`path/state`) plus its config (`path/config.json`) and the state's
    layer layout (`path/layout.json`: ModelConfig.scan_layers, which shapes the state tree).

    The state is written as it is (parameter dtypes kept); `path` must not exist yet or be empty.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()  # orbax wants absolute paths
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"orbax checkpoint directory {path} exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_official_dict(), indent=1))
    (path / LAYOUT_FILE).write_text(json.dumps({"scan_layers": model.config.scan_layers}))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "state", nnx.state(model))
    checkpointer.wait_until_finished()
    return path


def restore_orbax(path, cfg: ModelConfig | None = None, dtype="bfloat16") -> Transformer:
    """Restore a `save_orbax` checkpoint into `abstract_model(cfg, dtype)`.

    `cfg` defaults to the saved `path/config.json` with the saved layer layout; a `cfg` of the other layout
    (scan_layers) raises ValueError. Parameters are cast to the abstract model's dtypes (so a float32
    checkpoint restores into bfloat16 and back).
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    state_dir = path / "state"
    if not state_dir.is_dir():
        raise FileNotFoundError(f"no orbax state at {state_dir} (written by save_orbax)")
    layout = path / LAYOUT_FILE
    scanned = json.loads(layout.read_text())["scan_layers"] if layout.exists() else False
    if cfg is None:
        cfg = ModelConfig.from_hf(path / "config.json").replace(scan_layers=scanned)
    elif cfg.scan_layers != scanned:
        raise ValueError(f"{path}: the state was saved with scan_layers={scanned}, the config asks for "
                         f"scan_layers={cfg.scan_layers}; restore with cfg.replace(scan_layers={scanned}) (or load "
                         "a safetensors checkpoint, which fills either layout)")
    graphdef, abstract_state = nnx.split(abstract_model(cfg, dtype))
    checkpointer = ocp.StandardCheckpointer()
    # Compare shapes first: a failed orbax restore leaves reads in flight and only says "error".
    want = {".".join(str(k) for k in key): tuple(var.shape)
            for key, var in nnx.to_flat_state(abstract_state)}
    have = _orbax_shapes(checkpointer, state_dir)
    if have is not None:
        where = f"{state_dir}: orbax state does not match a {cfg.name} model"
        missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing:
            raise ValueError(f"{where}: missing {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            raise ValueError(f"{where}: unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        for name, shape in want.items():
            if have[name] != shape:
                raise ValueError(f"{where}: {name!r} has shape {have[name]}, expected {shape}")
    try:
        state = checkpointer.restore(state_dir, abstract_state)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{state_dir}: orbax state does not match a {cfg.name} model "
                         f"({type(e).__name__}: {e})") from e
    return nnx.merge(graphdef, state)


def _orbax_shapes(checkpointer, state_dir: Path) -> dict[str, tuple[int, ...]] | None:
    """name -> shape of the arrays of a saved nnx state (None where its leaves carry no shapes)."""
    meta = checkpointer.metadata(state_dir)
    meta = getattr(meta, "item_metadata", meta)
    if meta is None:  # orbax logs a warning and gives nothing for a missing or unreadable _METADATA
        raise ValueError(f"{state_dir}: orbax metadata is missing or unreadable (_METADATA); "
                         "not a complete save_orbax checkpoint")
    flat = jax.tree_util.tree_flatten_with_path(meta)[0]
    out = {}
    for path, leaf in flat:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if keys and keys[-1] == "value":  # nnx Variables are saved as {'value': array}
            keys = keys[:-1]
        if not hasattr(leaf, "shape"):
            return None
        out[".".join(keys)] = tuple(leaf.shape)
    return out
