"""experiments/step_profile: kernels attributed to the model's components by the compiled program's op names."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from experiments import step_profile as sp

SYNTHETIC_HLO = """
HloModule jit_step, is_scheduled=true

%fused_computation.1 (p: bf16[8,16]) -> bf16[16,8] {
  %p = bf16[8,16]{1,0} parameter(0)
  ROOT %transpose.2 = bf16[16,8]{1,0} transpose(%p), dimensions={1,0}, metadata={op_name="jit(step)/moe/experts/dispatch/transpose"}
}

%command_buffer (a: bf16[8,16], b: bf16[16,16]) -> bf16[8,16] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,16]{1,0} parameter(1)
  %custom-call.7 = bf16[8,16]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/attention/proj/dot_general"}
  ROOT %custom-call.9 = bf16[8,16]{1,0} custom-call(%custom-call.7), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/moe/experts/pallas_call"}
}

ENTRY %main (x: bf16[8,16], w: bf16[16,16]) -> bf16[16,8] {
  %x = bf16[8,16]{1,0} parameter(0)
  %w = bf16[16,16]{1,0} parameter(1)
  %call.3 = bf16[8,16]{1,0} call(%x, %w), to_apply=%command_buffer
  %loop_transpose_fusion.4 = bf16[16,8]{1,0} fusion(%call.3), kind=kLoop, calls=%fused_computation.1
  ROOT %custom-call.11 = bf16[16,8]{1,0} custom-call(%loop_transpose_fusion.4), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/head/proj/dot_general"}
}
"""


def test_synthetic_program_attribution():
    info, order = sp.parse_hlo(SYNTHETIC_HLO)
    assert order == ["custom_call_7", "custom_call_9", "custom_call_11"]
    kernels = [("nvjet_sm90_tst_128x128", 1.0), ("body_mosaic_gpu_kernel", 3.0),
               ("loop_transpose_fusion_4", 0.5), ("sm90_xmma_gemm_bf16", 2.0), ("splitKreduce_kernel", 0.25)]
    rows = sp.attribute(kernels, info, order)
    got = [(r["component"], r["kind"]) for r in rows]
    assert got == [("attn_proj", "gemm"), ("moe_experts", "pallas"), ("router", "transpose"), ("head", "gemm"),
                   ("head", "gemm")]
    res = sp.summarise([rows, rows], wall_ms=8.0)
    assert res["kernel_ms_per_step"] == pytest.approx(6.75) and res["gap_ms"] == pytest.approx(1.25)
    assert res["components"]["head"]["ms"] == pytest.approx(2.25)
    assert res["kinds"]["transpose"] == pytest.approx(0.5)


def test_library_gemms_match_their_calls_when_our_kernels_launch_more():
    """A Mosaic GPU call that launches two kernels: the cuBLAS calls still meet their nvjet / xmma kernels."""
    info, order = sp.parse_hlo(SYNTHETIC_HLO)
    kernels = [("nvjet_sm90_tst_128x128", 1.0), ("body_mosaic_gpu_kernel", 3.0), ("body_mosaic_gpu_kernel", 3.0),
               ("sm90_xmma_gemm_bf16", 2.0)]
    rows = sp.attribute(kernels, info, order)
    assert [(r["component"], r["kind"]) for r in rows] == [("attn_proj", "gemm"), ("moe_experts", "pallas"),
                                                           ("moe_experts", "pallas"), ("head", "gemm")]


def test_mangled_library_gemms_and_cub_sorts_find_their_calls():
    """A cutlass GEMM under its C++-mangled name and a cub sort launching three kernels: each meets its call."""
    hlo = SYNTHETIC_HLO.replace('ROOT %custom-call.11 = bf16[16,8]{1,0} custom-call(%loop_transpose_fusion.4)',
                                '%custom-call.10 = bf16[16,8]{1,0} custom-call(%loop_transpose_fusion.4), '
                                'custom_call_target="__cub$DeviceRadixSort", metadata={op_name="jit(step)/attention/'
                                'indexer/top_k"}\n  ROOT %custom-call.11 = bf16[16,8]{1,0} custom-call(%custom-call.10)')
    info, order = sp.parse_hlo(hlo)
    assert order == ["custom_call_7", "custom_call_9", "custom_call_10", "custom_call_11"]
    kernels = [("_ZN7cutlass7Kernel2I50cutlass_gemm", 1.0), ("body_mosaic_gpu_kernel", 3.0),
               ("body_mosaic_gpu_kernel", 3.0), ("loop_transpose_fusion_4", 0.5), ("_ZN3cub6detail11RadixSortA", 0.1),
               ("_ZN3cub6detail11RadixSortB", 0.1), ("_ZN3cub6detail11RadixSortC", 0.1), ("nvjet_sm90_tst", 2.0)]
    rows = sp.attribute(kernels, info, order)
    assert [(r["component"], r["kind"]) for r in rows] == [
        ("attn_proj", "gemm"), ("moe_experts", "pallas"), ("moe_experts", "pallas"), ("router", "transpose"),
        ("indexer", "sort"), ("indexer", "sort"), ("indexer", "sort"), ("head", "gemm")]


def test_runtime_copies_serve_the_op_before_them():
    """The runtime's copy kernels (memcpy32_post, memcpy128) have no custom call of their own: our kernels still
    meet their calls (a Mosaic GPU attention kernel is not taken for the MoE's), and the copies join the op before
    them, inside a cub run too; a kernel XLA named after its instruction with a copy's suffix (`__1`) is found
    by it."""
    hlo = SYNTHETIC_HLO.replace('custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/moe/experts/'
                                'pallas_call"}', 'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/'
                                'attention/attn_core/pallas_call"}')
    hlo = hlo.replace('ROOT %custom-call.11 = bf16[16,8]{1,0} custom-call(%loop_transpose_fusion.4)',
                      '%custom-call.10 = bf16[16,8]{1,0} custom-call(%loop_transpose_fusion.4), '
                      'custom_call_target="__cub$DeviceRadixSort", metadata={op_name="jit(step)/attention/'
                      'indexer/top_k"}\n  ROOT %custom-call.11 = bf16[16,8]{1,0} custom-call(%custom-call.10)')
    info, order = sp.parse_hlo(hlo)
    kernels = [("nvjet_sm90_tst_128x128", 1.0), ("memcpy32_post", 0.01), ("body_mosaic_gpu_kernel", 3.0),
               ("loop_transpose_fusion_4__1", 0.5), ("_ZN3cub6detail11RadixSortA", 0.1), ("memcpy128", 0.01),
               ("_ZN3cub6detail11RadixSortB", 0.1), ("sm90_xmma_gemm_bf16", 2.0)]
    rows = sp.attribute(kernels, info, order)
    assert [(r["component"], r["kind"]) for r in rows] == [
        ("attn_proj", "gemm"), ("attn_proj", "copy"), ("attn_core", "pallas"), ("router", "transpose"),
        ("indexer", "sort"), ("indexer", "copy"), ("indexer", "sort"), ("head", "gemm")]


def test_counts_that_disagree_fall_back_to_kernel_names():
    info, order = sp.parse_hlo(SYNTHETIC_HLO)
    rows = sp.attribute([("sparse_mqa_sink", 1.0), ("indexer_scores", 1.0)], info, order)
    assert [r["component"] for r in rows] == ["attn_core", "indexer"]


def test_tiny_model_fusions_carry_components():
    """On the CPU program of a tiny model almost every fusion's op names reach a component of the model."""
    from model import ModelConfig, init_random
    from model.cache import allocate

    cfg = ModelConfig.preset("tiny-v4")
    graphdef, state = nnx.split(init_random(cfg, seed=0, dtype="bfloat16"))

    def step(state, cache, tokens):
        n_new = jnp.full(cache.lengths.shape, tokens.shape[1], jnp.int32)
        logits, cache, _ = nnx.merge(graphdef, state).step(tokens, cache, n_new)
        return logits, cache

    cache = jax.eval_shape(lambda: allocate(cfg, 2, 64))
    text = jax.jit(step).lower(state, cache, jax.ShapeDtypeStruct((2, 4), jnp.int32)).compile().as_text()
    info, _ = sp.parse_hlo(text)
    fusions = [i for i in info.values() if i["op"] == "fusion"]
    comps = [sp.component_of(i["op_name"]) for i in fusions]
    assert len(fusions) > 50
    assert comps.count("other") / len(comps) < 0.15, sorted(set(i["op_name"] for i in fusions if
                                                                 sp.component_of(i["op_name"]) == "other"))[:10]
    for name in ("moe_experts", "router", "shared_expert", "attn_proj", "attn_core", "indexer", "compressor", "mhc",
                 "head"):
        assert name in comps, name


def test_bare_kernel_lists_attribute_by_name():
    """Records with only kernel names: our kernels by their names, library GEMMs and XLA's kernels by kind."""
    kernels = {"steps": 3, "top": [["body_mosaic_gpu_kernel", 7.9, 8.0], ["sm90_xmma_gemm_f32f32", 2.4, 1.0],
                                   ["loop_convert_fusion_3", 1.3, 4.0], ["sparse_mqa_sink", 0.4, 2.0],
                                   ["moe_take_rows", 0.1, 4.0], ["wrapped_transpose", 0.3, 8.0]]}
    res = sp.from_kernel_names(kernels, wall_ms=14.0)
    assert res["components"]["moe_experts"]["ms"] == pytest.approx(7.9)
    assert res["components"]["router"]["ms"] == pytest.approx(0.1)
    assert res["components"]["attn_core"]["ms"] == pytest.approx(0.4)
    assert res["components"]["other"]["by_kind"] == {"gemm": 2.4, "convert": 1.3, "transpose": 0.3}
    assert res["gap_ms"] == pytest.approx(14.0 - 12.4)
