"""The warp-specialised Mosaic GPU skeleton that both MoE orientations (row tiles, swap_ab tiles) run.

`ws_kernel` is a grouped GEMM over a RoutePlan's tiles: a TMA warpgroup feeds `compute_wgs` compute warpgroups
(emit_pipeline_warp_specialized), or one warpgroup issues its own copies (emit_pipeline); a CTA per (tile,
output block) item, or persistent CTAs (one per SM) looping over the live items. The orientation supplies the
streamed operands, the per-step MMA and the epilogue (mgpu_rows.py, mgpu_swap.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def compiler_params():
    """Mosaic GPU compiler parameters of every MoE kernel."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    # Warpgroup semantics is the default in 0.11 and must be asked for in 0.10: one code path for both.
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def pipeline_depth(max_steps: int, nk: int, persistent: bool) -> tuple[int, int]:
    """(max_concurrent_steps, delay_release) for a K loop of nk steps. One wgmma group stays in flight, so
    its buffers are released one step late (delay 1, which needs >= 2 slots); a single step needs neither, and
    persistent CTAs (ws_kernel) release each step at once."""
    if nk <= 1:
        return 1, 0
    return max(2, min(max_steps, nk)), 0 if persistent else 1


SMEM_BYTES = 232448   # dynamic shared memory per CTA on the H100 / H200 (the limit the lowering reports)


def fit_steps(max_steps: int, stage_bytes: int, fixed_bytes: int) -> int:
    """Pipeline slots: max_steps, or fewer where that many [stage_bytes] slots and the kernel's fixed_bytes of
    SMEM (epilogue tiles) would not fit (2 at least; a config that does not fit fails at lowering)."""
    return max(2, min(max_steps, (SMEM_BYTES - fixed_bytes - 1024) // stage_bytes))


class Cta(NamedTuple):
    """What a compute warpgroup knows of its CTA: tile t, output block j, expert e = tile_expert[t],
    warpgroup wg, the tile's routed rows (tile_rows[t]) and the kernel's operand refs (GMEM)."""
    t: jax.Array
    j: jax.Array
    e: jax.Array
    wg: jax.Array
    rows: jax.Array
    operands: tuple


def ws_kernel(*, plan_arrays, operands, specs, cta_refs, mma, acc_shape, num_accs, epilogue, rw_axis, rw_slice,
               out_block, grid, wgs, specialized, persistent, nk, steps, out_shape, out_dtype, interpret,
               register_carry=False, out_t=False):
    """The grouped GEMM that both Mosaic GPU orientations (row tiles, swap_ab) run.

    Work item (t, j): tile t, output block j of grid (tiles, blocks) = (T, NB), taken in that order (j fastest),
    so the items of one tile run together and share its activations in L2: a CTA per item, or `persistent`
    (specialized only) one CTA per SM looping over the live tiles' items (num_tiles[0] of T, read in the
    kernel), whose memory warpgroup streams the next item's first K steps while the compute warpgroups finish
    the last one's epilogue (its TMA store is awaited only before its SMEM is written again). Item (t, j),
    expert e = tile_expert[t] (-1: nothing to do): the GMEM refs cta_refs(operands, t, j, e) are streamed, nk
    K steps of `specs`, by TMA into `steps` SMEM slots -- `specialized`: by a memory warpgroup
    (emit_pipeline_warp_specialized) for `wgs` compute warpgroups; otherwise the one warpgroup (wgs = 1)
    issues its own copies (emit_pipeline). Each compute
    warpgroup runs accs = mma(cta, k_step, tiles, accs) per step on num_accs float32 accumulators of acc_shape
    (wgmma accumulator refs; with register_carry, specialized only, float32 arrays carried from step to step),
    then epilogue(accs) [times the routing weights row_weight[rw_slice(t, wg)] broadcast along rw_axis,
    where plan_arrays holds them] -> SMEM (out_t: transposed) -> TMA store to out[out_block(t, j, wg)].
    plan_arrays: (tile_expert [T], tile_rows [T], num_tiles [1]) or (..., row_weight [P]).
    Persistent CTAs cannot let a wgmma outlive its K step (the next item's copies would refill its slot), so
    their callers' pipelines release each slot at once (delay_release=0, wgmma_wait(0)).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    n_plan = len(plan_arrays)
    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies
    # each warpgroup's routing weights start on a 128-byte boundary (a TMA destination's alignment)
    rw_len = acc_shape[rw_axis]
    rw_row = -(-rw_len // 32) * 32

    def pipeline(step, context):
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(nk,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=steps, compute_context=context)

    def body(*refs):
        (te_gmem, tr_gmem, nt_gmem, *rw_gmem), ops, out_gmem = refs[:n_plan], refs[n_plan:-1], refs[-1]

        def scope(allocs, out_smem, rw_smem, bar):
            wg = lax.axis_index("wg") if specialized else 0
            rw_s = rw_smem.at[wg, pl.ds(0, rw_len)]

            def work(t, j):
                cta = Cta(t, j, te_gmem[t], wg, tr_gmem[t], ops)

                def context(run):
                    if rw_gmem:
                        plgpu.copy_gmem_to_smem(rw_gmem[0].at[rw_slice(t, wg)], rw_s, bar.at[wg])

                    def accumulate(*acc_refs):
                        run(acc_refs)
                        return tuple(r[...] for r in acc_refs)

                    if register_carry:
                        accs = run(tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(num_accs)))
                    else:
                        accs = pl.run_scoped(accumulate, *[plgpu.ACC(acc_shape, jnp.float32)] * num_accs)
                    out = epilogue(accs)
                    if rw_gmem:   # layout inference gives the weights the WGMMA row / column layout of the broadcast
                        plgpu.barrier_wait(bar.at[wg])
                        out = out * lax.broadcast_in_dim(rw_s[...], acc_shape, [rw_axis])
                    out = out.astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last item's store has read the SMEM
                    if out_t and not interpret:   # a transposed SMEM view takes the accumulator's transposed
                        plgpu.transpose_ref(out_smem.at[wg], (1, 0))[...] = plgpu.layout_cast(   # register layout
                            out, plgpu.Layout.WGMMA_TRANSPOSED)
                    else:                         # (the MGPU interpreter has neither: it transposes the value)
                        out_smem.at[wg][...] = out.T if out_t else out
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[out_block(t, j, wg)])

                def step(idx, *rest):
                    return mma(cta, idx[0], rest[:-1], rest[-1])

                @pl.when(cta.e >= 0)
                def _():
                    streamed = cta_refs(ops, t, j, cta.e)
                    if specialized:
                        pipeline(step, context)(*streamed, allocations=allocs)
                    else:
                        context(lambda accs: plgpu.emit_pipeline(
                            lambda idx, *tiles: mma(cta, idx[0], tiles, accs), grid=(nk,), in_specs=specs,
                            max_concurrent_steps=steps)(*streamed))

            if persistent:   # the live tiles' items, interleaved over the SMs
                plgpu.nd_loop((nt_gmem[0], grid[1]), collective_axes="sm")(lambda item: work(*item.index))
            else:
                work(lax.axis_index("t"), lax.axis_index("n"))
            plgpu.wait_smem_to_gmem(0)

        scratch = (plgpu.SMEM((wgs, *(acc_shape[::-1] if out_t else acc_shape)), out_dtype),
                   plgpu.SMEM((wgs, rw_row), jnp.float32), plgpu.Barrier(num_barriers=wgs))
        if specialized:
            pl.run_scoped(scope, pipeline(ignore, ignore).get_allocations(*cta_refs(ops, 0, 0, 0)), *scratch,
                          collective_axes="wg")
        else:
            pl.run_scoped(functools.partial(scope, None), *scratch)

    if register_carry and not specialized:
        raise ValueError("moe (mgpu): without warp specialisation one warpgroup computes on wgmma accumulators; "
                         "FP8 x FP8 carries its totals in registers and needs a TMA warpgroup")
    launch = dict(grid=(num_sms(interpret),), grid_names=("sm",)) if persistent else dict(grid=grid,
                                                                                         grid_names=("t", "n"))
    if specialized:
        launch.update(num_threads=wgs + 1, thread_name="wg")
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), compiler_params=compiler_params(),
                        interpret=interpret, **launch)(*plan_arrays, *operands)


def num_sms(interpret) -> int:
    """Persistent CTAs: one per SM of the GPU (132 on the H100 / H200, also when lowering for CUDA on a CPU);
    the MGPU interpreter runs three, so that its tests interleave several items per CTA."""
    if interpret:
        return 3
    return getattr(jax.devices()[0], "core_count", 132) if jax.default_backend() == "gpu" else 132


def scale_scalar(s_gmem, e, r, c):
    """UE8M0 byte at s[e, r, c] (GMEM scalar) -> float32 2^(b-127). (exp2 of an integer is a power of two;
    Mosaic GPU cannot bitcast scalars.)"""
    return jnp.exp2(s_gmem[e, r, c].astype(jnp.float32) - 127.0)
