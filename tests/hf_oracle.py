"""HF-transformers oracle for jaxinfer's DeepSeek-V4-Flash (TINY-V4) tests.

Helper module (not a test file).  transformers 5.24.0, torch 2.13 (CPU), float32, eager attention.

    import hf_oracle as H   # tests/ on sys.path (pytest rootdir/conftest or sys.path.insert)
    from hf_oracle import hf_tiny_config, build_hf_model, save_hf_model, hf_logits, hf_greedy
    cfg = hf_tiny_config();  model = build_hf_model(cfg, seed=0)
    logits = hf_logits(model, tokens)            # [B,T] int -> [B,T,V] float32, no cache
    new    = hf_greedy(model, tokens, n_new)     # model.generate greedy with the DynamicCache
    names  = save_hf_model(model, "/tmp/ckpt")   # save_pretrained -> model.safetensors + config.json

Extra helpers: ``hf_prefill_decode_logits`` (prefill + teacher-forced 1-token decodes through the
cache), ``hf_greedy_reference`` (cache-free greedy), ``official_state_dict`` /
``save_official_checkpoint`` (same tensors under the official checkpoint names),
``discrete_margins`` / ``check_no_near_ties`` (smallest relative gap at every indexer top-k cut, every
router top-k cut and every logits argmax), ``first_near_ties`` (per batch row, the first position with a
near-tie at a top-k cut, in float64), ``perturb_weights_``.  ``python tests/hf_oracle.py`` runs
a self-check.

What the oracle was checked to do, the config / weight / checkpoint-name mappings and HF's semantic
differences from the official model: docs/hf_oracle.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from typing import Any

import numpy as np
import torch

__all__ = [
    "TINY_COMPRESS_RATIOS",
    "hf_tiny_config",
    "build_hf_model",
    "save_hf_model",
    "official_state_dict",
    "save_official_checkpoint",
    "hf_logits",
    "hf_prefill_decode_logits",
    "hf_greedy",
    "hf_greedy_reference",
    "discrete_margins",
    "first_near_ties",
    "check_no_near_ties",
    "perturb_weights_",
]

# Per-layer compress ratios of TINY-V4, including the trailing MTP slot (docs/model.md §0.4).
TINY_COMPRESS_RATIOS = (0, 0, 4, 16, 4, 0, 0)

_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' logger (the YaRN 'factor does not match max_pos/orig' warning)."""
    lg = logging.getLogger("transformers")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


def _ratios_to_layer_types(ratios, num_layers):
    ratios = list(ratios)[:num_layers]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"HF supports one HCA rate for all HCA layers, got {hca}")
    types = [_SWA if r == 0 else (_CSA if r == 4 else _HCA) for r in ratios]
    rates = {_CSA: 4, _HCA: hca[0] if hca else 128}
    return types, rates


def hf_tiny_config(**overrides: Any):
    """TINY-V4 as a transformers ``DeepseekV4Config``.

    ``overrides`` are passed to ``DeepseekV4Config`` (HF field names), except these
    official-style convenience keys which are translated first:
      * ``compress_ratios``  list (may include trailing MTP slot) -> ``layer_types`` + ``compress_rates``
        (0 -> sliding, 4 -> CSA (overlap compressor + indexer), any other r -> HCA with rate r),
      * ``num_hash_layers``  -> ``mlp_layer_types``,
      * ``qk_rope_head_dim`` -> ``partial_rotary_factor``,
      * ``yarn`` dict        -> replaces the YaRN sub-dict of ``rope_parameters``.
    """
    from transformers import DeepseekV4Config

    ov = dict(overrides)
    num_layers = ov.pop("num_hidden_layers", 6)
    head_dim = ov.pop("head_dim", 96)
    ratios = ov.pop("compress_ratios", TINY_COMPRESS_RATIOS)
    num_hash = ov.pop("num_hash_layers", 2)
    rope_dim = ov.pop("qk_rope_head_dim", 32)
    yarn = ov.pop(
        "yarn",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1},
    )
    layer_types, compress_rates = _ratios_to_layer_types(ratios, num_layers)
    kw = dict(
        vocab_size=256,
        hidden_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=head_dim,
        partial_rotary_factor=rope_dim / head_dim,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=8,
        layer_types=layer_types,
        compress_rates=compress_rates,
        mlp_layer_types=["hash_moe"] * min(num_hash, num_layers) + ["moe"] * max(0, num_layers - num_hash),
        compress_rope_theta=40000.0,
        rope_theta=10000.0,
        # flat YaRN dict: __post_init__ builds {"main": default(rope_theta), "compress": yarn(compress_rope_theta,
        # attention_factor=1.0)}
        rope_parameters=dict(yarn),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=10.0,
        hidden_act="silu",
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        use_cache=True,
    )
    kw.update(ov)
    with _quiet_transformers():
        cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


# ----------------------------------------------------------------------------------------------
# Model construction with non-trivial weights
# ----------------------------------------------------------------------------------------------


def _perturb_rule(name: str, t: torch.Tensor):
    """Return (kind, fn(normal_sample)->tensor) for a learned tensor, or None to skip."""
    leaf = name.rsplit(".", 1)[-1]
    if "rotary_emb" in name:  # inv_freq buffers: derived from config, not learned
        return None
    if leaf == "tid2eid":
        return "tid2eid", None
    if leaf in ("fn", "hc_fn"):
        return "hc_fn", lambda n: 0.05 * n
    if leaf in ("base", "hc_base"):
        return "hc_base", lambda n: 0.2 * n
    if leaf in ("scale", "hc_scale"):
        return "hc_scale", lambda n: 0.5 + 0.2 * n
    if leaf == "sinks":
        return "sink", lambda n: 0.5 * n
    if leaf == "e_score_correction_bias":
        return "gate_bias", lambda n: 0.3 * n
    if leaf == "position_bias":
        return "ape", lambda n: 0.1 * n
    if name.endswith("embed_tokens.weight"):
        return "embed", lambda n: 0.5 * n
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return "norm", lambda n: 1.0 + 0.1 * n
    if leaf in ("gate_up_proj", "down_proj") and t.dim() == 3:  # stacked experts [E, out, in]
        s = t.shape[-1] ** -0.5
        return "matrix", lambda n: s * n
    if leaf == "weight" and t.dim() == 2:
        s = t.shape[-1] ** -0.5
        return "matrix", lambda n: s * n
    raise ValueError(f"no perturbation rule for {name} {tuple(t.shape)}")


@torch.no_grad()
def perturb_weights_(model, seed: int = 0) -> dict[str, str]:
    """Overwrite every learned parameter / persistent buffer deterministically from ``seed``.

    Returns {name: kind}. Tensors are visited in sorted-name order with one torch.Generator,
    so the result depends only on (config, seed).
    """
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers()})
    kinds = {}
    for name in sorted(tensors):
        t = tensors[name]
        rule = _perturb_rule(name, t)
        if rule is None:
            continue
        kind, fn = rule
        kinds[name] = kind
        if kind == "tid2eid":
            V, k = t.shape
            n_exp = model.config.n_routed_experts
            perm = torch.argsort(torch.rand(V, n_exp, generator=g), dim=-1)[:, :k]
            t.copy_(perm.to(t.dtype))
            continue
        n = torch.randn(t.shape, generator=g, dtype=torch.float32)
        t.copy_(fn(n).to(t.dtype))
    return kinds


def build_hf_model(config=None, seed: int = 0):
    """``DeepseekV4ForCausalLM`` in float32 / eval / eager attention with all weights perturbed."""
    from transformers import DeepseekV4ForCausalLM

    if config is None:
        config = hf_tiny_config()
    with torch.random.fork_rng(devices=[]), _quiet_transformers():
        model = DeepseekV4ForCausalLM(config)
    model = model.to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    perturb_weights_(model, seed)
    return model


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


def save_hf_model(model, directory: str, original_format: bool = False) -> list[str]:
    """``model.save_pretrained(directory)`` as a single ``model.safetensors`` + config.json +
    generation_config.json. Returns the sorted list of tensor names written.

    original_format=False (default): pure HF module names (see docstring table, column 1),
      experts stacked ``mlp.experts.gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``.
    original_format=True: transformers' default ``save_original_format=True``, which runs the
      ``conversion_mapping['deepseek_v4']`` renames in reverse -> a *hybrid* naming
      (``model.layers.{l}.attn.wq_a.weight``, per-expert ``ffn.experts.{e}.w1.weight``, but
      ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, ``model.norm.weight``, ``head.weight``).
      Both reload with ``from_pretrained``.
    """
    from safetensors import safe_open

    os.makedirs(directory, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(directory, safe_serialization=True, save_original_format=original_format)
    names = []
    for fn in sorted(os.listdir(directory)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(directory, fn), framework="pt") as f:
                names.extend(f.keys())
    return sorted(names)


def official_state_dict(model) -> dict[str, torch.Tensor]:
    """HF model -> tensors under the official DeepSeek-V4 checkpoint names (docs/model.md §14),
    unquantised (fp32), no ``model.`` prefix, experts split per expert, no MTP tensors.
    Inverse of transformers' ``conversion_mapping['deepseek_v4']``."""
    out: dict[str, torch.Tensor] = {}
    sd = model.state_dict()
    I = model.config.moe_intermediate_size
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale",
    }
    sub = [  # (HF suffix inside layer, official suffix) - order matters (longest first)
        ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
        ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
        ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
        ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
        ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
        ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
        ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
        ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
        ("self_attn.compressor.position_bias", "attn.compressor.ape"),
        ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
        ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
        ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
        ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
        ("self_attn.kv_proj.weight", "attn.wkv.weight"),
        ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
        ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
        ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
        ("self_attn.sinks", "attn.attn_sink"),
        ("input_layernorm.weight", "attn_norm.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("attn_hc.fn", "hc_attn_fn"),
        ("attn_hc.base", "hc_attn_base"),
        ("attn_hc.scale", "hc_attn_scale"),
        ("ffn_hc.fn", "hc_ffn_fn"),
        ("ffn_hc.base", "hc_ffn_base"),
        ("ffn_hc.scale", "hc_ffn_scale"),
        ("mlp.gate.weight", "ffn.gate.weight"),
        ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
        ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
        ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
        ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
        ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ]
    for k, v in sd.items():
        if "rotary_emb" in k:
            continue
        if k in top:
            out[top[k]] = v.clone()
            continue
        assert k.startswith("model.layers."), k
        l, rest = k[len("model.layers.") :].split(".", 1)
        pre = f"layers.{l}."
        if rest == "mlp.experts.gate_up_proj":
            for e in range(v.shape[0]):
                out[pre + f"ffn.experts.{e}.w1.weight"] = v[e, :I].clone()
                out[pre + f"ffn.experts.{e}.w3.weight"] = v[e, I:].clone()
            continue
        if rest == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[pre + f"ffn.experts.{e}.w2.weight"] = v[e].clone()
            continue
        for a, b in sub:
            if rest == a:
                out[pre + b] = v.clone()
                break
        else:
            raise KeyError(f"unmapped HF key {k}")
    return out


def save_official_checkpoint(model, directory: str) -> list[str]:
    """Write ``official_state_dict(model)`` as ``model.safetensors`` + the HF config.json.
    ``DeepseekV4ForCausalLM.from_pretrained(directory)`` loads it through transformers'
    conversion mapping (used by the self-check to validate the key table)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    sd = {k: v.contiguous() for k, v in official_state_dict(model).items()}
    save_file(sd, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    return sorted(sd)


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def _ids(tokens) -> torch.Tensor:
    a = np.asarray(tokens)
    if a.ndim == 1:
        a = a[None]
    return torch.from_numpy(a.astype(np.int64))


@torch.no_grad()
def hf_logits(model, tokens, use_cache: bool = False) -> np.ndarray:
    """Full-sequence forward, [B,T] int -> [B,T,V] float32.

    use_cache=False (default) runs the stateless compressor path (no DynamicCache is created).
    use_cache=True runs the same one-shot prefill through a fresh DynamicCache (identical maths).
    """
    ids = _ids(tokens)
    out = model(input_ids=ids, use_cache=use_cache)
    return out.logits.float().numpy()


@torch.no_grad()
def hf_prefill_decode_logits(model, tokens, n_prefill: int) -> np.ndarray:
    """Teacher-forced incremental run: prefill tokens[:, :n_prefill] into a DynamicCache, then feed
    the remaining tokens one at a time. Returns the logits of every position, [B,T,V] float32."""
    from transformers import DynamicCache

    ids = _ids(tokens)
    B, T = ids.shape
    cache = DynamicCache(config=model.config)
    outs = []
    out = model(input_ids=ids[:, :n_prefill], cache=cache, use_cache=True)
    outs.append(out.logits)
    cache = out.cache
    for t in range(n_prefill, T):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        outs.append(out.logits)
        cache = out.cache
    return torch.cat(outs, dim=1).float().numpy()


@torch.no_grad()
def hf_greedy(model, tokens, n_new: int, return_logits: bool = False):
    """``model.generate`` greedy with the KV/compressor cache. [B,T] -> [B,n_new] int64.

    EOS is disabled (eos_token_id=None) so every row produces exactly n_new tokens and no logit is
    masked. With return_logits=True also returns the per-step raw logits [B,n_new,V] float32.
    """
    from transformers import GenerationConfig

    ids = _ids(tokens)
    gc = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=int(n_new),
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with _quiet_transformers():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    new = out.sequences[:, ids.shape[1] :].numpy()
    assert new.shape == (ids.shape[0], n_new), new.shape
    if return_logits:
        lg = torch.stack(out.logits, dim=1).float().numpy()
        return new, lg
    return new


@torch.no_grad()
def hf_greedy_reference(model, tokens, n_new: int) -> np.ndarray:
    """Cache-free greedy: re-runs the full forward (use_cache=False) for every new token."""
    ids = _ids(tokens)
    for _ in range(n_new):
        lg = model(input_ids=ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, lg.argmax(-1, keepdim=True)], dim=1)
    return ids[:, -n_new:].numpy()


# ----------------------------------------------------------------------------------------------
# Near-tie diagnostics for every discrete decision (indexer top-k, router top-k, argmax)
# ----------------------------------------------------------------------------------------------


def _cut_gaps(scores: torch.Tensor, valid: torch.Tensor, k: int):
    """Per row: relative gap between k-th and (k+1)-th valid score (rows with > k valid)."""
    s = scores.masked_fill(~valid, float("-inf"))
    nvalid = valid.sum(-1)
    rows = nvalid > k
    if not rows.any():
        return torch.empty(0), torch.empty(0)
    top = s[rows].topk(k + 1, dim=-1).values
    a, b = top[:, k - 1], top[:, k]
    gap = a - b
    rel = gap / torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    return gap, rel


@torch.no_grad()
def discrete_margins(model, tokens) -> dict[str, float]:
    """Run a cache-free forward and report the smallest relative margin at every discrete cut:

    * ``indexer_l{l}``: CSA indexer top-k cut (k-th vs (k+1)-th causally valid score), per layer,
    * ``router_l{l}``: score-routed MoE top-k cut on (sqrtsoftplus(logits) + bias),
    * ``argmax``: logits top-1 vs top-2 over all positions.
    A value ~1e-6 or below means the selection can flip under float32 reordering.
    """
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    ids = _ids(tokens)
    B, T = ids.shape
    rec: dict[str, list] = {}
    hooks = []
    for l, layer in enumerate(model.model.layers):
        comp = getattr(layer.self_attn, "compressor", None)
        if isinstance(comp, M.DeepseekV4CSACompressor):
            idx = comp.indexer

            def _h(mod, args, out, l=l, idx=idx):
                rec.setdefault(f"indexer_l{l}", []).append((out, idx.compress_rate, idx.index_topk))

            hooks.append(idx.scorer.register_forward_hook(_h))
        gate = layer.mlp.gate
        if isinstance(gate, M.DeepseekV4TopKRouter):

            def _g(mod, args, out, l=l, gate=gate):
                logits = out[0]
                rec.setdefault(f"router_l{l}", []).append(
                    (gate.score_fn(logits) + gate.e_score_correction_bias, gate.top_k)
                )

            hooks.append(gate.register_forward_hook(_g))
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    res = {}
    pos = torch.arange(T)
    for name, items in rec.items():
        rels = []
        for item in items:
            if name.startswith("indexer"):
                scores, r, k = item  # [B, T, n_entries]
                n_ent = scores.shape[-1]
                valid = torch.arange(n_ent)[None, None, :] < ((pos + 1) // r)[None, :, None]
                valid = valid.expand(B, T, n_ent)
                _, rel = _cut_gaps(scores, valid, k)
            else:
                sc, k = item
                _, rel = _cut_gaps(sc, torch.ones_like(sc, dtype=torch.bool), k)
            rels.append(rel)
        rel = torch.cat(rels)
        res[name] = float(rel.min()) if rel.numel() else float("inf")
    top2 = logits.topk(2, dim=-1).values
    res["argmax"] = float(((top2[..., 0] - top2[..., 1]) / top2[..., 0].abs().clamp_min(1e-30)).min())
    return res


@torch.no_grad()
def first_near_ties(model, tokens, bound: float = 1e-4) -> np.ndarray:
    """Per batch row, the first position with a near-tie at a top-k cut, computed in float64 (a copy of the model):
    a CSA indexer cut (k-th vs (k+1)-th causally valid score) or a score-routed MoE cut (on sqrtsoftplus /
    sigmoid(logits) + bias) whose gap is at most `bound` x the larger score (exact ties included, e.g. the
    all-zero scores of few indexer heads). Float32 noise may flip such a choice, and a flip at position p
    changes every later position (its KV), so a parity test compares rows before it. -> [B] int (T: none)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    m = copy.deepcopy(model).double()
    m.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    ids = _ids(tokens)
    B, T = ids.shape
    first = np.full(B, T)
    pos = torch.arange(T)

    def record(scores: torch.Tensor, valid: torch.Tensor, k: int):
        s = scores.masked_fill(~valid, float("-inf"))
        if s.shape[-1] <= k:
            return
        top = s.topk(k + 1, dim=-1).values
        a, b = top[..., k - 1], top[..., k]
        tie = torch.isfinite(b) & ((a - b) <= bound * torch.maximum(a.abs(), b.abs()))
        for row in range(B):
            at = torch.nonzero(tie[row]).flatten()
            if len(at):
                first[row] = min(first[row], int(at[0]))

    hooks = []
    for layer in m.model.layers:
        comp = getattr(layer.self_attn, "compressor", None)
        if isinstance(comp, M.DeepseekV4CSACompressor):
            idx = comp.indexer

            def _h(mod, args, out, idx=idx):
                n = out.shape[-1]
                valid = torch.arange(n)[None, None, :] < ((pos + 1) // idx.compress_rate)[None, :, None]
                record(out, valid.expand(B, T, n), idx.index_topk)

            hooks.append(idx.scorer.register_forward_hook(_h))
        gate = layer.mlp.gate
        if isinstance(gate, M.DeepseekV4TopKRouter):

            def _g(mod, args, out, gate=gate):
                sc = (gate.score_fn(out[0]) + gate.e_score_correction_bias).reshape(B, T, -1)
                record(sc, torch.ones_like(sc, dtype=torch.bool), gate.top_k)

            hooks.append(gate.register_forward_hook(_g))
    try:
        m(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return first


def check_no_near_ties(model, tokens, tol: float = 1e-5) -> dict[str, float]:
    """Assert every indexer / router top-k cut and every logits argmax has relative margin > tol."""
    m = discrete_margins(model, tokens)
    bad = {k: v for k, v in m.items() if not v > tol}
    assert not bad, f"near-ties (relative margin <= {tol}): {bad}"
    return m


# ----------------------------------------------------------------------------------------------
# Self-check: python tests/hf_oracle.py
# ----------------------------------------------------------------------------------------------


def _selfcheck(B: int = 2, T: int = 220, n_new: int = 12, seed: int = 0):  # pragma: no cover
    import tempfile
    import time

    t0 = time.perf_counter()
    cfg = hf_tiny_config()
    model = build_hf_model(cfg, seed=seed)
    t1 = time.perf_counter()
    rng = np.random.default_rng(1234)
    tokens = rng.integers(2, cfg.vocab_size, size=(B, T))
    lg = hf_logits(model, tokens)
    t2 = time.perf_counter()
    print(f"build {t1 - t0:.3f}s  forward B={B} T={T}: {t2 - t1:.3f}s  logits {lg.shape} finite={np.isfinite(lg).all()}")
    print(f"logit std {lg.std():.3f}  max|.| {np.abs(lg).max():.3f}")
    lg_c = hf_logits(model, tokens, use_cache=True)
    print("one-shot cached vs uncached max|d|:", float(np.abs(lg_c - lg).max()))
    print("margins:", json.dumps(discrete_margins(model, tokens), indent=None))
    t3 = time.perf_counter()
    inc = hf_prefill_decode_logits(model, tokens, n_prefill=T - 37)
    t4 = time.perf_counter()
    print(f"prefill {T - 37} + 37 decodes vs full: max|d| {np.abs(inc - lg).max():.3e}  ({t4 - t3:.2f}s)")
    g, glog = hf_greedy(model, tokens, n_new, return_logits=True)
    t5 = time.perf_counter()
    ref = hf_greedy_reference(model, tokens, n_new)
    t6 = time.perf_counter()
    print(f"generate {g.shape} ({t5 - t4:.2f}s) == cache-free greedy: {np.array_equal(g, ref)} ({t6 - t5:.2f}s)")
    top2 = np.sort(glog, axis=-1)[..., -2:]
    print("greedy step min relative top1-top2 margin:", float(((top2[..., 1] - top2[..., 0]) / np.abs(top2[..., 1])).min()))
    full = hf_logits(model, np.concatenate([tokens, g], axis=1))
    print("generate step logits vs full forward max|d|:", float(np.abs(glog - full[:, T - 1 : T - 1 + n_new]).max()))
    with tempfile.TemporaryDirectory() as d:
        from transformers import DeepseekV4ForCausalLM

        for mode in ("hf", "orig", "official"):
            dd = os.path.join(d, mode)
            if mode == "official":
                names = save_official_checkpoint(model, dd)
            else:
                names = save_hf_model(model, dd, original_format=(mode == "orig"))
            with _quiet_transformers():
                m2, info = DeepseekV4ForCausalLM.from_pretrained(dd, dtype=torch.float32, output_loading_info=True)
            m2.eval()
            same = all(torch.equal(v, m2.state_dict()[k]) for k, v in model.state_dict().items())
            d2 = float(np.abs(hf_logits(m2, tokens) - lg).max())
            miss = {k: sorted(v) for k, v in info.items() if v}
            print(f"save[{mode}]: {len(names)} tensors, reload bitwise-equal={same} issues={miss} logits max|d| {d2:.3e}")


if __name__ == "__main__":  # pragma: no cover
    _selfcheck()
