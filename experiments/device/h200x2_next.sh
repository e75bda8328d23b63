#!/usr/bin/env bash
# The GPU work left after the third session (docs/benchmarks.md "Not yet measured"), as nvidia-h200-x2 device
# calls of < 10 minutes each; run from the repo root: bash experiments/device/h200x2_next.sh 1..13
# (4: what 3 could not do -- V4.1 init ran out of memory, the CUPTI breakdown failed on a donated cache --
# after their fixes, and the f16-operand FP4 MMA that replaced the slower integer-only decoder; 5: what 1's
# time limit cut, the gather transport's block timing and realistic mode on the ep=2 mesh; and the whole
# MoE layer against its GEMM floors; 6 (fifth session): the FP4 Mosaic GPU swap kernels, then 5's runs;
# 7: why FP4 decode streams at 1.2 TB/s in two different kernels -- wider K steps, SASS, FP8/bf16 at narrow
# K steps -- and Triton vs Mosaic GPU at the prefill loads; 8: the table decode in inline PTX (kernel sweep,
# GPU tests) and the model with it (FP4) and with 128-row Triton prefill tiles (bf16); 9: one [bn, 32G]
# FP4 operand per step (32-token tiles for verify), the kernel sweep, V4 and V4.1 widths; 10: all MoE GPU
# tests, 32-token FP4 tiles at 1024 tokens, then part 5's two-GPU runs with room to finish; 11 (for the next
# session): FP4 prefill on the swap kernels and more Triton prefill tiles, the per-kernel split of the steps
# with this session's kernels, the bf16 LM head option, then the gather transport's block timing; 12 (sixth
# session): FP8 activations (act_quant) -- the GPU tests, FP8 x FP8 MMA prefill and decode sweeps -- and the
# model's FP4 prefill now that `auto` takes the Mosaic GPU swap kernels for it; 13 (one GPU is enough): the
# same act_quant tests and sweeps after the fix of the reference's FP8 rounding on the GPU, whose convert pair
# XLA had folded away -- experiments/probes/triton_fp8_dot.py found it); 14, 15 (seventh session): the Mosaic GPU
# attention kernel (pallas_kernels/attention_mgpu.py: GPU tests, kernel table, the model with it) and the MoE
# GPU tests after the transpose-kernel combine.
# Every script copies its results to $OUT; they are archived into one file at the end (a call returns at
# most 8 files).
set -u
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
B="python -m experiments.bench --quiet --mode deepinfer --moe-impl pallas --attention-impl pallas"
# Nsight Compute on the first Mosaic GPU kernel of one MoE expert block (experiments/probes/moe_profile_target.py;
# without preallocation: ncu's kernel replay saves and restores device memory): ncu_moe NAME TARGET-ARGS...
ncu_moe() {
    local name=$1; shift
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu -k regex:mosaic --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats \
        --section SourceCounters python -m experiments.probes.moe_profile_target --calls 1 "$@" \
        > "$OUT/ncu_$name.txt" 2>&1
    echo "== $name"
    grep -E "ERR|rror|Duration|Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Stall|L2 Hit|Executed Ipc A|Warp Cycles Per Issued" "$OUT/ncu_$name.txt" | head -40
}
# One plain FP4 swap_ab decode tiling as bench_moe --mgpu-configs JSON: swap_cfg BLOCK_M BLOCK_N BLOCK_K SLOTS
# (block_n / block_k for both GEMMs, no TMA warpgroup)
swap_cfg() {
    echo "{\"swap_ab\": true, \"warp_specialized\": false, \"block_m\": $1, \"block_n\": $2, \"block_n_down\": $2,
        \"block_k\": $3, \"block_k_down\": $3, \"max_concurrent_steps\": $4}"
}
# The gate's checks (seventeenth session): router_check LINES [TAG] -- the last LINES of
# experiments/probes/router_precision.py, the router and model GPU tests, the MoE layer (bf16, FP4) at prefill and
# decode, and with a TAG the 4-layer model's FP4 prefill step 2 x 4096 (part 69's command)
router_check() {
    export PYTHONUNBUFFERED=1
    timeout 100 python -m experiments.probes.router_precision 2>&1 | tail -"$1"
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "router or model_pallas" 2>&1 | tail -2
    timeout 150 python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick --impls layer \
        --formats bf16,fp4 --regime prefill,decode 2>&1 | grep -E "^\| (prefill|decode)|rror" | cut -c1-110
    if [ -n "${2:-}" ]; then
        timeout 130 $B --preset v4-flash-4l --expert-weights fp4 --phase prefill --prefill-batch 2 \
            --context 32768 --tag "$2" 2>&1 | tail -2
    fi
}
case "${1:?part 1 to 84}" in
1)  # issue 11: the EP / DP table with the gather transport, its block-level timing, realistic mode
    timeout 330 python -m experiments.sweep --spec experiments/sweeps/h200x2_ep.yaml --name h200x2-ep-gather \
        --quiet | tail -1
    timeout 120 python -m experiments.bench_ep --mesh 1,2,1 --expert-weights fp4 --transport gather | tail -8
    timeout 120 python -m experiments.sweep --spec experiments/sweeps/h200x2_ep.yaml --name h200x2-ep-gather \
        --mode realistic --phase decode --batch 64 --quiet | tail -1
    cp experiments/results/sweep_h200x2-ep-gather* "$OUT"/ ;;
2)  # issue 11: the full 43-layer V4-Flash in the release's formats on two GPUs
    timeout 560 $B --preset v4-flash --dense-weights fp8 --expert-weights fp4 --mesh 1,2,1 \
        --phase decode,prefill --batch 64,256 --prefill-batch 2 --context 32768 --time-budget 420 \
        --tag h200x2_full43 ;;
3)  # issue 10: V4.1 widths and a per-kernel step breakdown (GPU 0); issue 6: the two FP4 decoders (f16 bit trick vs integer-only bf16),
    # the lost FP4 prefill rows and the 43-layer verify compile (GPU 1)
    (export CUDA_VISIBLE_DEVICES=0
     timeout 400 $B --preset v41-flash --layers 4 --expert-weights fp4 --engram-vocab 160000 \
         --phase decode,prefill --batch 8,64,256 --prefill-batch 1 --context 4096,32768 --tag h200_v41_4l
     # issue 10: where the B1 prefill and B256 decode steps spend their time (CUPTI, per kernel)
     timeout 130 $B --phase decode,prefill --batch 256 --prefill-batch 1 --context 32768 --kernel-times 3 \
         --tag h200_kernels
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 150 python -m experiments.bench_moe --regime decode --formats fp4 --impls triton,xla
     timeout 150 $B --phase prefill --prefill-batch 1,4 --context 32768 --expert-weights fp4 --tag h200_fp4_prefill
     timeout 240 python -m experiments.compile_time --preset v4-flash --moe-impl pallas --attention-impl pallas \
         --expert-weights fp4 --steps verify
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    tail -n 4 "$OUT"/gpu0.log "$OUT"/gpu1.log ;;
4)  # issue 10: V4.1 widths and the per-kernel breakdown (GPU 0 / GPU 1); issue 6: FP4 MMA operands bf16 vs f16
    (export CUDA_VISIBLE_DEVICES=0
     timeout 330 $B --preset v41-flash --layers 4 --expert-weights fp4 --engram-vocab 160000 \
         --phase decode,prefill --batch 8,64,256 --prefill-batch 1 --context 4096,32768 --time-budget 280 \
         --tag h200_v41_4l
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 150 python -m experiments.bench_moe --regime decode --formats fp4 --impls triton
     timeout 170 $B --phase decode,prefill --batch 256 --prefill-batch 1 --context 32768 --kernel-times 3 \
         --tag h200_kernels
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    tail -n 4 "$OUT"/gpu0.log "$OUT"/gpu1.log ;;
5)  # issue 11: the gather transport's share of one MoE block, and realistic mode (real routing, speculative loop) on ep=2
    timeout 80 python -m experiments.bench_ep --mesh 1,2,1 --expert-weights fp4 --transport gather \
        --strategy all_to_all --tokens 64,256,2048 --repeats 10 | tail -6
    timeout 90 python -m experiments.bench --quiet --mode realistic --moe-impl pallas --attention-impl pallas \
        --expert-weights fp4 --mesh 1,2,1 --phase decode --batch 64 --context 32768 --tag h200x2_realistic_ep2
    # issue 6: the whole MoE layer (router, experts, shared expert, combine) against the sum of its GEMM floors
    CUDA_VISIBLE_DEVICES=0 timeout 150 python -m experiments.bench_moe --impls layer --formats bf16,fp4 \
        --routing balanced --iters 10 &
    # issue 10: the one-sequence prefill's experts (96 rows per expert) stream 2.97 TB/s on the Mosaic GPU row
    # tiles; which kernel / tiling streams them fastest at that load (GPU 1)
    CUDA_VISIBLE_DEVICES=1 timeout 150 python -m experiments.bench_moe --regime prefill --prefill-tokens 4096 \
        --formats bf16 --impls triton,mgpu --routing balanced --iters 10 &
    wait ;;
6)  # issue 6: FP4 weights decoded in registers on the Mosaic GPU swap_ab kernels -- GPU tests, then the decode
    # sweep against the Triton kernel and XLA (GPU 0, ptxas register report); part 5's single-GPU runs (GPU 1);
    # then part 5's two-GPU runs
    (export CUDA_VISIBLE_DEVICES=0
     timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe.py -k fp4
     MOSAIC_GPU_DUMP_PTXAS=1 timeout 220 python -m experiments.bench_moe --regime decode --formats fp4 \
         --impls xla,triton,mgpu --iters 10
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 150 python -m experiments.bench_moe --impls layer --formats bf16,fp4 --routing balanced --iters 10
     timeout 150 python -m experiments.bench_moe --regime prefill --prefill-tokens 4096 --formats bf16 \
         --impls triton,mgpu --routing balanced --iters 10
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -v "^ptxas\|^$" "$OUT"/gpu0.log | tail -n 30; tail -n 12 "$OUT"/gpu1.log
    timeout 70 python -m experiments.bench_ep --mesh 1,2,1 --expert-weights fp4 --transport gather \
        --strategy all_to_all --tokens 64,256,2048 --repeats 10 | tail -6
    timeout 80 python -m experiments.bench --quiet --mode realistic --moe-impl pallas --attention-impl pallas \
        --expert-weights fp4 --mesh 1,2,1 --phase decode --batch 64 --context 32768 --tag h200x2_realistic_ep2 ;;
7)  S='"block_m": 16, "swap_ab": true'
    FP4='[{'"$S"', "block_n": 128, "block_k": 128, "block_n_down": 128, "block_k_down": 128, "max_concurrent_steps": 4},
          {'"$S"', "block_n": 128, "block_k": 256, "block_n_down": 128, "block_k_down": 256, "max_concurrent_steps": 3},
          {'"$S"', "block_n": 64, "block_k": 256, "block_n_down": 64, "block_k_down": 256, "max_concurrent_steps": 4},
          {'"$S"', "block_n": 64, "block_k": 512, "block_n_down": 64, "block_k_down": 512, "max_concurrent_steps": 2},
          {'"$S"', "block_n": 128, "block_k": 64, "block_n_down": 128, "block_k_down": 64, "max_concurrent_steps": 6}]'
    NARROW='[{'"$S"', "block_n": 128, "block_k": 128, "block_n_down": 128, "block_k_down": 128, "max_concurrent_steps": 5},
             {'"$S"', "block_n": 128, "block_k": 64, "block_n_down": 128, "block_k_down": 64, "max_concurrent_steps": 6},
             {'"$S"', "block_n": 128, "block_k": 32, "block_n_down": 128, "block_k_down": 32, "max_concurrent_steps": 8},
             {'"$S"', "block_n": 128, "block_k": 16, "block_n_down": 128, "block_k_down": 16, "max_concurrent_steps": 8}]'
    M="python -m experiments.bench_moe --iters 10 --routing balanced"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe.py -k fp4
     timeout 150 $M --regime decode --decode-tokens 256 --formats fp4 --impls xla,mgpu --mgpu-configs "$FP4"
     MOSAIC_GPU_DUMP_SASS=1 timeout 60 $M --regime decode --decode-tokens 256 --formats fp4 --impls mgpu \
         --mgpu-configs "[$(echo "$FP4" | tail -n 1 | tr -d ']' | sed 's/^ *//')]" > "$OUT"/sass_fp4.txt 2>&1
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 100 $M --regime decode --decode-tokens 256 --formats fp8,bf16 --impls mgpu --mgpu-configs "$NARROW"
     timeout 200 $M --regime prefill --prefill-tokens 4096,8192 --formats bf16 --impls triton,mgpu
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -v "^ptxas\|^ *0 bytes\|^$" "$OUT"/gpu0.log | tail -n 25; grep "^decode\|^prefill\|Error" "$OUT"/gpu1.log ;;
8)  (export CUDA_VISIBLE_DEVICES=0
     timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe.py -k fp4
     timeout 240 python -m experiments.bench_moe --regime decode --formats fp4 --impls xla,triton,mgpu --iters 10
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 220 $B --phase decode,prefill --batch 8,64,256 --prefill-batch 1,4 --context 32768 \
         --expert-weights fp4 --tag h200_fp4_mgpu
     timeout 130 $B --phase prefill --prefill-batch 1,4 --context 32768 --tag h200_bf16_prefill_triton128
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -v "^ptxas\|^ *0 bytes\|^$" "$OUT"/gpu0.log | tail -n 40; tail -n 30 "$OUT"/gpu1.log ;;
9)  (export CUDA_VISIBLE_DEVICES=0
     timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe.py -k fp4
     timeout 240 python -m experiments.bench_moe --regime decode --decode-tokens 64,256,1024 --formats fp4 \
         --impls xla,triton,mgpu --iters 10
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 170 $B --phase decode --batch 8,64,256 --context 32768 --expert-weights fp4 --tag h200_fp4_mgpu_k32g
     timeout 190 $B --preset v41-flash --layers 4 --expert-weights fp4 --engram-vocab 160000 --phase decode \
         --batch 8,64,256 --context 32768 --tag h200_v41_4l_fp4_mgpu
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -v "^ptxas\|^ *0 bytes\|^$" "$OUT"/gpu0.log | grep "passed\|failed\|^|"; grep "^| decode" "$OUT"/gpu1.log ;;
10) S='"block_m": 32, "swap_ab": true'
    BM32='[{'"$S"', "block_n": 128, "block_k": 64, "block_n_down": 128, "block_k_down": 64, "max_concurrent_steps": 5},
           {'"$S"', "block_n": 256, "block_k": 64, "block_n_down": 256, "block_k_down": 64, "max_concurrent_steps": 4},
           {'"$S"', "block_n": 128, "block_k": 128, "block_n_down": 128, "block_k_down": 128, "max_concurrent_steps": 4}]'
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe.py
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 120 python -m experiments.bench_moe --regime decode --decode-tokens 1024 --formats fp4 --impls mgpu \
         --iters 10 --mgpu-configs "$BM32"
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep "passed\|failed" "$OUT"/gpu0.log; grep "^| decode" "$OUT"/gpu1.log
    export PYTHONUNBUFFERED=1
    timeout 150 python -m experiments.bench_ep --mesh 1,2,1 --expert-weights fp4 --transport gather \
        --strategy all_to_all --tokens 64,256,2048 --repeats 10 2>&1 | tee "$OUT"/bench_ep.log | tail -n 8
    timeout 170 python -m experiments.bench --quiet --mode realistic --moe-impl pallas --attention-impl pallas \
        --expert-weights fp4 --mesh 1,2,1 --phase decode --batch 64 --context 32768 --tag h200x2_realistic_ep2 \
        2>&1 | tee "$OUT"/realistic.log | grep "^| decode\|Error" ;;
11) (export CUDA_VISIBLE_DEVICES=0
     timeout 240 python -m experiments.bench_moe --regime prefill --prefill-tokens 4096,8192 --formats bf16,fp4 \
         --impls triton,mgpu --routing balanced --iters 10
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 170 $B --phase decode,prefill --batch 256 --prefill-batch 1 --context 32768 --kernel-times 3 \
         --tag h200_kernels
     timeout 120 $B --phase decode --batch 256 --context 32768 --expert-weights fp4 --kernel-times 3 \
         --tag h200_fp4_kernels
     timeout 90 $B --phase decode --batch 256 --context 32768 --head-dtype bfloat16 --tag h200_bf16_head
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep "^| prefill" "$OUT"/gpu0.log; grep "^| decode\|^| prefill" "$OUT"/gpu1.log
    export PYTHONUNBUFFERED=1
    timeout 150 python -m experiments.bench_ep --mesh 1,2,1 --expert-weights fp4 --transport gather \
        --strategy all_to_all --tokens 64,256,2048 --repeats 10 2>&1 | tee "$OUT"/bench_ep.log | tail -n 8 ;;
12) export PYTHONUNBUFFERED=1
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "act_quant or model_pallas"
     timeout 200 python -m experiments.bench_moe --regime prefill --prefill-tokens 4096,8192 --formats fp8 \
         --impls xla,triton --act-block 128 --routing balanced --iters 10
     timeout 120 python -m experiments.bench_moe --regime decode --decode-tokens 64,256 --formats fp8 \
         --impls triton,mgpu --act-block 128 --routing balanced --iters 10
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 240 $B --phase prefill --prefill-batch 1,4 --context 32768 --expert-weights fp4 --tag h200_fp4_prefill
     timeout 120 $B --phase decode --batch 64,256 --context 32768 --expert-weights fp4 --head-dtype bfloat16 \
         --tag h200_fp4_bf16_head
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep "passed\|failed\|^| prefill\|^| decode" "$OUT"/gpu0.log "$OUT"/gpu1.log ;;
13) export PYTHONUNBUFFERED=1
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "act_quant or rounding" 2>&1 | tail -3
    timeout 200 python -m experiments.bench_moe --regime decode --decode-tokens 64,256,1024 --formats fp8 \
        --impls xla,triton,mgpu --act-block 128 --routing balanced --iters 10 2>&1 | grep "^| decode"
    timeout 150 python -m experiments.bench_moe --regime prefill --prefill-tokens 8192 --formats fp8 \
        --impls triton --act-block 128 --routing balanced --iters 10 --quick 2>&1 | grep "^| prefill" ;;
14) # seventh session (one GPU is enough): the Mosaic GPU attention kernel -- its GPU tests first (a wrong
    # barrier count would hang: hence the timeouts), then its bench_kernels rows and the model with it; the
    # MoE GPU tests after the transpose-kernel combine / dispatch
    export PYTHONUNBUFFERED=1
    timeout 240 python -m pytest -q -m gpu tests/test_kernels_attention.py -k mgpu 2>&1 | tail -5
    timeout 300 python -m experiments.bench_kernels --only attention_decode,attention_prefill --out "$OUT" \
        2>&1 | grep -E "^\| (csa|hca)" | grep -E "pallas |mgpu"
    timeout 200 python -m pytest -q -m gpu tests/test_kernels_moe.py 2>&1 | tail -3 ;;
15) # the model with the Mosaic GPU attention and the MoE combine fix (FP4, verify and prefill)
    timeout 560 $B --preset v4-flash-4l --expert-weights fp4 --attention-impl mgpu --phase decode,prefill --step verify \
        --batch 64,256 --prefill-batch 1 --context 32768 --tag h200_mgpu_attention ;;
16) # eighth session: impl="pallas" takes the Mosaic GPU attention kernel from 64 rows (GPU tests: the kernels, the
    # bf16 V4-width layers, the dispatch), the MoE model test under "highest" precision, and where the Mosaic GPU
    # kernel's time goes (key list / HBM gather / own work: experiments/probes/mgpu_attention_limits.py)
    export PYTHONUNBUFFERED=1
    timeout 240 python -m pytest -q tests/test_kernels_attention.py -k "real_width or bf16 or pallas_impl" 2>&1 | tail -4
    timeout 100 python -m pytest -q -m gpu tests/test_kernels_moe.py -k model_pallas_moe 2>&1 | tail -3
    timeout 240 python -m experiments.probes.mgpu_attention_limits 2>&1 | tee "$OUT/probe_mgpu_attention_limits.md" \
        | grep "^|" ;;
17) # after 16: the key list as a cumsum scatter (was a stable argsort: 12.6 of 45.5 us at decode B64), the probe
    # passing its arrays as arguments (16's closed over the 8 GB caches as constants), the float32 model test
    export PYTHONUNBUFFERED=1
    timeout 140 python -m pytest -q -m gpu tests/test_kernels_attention.py -k "model_real_width or bf16" --tb=short \
        2>&1 | grep -E "^E |Error|passed|failed" | head -12
    timeout 300 python -m experiments.probes.mgpu_attention_limits 2>&1 | tee "$OUT/probe_mgpu_attention_limits.md" \
        | grep "^|" ;;
18) # for the ninth session: the indexer's MXFP4 keys and V4.1 candidate layers on the GPU (tests), then one
    # bench_kernels run of attention (key-list scatter; Triton / Mosaic GPU / XLA / built-ins) and the indexer
    # (bf16 / FP8 / FP4 keys) for issue 5's closing table
    export PYTHONUNBUFFERED=1
    timeout 200 python -m pytest -q -m gpu tests/test_kernels_attention.py -k "indexer or bf16" 2>&1 | tail -3
    timeout 380 python -m experiments.bench_kernels --only attention_decode,attention_prefill,indexer_decode \
        --out "$OUT" 2>&1 | grep -E "^\| (csa|hca|B)" | grep -E "triton|mgpu|pallas \||xla_gather|xla_reference" ;;
19) # for the ninth session: the index-key cache as MXFP4 rows at model level (V4-Flash widths, 4 layers, 128K
    # context where the indexer's key stream matters), against the bf16 key cache
    timeout 560 $B --preset v4-flash-4l --expert-weights fp4 --phase decode --step verify --batch 64 \
        --context 131072 --tag h200_index_keys_bf16 && \
    timeout 560 $B --preset v4-flash-4l --expert-weights fp4 --index-keys fp4 --phase decode --step verify \
        --batch 64 --context 131072 --tag h200_index_keys_fp4 ;;
20) # ninth session, nvidia-h200-x2 as two single-GPU streams: part 18's tests and kernel table on GPU 0, part 19's
    # two model runs on GPU 1 (each with a time budget, so both fit one call)
    export PYTHONUNBUFFERED=1
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 python -m pytest -q -m gpu tests/test_kernels_attention.py -k "indexer or bf16" 2>&1 | tail -3
     timeout 380 python -m experiments.bench_kernels --only attention_decode,attention_prefill,indexer_decode \
         --out "$OUT"
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     for keys in model fp4; do
         timeout 270 $B --preset v4-flash-4l --expert-weights fp4 --index-keys $keys --phase decode --step verify \
             --batch 64 --context 131072 --time-budget 200 --tag h200_index_keys_$keys
     done
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -E "passed|failed|rror|^\| (csa|hca|B)" "$OUT"/gpu0.log | head -70; tail -n 6 "$OUT"/gpu1.log ;;
21) # ninth session, two single-GPU streams: GPU 0 the indexer kernel's tile loop (`tiles` key tiles per program:
    # GPU tests, then the decode and prefill tile sweeps); GPU 1 issue 6's table in one run per regime (XLA,
    # jax's ragged_dot_mgpu, Triton, Mosaic GPU, the whole layer; bf16 / FP8 / FP4)
    export PYTHONUNBUFFERED=1
    (export CUDA_VISIBLE_DEVICES=0
     timeout 150 python -m pytest -q -m gpu tests/test_kernels_attention.py -k indexer 2>&1 | tail -3
     timeout 280 python -m experiments.bench_kernels --only indexer_decode --sweep --out "$OUT"
     timeout 130 python -m experiments.bench_kernels --only indexer_prefill --sweep --out "$OUT"
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 250 python -m experiments.bench_moe --regime decode --routing balanced --iters 10
     timeout 310 python -m experiments.bench_moe --regime prefill --routing balanced --iters 10
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -E "passed|failed|rror|^\| B" "$OUT"/gpu0.log | cut -c1-150 | head -80
    grep -E "^\| |rror|Timeout" "$OUT"/gpu1.log | cut -c1-200 | tail -40 ;;
22) # after 21 (the tile loop only for one-row decode, where it won; one tile per program otherwise, as before):
    # GPU 0 the indexer tests and tables again (decode sweep, prefill); GPU 1 every kernel GPU test
    export PYTHONUNBUFFERED=1
    (export CUDA_VISIBLE_DEVICES=0
     timeout 120 python -m pytest -q -m gpu tests/test_kernels_attention.py -k indexer 2>&1 | tail -3
     timeout 250 python -m experiments.bench_kernels --only indexer_decode --sweep --out "$OUT"
     timeout 120 python -m experiments.bench_kernels --only indexer_prefill --out "$OUT"
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 480 python -m pytest -q -m gpu tests/test_kernels_attention.py tests/test_kernels_moe.py 2>&1 | tail -8
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -E "passed|failed|rror|^\| B" "$OUT"/gpu0.log | cut -c1-140 | head -90; cat "$OUT"/gpu1.log ;;
23) # ninth session, the last device minutes: issue 11's ep=2 / dp=2 table again with the current kernels (Mosaic
    # GPU FP4 experts and attention, the combine fix); records are written as they finish
    timeout 420 python -m experiments.sweep --spec experiments/sweeps/h200x2_ep.yaml --name h200x2-ep-s9 --quiet \
        | tail -20
    cp experiments/results/sweep_h200x2-ep-s9* "$OUT"/ ;;
24) # for the tenth session (one GPU is enough): the indexer's heads_last score tile ([block_n, HI]: the head sum along
    # the MMA's rows, no cross-warp exchange; not yet run on a GPU) -- its GPU tests, then the decode sweep that
    # sets it against the measured defaults (one row: 16 x 64-key tiles; verify: one 128-key tile per program)
    export PYTHONUNBUFFERED=1
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_attention.py -k indexer 2>&1 | tail -3
    timeout 300 python -m experiments.bench_kernels --only indexer_decode --sweep --out "$OUT" 2>&1 \
        | grep -E "^\| B" | cut -c1-140 ;;
25) # for the tenth session (both GPUs): the dp=2 rows of the ninth session's ep=2 sweep (it resumes), then the
    # per-kernel times of ep=2 verify B256 (slower than in the fourth session: 16.82 -> 18.55 ms)
    timeout 330 python -m experiments.sweep --spec experiments/sweeps/h200x2_ep.yaml --name h200x2-ep-s9 --quiet \
        | tail -3
    cp experiments/results/sweep_h200x2-ep-s9* "$OUT"/
    timeout 200 $B --preset v4-flash-4l --expert-weights fp4 --mesh 1,2,1 --phase decode --batch 256 \
        --context 32768 --kernel-times 3 --tag h200x2_ep2_kernels ;;
26) # tenth session: GPU 0 part 24 (the indexer's heads_last tile); GPU 1 issue 6's warp-specialised Mosaic GPU row
    # tiles (pallas_kernels.moe._row_gemm: a TMA warpgroup + 2 or 3 compute warpgroups of 64 rows) -- their GPU
    # tests, then bf16 prefill at 8K tokens against Triton's 128-row tiles and jax's ragged_dot_mgpu
    export PYTHONUNBUFFERED=1
    (export CUDA_VISIBLE_DEVICES=0
     timeout 150 python -m pytest -q -m gpu tests/test_kernels_attention.py -k indexer 2>&1 | tail -3
     timeout 300 python -m experiments.bench_kernels --only indexer_decode --sweep --out "$OUT"
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 200 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "compiled and mgpu and bf16" 2>&1 | tail -4
     timeout 240 python -m experiments.bench_moe --regime prefill --formats bf16 --impls mgpu --routing balanced \
         --iters 10 --out "$OUT"
     timeout 120 python -m experiments.bench_moe --regime prefill --formats bf16 --impls triton,jax_mgpu --quick \
         --routing balanced --iters 10 --out "$OUT"
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -E "passed|failed|rror|^\| B" "$OUT"/gpu0.log | cut -c1-140 | head -60
    grep -E "passed|failed|^\| |rror|Timeout" "$OUT"/gpu1.log | cut -c1-220 | tail -40 ;;
27) # tenth session, after 26: GPU 0 the indexer with heads_last as every default (FP8 / FP4 keys and prefill were
    # not in 26's sweep), then the MoE Mosaic GPU GPU tests (both orientations now warp-specialised); GPU 1 the
    # swap_ab kernels with 1 / 2 / 4 compute warpgroups (FP4 / FP8 / bf16 decode, FP4 / FP8 prefill) and the
    # row tiles with the down projection's 256-column tiles (SMEM-fitted pipeline depth)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --out $OUT"
    sw() { echo "{\"swap_ab\": true, \"block_m\": $1, \"block_n\": $2, \"block_k\": $3, \"block_n_down\": $4, \"block_k_down\": $5, \"max_concurrent_steps\": $6, \"compute_wgs\": $7}"; }
    (export CUDA_VISIBLE_DEVICES=0
     timeout 150 python -m pytest -q -m gpu tests/test_kernels_attention.py -k indexer 2>&1 | tail -3
     timeout 150 python -m experiments.bench_kernels --only indexer_decode --out "$OUT"
     timeout 150 python -m experiments.bench_kernels --only indexer_prefill --sweep --out "$OUT"
     timeout 200 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "compiled and mgpu" 2>&1 | tail -4
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 100 $M --regime decode --formats fp4 --mgpu-configs "[$(sw 16 256 64 256 64 4 1), $(sw 16 256 64 256 64 4 2), $(sw 16 256 64 256 64 4 4), $(sw 16 128 64 128 64 6 2)]"
     timeout 80 $M --regime decode --formats fp8 --mgpu-configs "[$(sw 16 128 128 128 128 5 1), $(sw 16 128 128 128 128 5 2)]"
     timeout 80 $M --regime decode --formats bf16 --mgpu-configs "[$(sw 16 128 64 256 64 6 1), $(sw 16 128 64 256 64 6 2), $(sw 16 256 64 256 64 6 4)]"
     timeout 100 $M --regime prefill --formats fp4 --mgpu-configs "[$(sw 128 64 64 64 64 4 1), $(sw 128 128 64 128 64 4 2), $(sw 64 128 64 128 64 4 2)]"
     timeout 80 $M --regime prefill --formats fp8 --mgpu-configs "[$(sw 128 64 128 128 128 4 1), $(sw 128 128 128 128 128 4 2)]"
     timeout 80 $M --regime prefill --formats bf16 --mgpu-configs '[{"block_m": 128, "compute_wgs": 2, "block_n": 128, "block_k": 64, "block_n_down": 256, "block_k_down": 64, "max_concurrent_steps": 4}, {"block_m": 128, "compute_wgs": 2, "block_n": 128, "block_k": 64, "block_n_down": 128, "block_k_down": 64, "max_concurrent_steps": 4}]'
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -E "passed|failed|rror|^\| B" "$OUT"/gpu0.log | cut -c1-140 | head -60
    grep -E "^\| (decode|prefill)|rror|Timeout" "$OUT"/gpu1.log | cut -c1-330 | tail -40 ;;
28) # after 27 (the routing weights' SMEM rows now 128-byte aligned: 27's 16-token tiles with 2+ compute warpgroups
    # hit CUDA_ERROR_MISALIGNED_ADDRESS): GPU 0 every MoE GPU test, then the whole layer at the new defaults;
    # GPU 1 the swap_ab decode kernels with 1 / 2 / 4 compute warpgroups, and prefill at 4K tokens
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT"
    sw() { echo "{\"swap_ab\": true, \"block_m\": $1, \"block_n\": $2, \"block_k\": $3, \"block_n_down\": $4, \"block_k_down\": $5, \"max_concurrent_steps\": $6, \"compute_wgs\": $7}"; }
    (export CUDA_VISIBLE_DEVICES=0
     timeout 300 python -m pytest -q -m gpu tests/test_kernels_moe.py 2>&1 | tail -4
     timeout 250 $M --regime prefill,decode --formats bf16,fp4 --impls layer
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 100 $M --impls mgpu --regime decode --formats fp4 --mgpu-configs "[$(sw 16 256 64 256 64 4 1), $(sw 16 256 64 256 64 4 2), $(sw 16 256 64 256 64 4 4), $(sw 16 128 64 128 64 6 2)]"
     timeout 80 $M --impls mgpu --regime decode --formats fp8 --mgpu-configs "[$(sw 16 128 128 128 128 5 1), $(sw 16 128 128 128 128 5 2)]"
     timeout 80 $M --impls mgpu --regime decode --formats bf16 --mgpu-configs "[$(sw 16 128 64 256 64 6 1), $(sw 16 128 64 256 64 6 2), $(sw 16 256 64 256 64 6 4)]"
     timeout 200 $M --impls triton,mgpu --regime prefill --prefill-tokens 4096 --formats bf16,fp8,fp4 --quick
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -E "passed|failed|^\| (decode|prefill)|rror" "$OUT"/gpu0.log | cut -c1-200 | head -30
    grep -E "^\| (decode|prefill)|rror|Timeout" "$OUT"/gpu1.log | grep -v "^E1" | cut -c1-330 | tail -40 ;;
29) # after 28 (decode back on one warpgroup issuing its own copies, MgpuConfig.warp_specialized=False): GPU 0 the
    # Mosaic GPU MoE GPU tests, the FP4 decode sweep (that default vs 4 warp-specialised compute warpgroups) and
    # the FP4 layer; GPU 1 the model's FP4 prefill and verify at the new defaults (the ep=2 sweep's 1-GPU rows)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu" 2>&1 | tail -4
     timeout 120 $M --impls mgpu --regime decode --formats fp4 --decode-tokens 64,256,1024 --mgpu-configs '[{"swap_ab": true, "block_m": 16, "block_n": 256, "block_k": 64, "block_n_down": 256, "block_k_down": 64, "max_concurrent_steps": 4, "warp_specialized": false}, {"swap_ab": true, "block_m": 16, "block_n": 256, "block_k": 64, "block_n_down": 256, "block_k_down": 64, "max_concurrent_steps": 4, "compute_wgs": 4}]'
     timeout 100 $M --impls layer --regime decode --formats fp4
    ) > "$OUT"/gpu0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 280 $B --preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 --prefill-batch 2 \
         --context 32768 --new-tokens 4096 --step verify --tag s10_fp4_defaults
    ) > "$OUT"/gpu1.log 2>&1 &
    wait
    grep -E "passed|failed|^\| (decode|prefill)|rror" "$OUT"/gpu0.log | grep -v "^E1" | cut -c1-300 | head -30
    tail -25 "$OUT"/gpu1.log | cut -c1-250 ;;
30) # the Mosaic GPU MoE GPU tests at the final defaults (29's run was cut by its time limit after 21 passed)
    timeout 280 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu" 2>&1 | tail -4 ;;
31) # for the eleventh session (one GPU is enough): the FP8 x FP8 Mosaic GPU row tiles (act_quant'd activations,
    # per-block promotion into register totals; CPU-tested and lowered, never run on a GPU) -- their GPU tests,
    # then FP8 prefill at 4K / 8K tokens against the swap_ab default and Triton's FP8 MMA (issue 6: >= 700 TFLOP/s)
    export PYTHONUNBUFFERED=1
    timeout 200 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "act_quant" 2>&1 | tail -4
    timeout 300 python -m experiments.bench_moe --regime prefill --formats fp8 --act-block 128 --impls mgpu,triton \
        --prefill-tokens 4096,8192 --routing balanced --iters 10 --out "$OUT" 2>&1 | grep -E "^\| prefill|rror" ;;
32) # eleventh session (one GPU): what limits the FP4 decode and the FP8 x FP8 prefill kernels -- Nsight Compute
    # (found on the lent machine this session) on each kernel, the Mosaic GPU SASS-dump switches the CUDA plugin
    # knows, and the XLA glue around the prefill kernels (experiments/probes/moe_prefill_glue.py)
    export PYTHONUNBUFFERED=1
    for so in $(python -c "import jax_plugins, os; print(os.path.dirname(jax_plugins.__file__))" 2>/dev/null)/*/*.so \
        $(python -c "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))")/mosaic/gpu/*.so; do
        strings "$so" 2>/dev/null | grep -o "MOSAIC_GPU_DUMP[A-Z_]*"; done | sort -u
    timeout 120 python -m experiments.probes.moe_prefill_glue 2>&1 | tail -9
    S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats --section SourceCounters"
    timeout 200 ncu -k regex:mosaic --launch-count 2 $S python -m experiments.probes.moe_profile_target --format fp4 \
        --tokens 256 --calls 1 > "$OUT"/ncu_fp4_decode.txt 2>&1
    timeout 200 ncu -k regex:mosaic --launch-count 2 $S python -m experiments.probes.moe_profile_target --format fp8 \
        --tokens 8192 --act-block 128 --calls 1 --config '{"block_m": 128, "block_n": 64, "block_k": 128, "block_n_down": 128, "block_k_down": 128, "max_concurrent_steps": 6, "compute_wgs": 2}' \
        > "$OUT"/ncu_fp8_prefill.txt 2>&1
    MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 timeout 100 python -m experiments.probes.moe_profile_target \
        --format fp4 --tokens 256 --calls 1 > "$OUT"/sass_fp4_decode.txt 2>&1; wc -l "$OUT"/sass_fp4_decode.txt
    for f in "$OUT"/ncu_*.txt; do echo "== $f"; grep -E "ERR|rror|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Stall|Shared Memory Configuration Size|Dynamic Shared|L2 Hit|Executed Ipc A|Warp Cycles Per Issued" "$f" | head -60; done ;;
33) # after 32 (ncu failed on a preallocated GPU; nvdisasm was not where Mosaic GPU looked): the new act_quant_rows
    # kernel and FP8 x FP8 row default's GPU tests, FP8 / bf16 prefill at the defaults (uint32 row gathers),
    # Nsight Compute without preallocation, the FP4 decode kernel's SASS
    export PYTHONUNBUFFERED=1
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "act_quant or take_rows" 2>&1 | tail -3
    timeout 150 python -m experiments.bench_moe --regime prefill --formats fp8 --act-block 128 --impls mgpu --quick \
        --prefill-tokens 4096,8192 --routing balanced --iters 10 --out "$OUT" 2>&1 | grep -E "^\| prefill|rror"
    timeout 100 python -m experiments.bench_moe --regime prefill --formats bf16 --impls mgpu --quick \
        --routing balanced --iters 10 --out "$OUT" 2>&1 | grep -E "^\| prefill|rror"
    ncu_moe fp4_decode --format fp4 --tokens 256
    ncu_moe fp8_prefill --format fp8 --tokens 8192 --act-block 128
    MOSAIC_GPU_DUMP_SASS=1 timeout 100 python -m experiments.probes.moe_profile_target --format fp4 --tokens 256 \
        --calls 1 --cuda-root /usr/local/cuda > "$OUT"/sass_fp4_decode.txt 2>&1; wc -l "$OUT"/sass_fp4_decode.txt ;;
34) # after 33 (bench_moe's FP8 act-block sweep now starts with the FP8 x FP8 row default; the profiler target's
    # import fixed): FP8 prefill at the defaults and the swap kernels, then Nsight Compute on the FP4 decode
    # and FP8 x FP8 prefill kernels
    export PYTHONUNBUFFERED=1
    timeout 200 python -m experiments.bench_moe --regime prefill --formats fp8 --act-block 128 --impls mgpu \
        --prefill-tokens 4096,8192 --routing balanced --iters 10 --out "$OUT" 2>&1 | grep -E "^\| prefill|rror"
    ncu_moe fp4_decode --format fp4 --tokens 256
    ncu_moe fp8_prefill --format fp8 --tokens 8192 --act-block 128 ;;
35) # after 34 (Nsight Compute: the FP4 decode kernel is bound by the integer ALU pipe; its scales now enter as
    # bf16, converted in the transpose XLA runs anyway): the FP4 Mosaic GPU GPU tests, FP4 decode / prefill at
    # the defaults, the whole layer (bf16 / FP4, both regimes)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT"
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4" 2>&1 | tail -3
    timeout 90 $M --impls mgpu --regime decode --formats fp4 --decode-tokens 64,256,1024 --quick 2>&1 | grep -E "^\| decode|rror"
    timeout 90 $M --impls mgpu --regime prefill --formats fp4 --quick 2>&1 | grep -E "^\| prefill|rror"
    timeout 200 $M --impls layer --regime prefill,decode --formats bf16,fp4 2>&1 | grep -E "^\| (decode|prefill)|rror" ;;
36) # after 35 (FP4 swap path: the activations' K reorder moved before the row gather): the FP4 Mosaic GPU GPU tests,
    # FP4 prefill and its layer; FP8 x FP8 row tiles with three compute warpgroups (192 rows)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT"
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4" 2>&1 | tail -3
    timeout 90 $M --impls mgpu --regime prefill --formats fp4 --quick 2>&1 | grep -E "^\| prefill|rror"
    timeout 120 $M --impls layer --regime prefill,decode --formats fp4 2>&1 | grep -E "^\| (decode|prefill)|rror"
    r() { echo "{\"block_m\": $1, \"compute_wgs\": $2, \"block_n\": $3, \"block_k\": 128, \"block_n_down\": $4, \"block_k_down\": 128, \"max_concurrent_steps\": $5}"; }
    timeout 150 $M --impls mgpu --regime prefill --formats fp8 --act-block 128 --mgpu-configs "[$(r 192 3 64 128 4), $(r 192 3 64 64 4), $(r 128 2 64 64 6)]" 2>&1 | grep -E "^\| prefill|rror" ;;
37) # after 36 (FP8 x FP8 row tiles of 192 rows, three compute warpgroups: 8K tokens 3.42 ms = 724 TFLOP/s, balanced
    # routing = 192 rows per expert, one unpadded tile each): their GPU tests; 192-row tiles against 128 under
    # random routing and at 4K tokens, for FP8 x FP8 and bf16 rows (64 columns: three warpgroups leave 152
    # registers per thread) and the FP4 swap kernels (192 tokens per tile)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --iters 10 --out $OUT"
    timeout 100 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "gpu_act_quant and fp8" 2>&1 | tail -3
    r() { echo "{\"block_m\": $1, \"compute_wgs\": $2, \"block_n\": $3, \"block_k\": $4, \"block_n_down\": $5, \"block_k_down\": $4, \"max_concurrent_steps\": $6}"; }
    timeout 140 $M --impls mgpu --regime prefill --formats fp8 --act-block 128 --routing balanced,random --prefill-tokens 4096,8192 \
        --mgpu-configs "[$(r 192 3 64 128 128 4), $(r 128 2 64 128 128 6)]" 2>&1 | grep -E "^\| prefill|rror"
    timeout 140 $M --impls mgpu --regime prefill --formats bf16 --routing balanced,random \
        --mgpu-configs "[$(r 192 3 64 64 128 4), $(r 192 3 64 64 256 3), $(r 128 2 128 64 256 4)]" 2>&1 | grep -E "^\| prefill|rror"
    sw() { echo "{\"swap_ab\": true, \"block_m\": $1, \"block_n\": 128, \"block_k\": 64, \"block_n_down\": 128, \"block_k_down\": 64, \"max_concurrent_steps\": $2, \"compute_wgs\": 2}"; }
    timeout 120 $M --impls mgpu --regime prefill --formats fp4 --routing balanced,random \
        --mgpu-configs "[$(sw 192 3), $(sw 128 4)]" 2>&1 | grep -E "^\| prefill|rror" ;;
38) # after 37: default_config(balanced=True) takes 192-row tiles at 192 rows per expert (forced balance): the GPU
    # tests of those defaults, then the whole layer (benchmark mode) at prefill, bf16 and FP4
    export PYTHONUNBUFFERED=1
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "balanced192" 2>&1 | tail -3
    timeout 200 python -m experiments.bench_moe --routing balanced --iters 10 --out "$OUT" --impls layer \
        --regime prefill --formats bf16,fp4 2>&1 | grep -E "^\| (decode|prefill)|rror" ;;
39) # for the twelfth session (one GPU): the FP4 swap kernels' exponent-field decode (MgpuConfig(fp4_decode=
    # "exponent"): ~5 instead of ~8 integer-ALU instructions per 4 weights; CPU-checked and lowered, never run) --
    # its GPU tests (the +-0.5 codes are bf16 subnormals there), then FP4 decode / prefill against the table decode
    # and Nsight Compute on its decode kernel
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4 --out $OUT"
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "exponent or half_codes" 2>&1 | tail -3
    timeout 150 $M --regime decode --decode-tokens 64,256,1024 2>&1 | grep -E "^\| decode|rror"
    timeout 120 $M --regime prefill 2>&1 | grep -E "^\| prefill|rror"
    ncu_moe fp4_decode_exponent --format fp4 --tokens 256 --config '{"block_m": 16, "block_n": 256, "block_k": 64, "block_n_down": 256, "block_k_down": 64, "max_concurrent_steps": 4, "swap_ab": true, "warp_specialized": false, "fp4_decode": "exponent"}' ;;
40) # twelfth session, after 39 (exponent decode: gate/up kernel 1.088 -> 0.951 ms, but each FP4 weight's per-call
    # scale transpose had become three fusions, ~0.2 ms each): the "multiply" decode's GPU tests, FP4 decode with
    # the three decodes at the default tiles, the scale-preparation probe, and the three decodes' SASS opcodes
    export PYTHONUNBUFFERED=1
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "multiply or half_codes" 2>&1 | tail -3
    C='{"swap_ab": true, "block_m": 16, "block_n": 256, "block_k": 64, "block_n_down": 256, "block_k_down": 64, "max_concurrent_steps": 4, "warp_specialized": false, "fp4_decode": "'
    timeout 150 python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4 --out "$OUT" \
        --regime decode --decode-tokens 64,256 --mgpu-configs "[${C}table\"}, ${C}exponent\"}, ${C}multiply\"}]" \
        2>&1 | grep -E "^\| decode|rror"
    timeout 100 python -m experiments.probes.moe_fp4_scales 2>&1 | tail -14
    for d in table exponent multiply; do
        MOSAIC_GPU_DUMP_SASS=1 timeout 100 python -m experiments.probes.moe_profile_target --format fp4 --tokens 256 \
            --calls 1 --cuda-root /usr/local/cuda --config "${C}$d\"}" > "$OUT/sass_fp4_decode_$d.txt" 2>&1
        echo "== $d"; python -m experiments.probes.sass_opcodes "$OUT/sass_fp4_decode_$d.txt" --top 14
    done ;;
41) # after 40 ("multiply" decode no faster than "exponent" although 128 fewer instructions per step: the gate/up
    # kernel is not bound by decode instructions; the scale conversion's NaN selects split it into three fusions):
    # FP4 weights streamed as one TMA box per K step (fp4_step_box; 16-byte rows before) -- GPU tests, FP4 decode
    # and prefill; the scale conversion's variants
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4 --out $OUT"
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "step_box" 2>&1 | tail -3
    C='{"swap_ab": true, "block_m": 16, "warp_specialized": false, "fp4_decode": "exponent", '
    D1='"block_n": 256, "block_k": 64, "block_n_down": 256, "block_k_down": 64, "max_concurrent_steps": 4'
    D2='"block_n": 128, "block_k": 128, "block_n_down": 128, "block_k_down": 128, "max_concurrent_steps": 4'
    D3='"block_n": 128, "block_k": 128, "block_n_down": 128, "block_k_down": 128, "max_concurrent_steps": 6'
    S='"fp4_step_box": true}'
    timeout 200 $M --regime decode --decode-tokens 64,256 \
        --mgpu-configs "[${C}${D1}}, ${C}${D1}, $S, ${C}${D2}, $S, ${C}${D3}, $S]" 2>&1 | grep -E "^\| decode|rror"
    P=$(python -c 'import dataclasses as d, json; from pallas_kernels import moe
c = moe.default_config("mgpu", 49152, 256, "fp4", balanced=True)
print(json.dumps([d.asdict(c), d.asdict(d.replace(c, fp4_step_box=True)),
                  d.asdict(d.replace(c, fp4_step_box=True, fp4_decode="exponent"))]))')
    timeout 150 $M --regime prefill --mgpu-configs "$P" 2>&1 | grep -E "^\| prefill|rror"
    timeout 100 python -m experiments.probes.moe_fp4_scales 2>&1 | tail -18 ;;
42) # after 41 (one TMA box per step: slower, 1.224 vs 1.008 ms, dropped; the scale conversion in uint16 with one
    # select fuses into one 0.06 ms kernel): the exponent decode as the default and the fused scale conversion --
    # the FP4 Mosaic GPU GPU tests, FP4 decode / prefill, the whole layer, the probe
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT"
    timeout 170 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4" 2>&1 | tail -3
    timeout 100 $M --impls mgpu --regime decode --formats fp4 --decode-tokens 64,256,1024 --quick 2>&1 | grep -E "^\| decode|rror"
    timeout 100 $M --impls mgpu --regime prefill --formats fp4 --quick 2>&1 | grep -E "^\| prefill|rror"
    timeout 150 $M --impls layer --regime prefill,decode --formats fp4 2>&1 | grep -E "^\| (decode|prefill)|rror"
    timeout 60 python -m experiments.probes.moe_fp4_scales 2>&1 | grep -E "scales|current" ;;
43) # issue 11 on nvidia-h200-x2 (twelfth session): the 43-layer V4-Flash B256 verify and 2 x 4096 prefill that
    # part 2 had no time left for (its B64 verify compiled for 200 s)
    export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    timeout 575 $B --preset v4-flash --dense-weights fp8 --expert-weights fp4 --mesh 1,2,1 \
        --phase decode,prefill --batch 256 --prefill-batch 2 --context 32768 --time-budget 330 \
        --tag h200x2_full43_b256 2>&1 | tail -8 ;;
44) # issue 11 on nvidia-h200-x2 (twelfth session): part 25's second command alone (its sweep is complete) --
    # the per-kernel times of ep=2 verify B256, 4 layers
    export NCCL_NVLS_ENABLE=0
    timeout 230 $B --preset v4-flash-4l --expert-weights fp4 --mesh 1,2,1 --phase decode --batch 256 \
        --context 32768 --kernel-times 3 --tag h200x2_ep2_kernels 2>&1 | tail -40 ;;
45) # twelfth session, one GPU (of whichever machine is warm): the tenth session's model-level FP4 step
    # (s10_fp4_defaults) again at this session's defaults (exponent decode, fused scale conversion, 192-row tiles)
    CUDA_VISIBLE_DEVICES=0 timeout 280 $B --preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 \
        --prefill-batch 2 --context 32768 --new-tokens 4096 --step verify --tag s12_fp4_defaults 2>&1 | tail -6 ;;
46) # twelfth session, one GPU: Nsight Compute on the FP4 decode kernels at the new default (exponent decode) --
    # what bounds them once decode instructions do not (part 39's ncu run with --config segfaulted)
    export PYTHONUNBUFFERED=1
    ncu_moe fp4_decode_exponent_default --format fp4 --tokens 256
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 ncu -k regex:mosaic --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
        python -m experiments.probes.moe_profile_target --calls 1 --format fp4 --tokens 256 \
        > "$OUT/ncu_fp4_decode_exponent_down.txt" 2>&1
    grep -E "ERR|rror|Duration|Throughput|Stall|No Eligible|Achieved Occupancy" "$OUT/ncu_fp4_decode_exponent_down.txt" | head -30 ;;
47) # twelfth session, one GPU: FP4 expert scales held in the kernels' layout (fp4_kernel_scales; the model and
    # bench_moe hold them so) -- the FP4 Mosaic GPU GPU tests (held scales into both decodes), FP4 decode, the layer
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT"
    timeout 110 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash" 2>&1 | tail -3
    timeout 60 $M --impls mgpu --regime decode --formats fp4 --decode-tokens 64,256 --quick 2>&1 | grep -E "^\| decode|rror"
    timeout 70 $M --impls layer --regime decode --formats fp4 2>&1 | grep -E "^\| decode|rror" ;;
48) # thirteenth session, one GPU: FP4 weights held as "kernel words" (fp4_kernel_weights: each 32-bit word's bits
    # permuted so that 8 weights decode with 9 integer instructions instead of 18) -- the FP4 Mosaic GPU GPU tests,
    # FP4 decode (tile sweep) and prefill, against the twelfth session's code (585e113, a git archive unpacked in
    # _baseline/, which is never committed) in the same call; the new gate/up kernel's SASS opcodes
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4"
    timeout 170 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash" 2>&1 | tail -3
    timeout 150 $M --out "$OUT" --regime decode --decode-tokens 64,256,1024 2>&1 | grep -E "^\| decode|rror"
    (cd _baseline && timeout 80 $M --out "$OUT/base" --regime decode --decode-tokens 64,256,1024 --quick 2>&1 \
        | grep -E "^\| decode|rror")
    timeout 80 $M --out "$OUT" --regime prefill --quick 2>&1 | grep -E "^\| prefill|rror"
    (cd _baseline && timeout 80 $M --out "$OUT/base" --regime prefill --quick 2>&1 | grep -E "^\| prefill|rror")
    MOSAIC_GPU_DUMP_SASS=1 timeout 100 python -m experiments.probes.moe_profile_target --format fp4 --tokens 256 \
        --calls 1 --cuda-root /usr/local/cuda > "$OUT/sass_fp4_decode_words.txt" 2>&1
    python -m experiments.probes.sass_opcodes "$OUT/sass_fp4_decode_words.txt" --top 14 ;;
49) # after 48 (kernel words: prefill gate/up kernel 3.53 -> 3.11 ms, decode unchanged at 0.95): is the FP4 decode
    # kernel bound by its instructions or by HBM -- the same tiles with the weights in L2, then Nsight Compute
    export PYTHONUNBUFFERED=1
    timeout 200 python -m experiments.probes.moe_fp4_l2 2>&1 | grep -E "TB/s|rror"
    ncu_moe fp4_decode_words --format fp4 --tokens 64 \
        --config '{"block_m": 16, "block_n": 128, "block_k": 64, "block_n_down": 128, "block_k_down": 64, "max_concurrent_steps": 6, "swap_ab": true, "warp_specialized": false}' ;;
50) # after 49 (weights in L2: the decode kernels stream 2.85 TB/s, from HBM 2.41 -- bound by their own instruction
    # stream; the SASS shows a warpgroup barrier before each of a step's 7 TMA copies and a full wgmma wait at its
    # end): FP4 decode with a TMA warpgroup (warp specialisation) and one or two compute warpgroups
    export PYTHONUNBUFFERED=1
    C='"swap_ab": true, "block_m": 16, "block_k": 64, "block_k_down": 64'
    timeout 250 python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4 --out "$OUT" \
        --regime decode --decode-tokens 64,1024 --mgpu-configs "[{$C, \"block_n\": 128, \"block_n_down\": 128, \"max_concurrent_steps\": 6, \"warp_specialized\": false},
        {$C, \"block_n\": 128, \"block_n_down\": 128, \"max_concurrent_steps\": 6},
        {$C, \"block_n\": 256, \"block_n_down\": 256, \"max_concurrent_steps\": 4},
        {$C, \"block_n\": 128, \"block_n_down\": 128, \"max_concurrent_steps\": 6, \"compute_wgs\": 2},
        {$C, \"block_n\": 256, \"block_n_down\": 256, \"max_concurrent_steps\": 4, \"compute_wgs\": 2}]" \
        2>&1 | grep -E "^\| decode|rror" | cut -c1-200 ;;
51) # after 50 (a TMA warpgroup, one or two compute warpgroups: no faster): FP4 weights held scale group-major
    # ([E, in/32, out, 8]: a step's weight tile is one TMA copy of G contiguous runs, 5 copies a step instead of 7;
    # the weights' own K order, so the activations' reorder is gone) -- FP4 GPU tests, decode (sweep) and prefill
    # against the twelfth session's code (_baseline/), the L2 probe
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4"
    timeout 170 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash" 2>&1 | tail -3
    timeout 150 $M --out "$OUT" --regime decode --decode-tokens 64,256,1024 2>&1 | grep -E "^\| decode|rror" | cut -c1-190
    (cd _baseline && timeout 80 $M --regime decode --decode-tokens 64,1024 --quick 2>&1 | grep -E "^\| decode|rror" \
        | cut -c1-120)
    timeout 80 $M --out "$OUT" --regime prefill --quick 2>&1 | grep -E "^\| prefill|rror" | cut -c1-120
    timeout 100 python -m experiments.probes.moe_fp4_l2 2>&1 | grep -E "TB/s|rror" ;;
52) # after 51 (scale group-major held weights: prefill 7.20 -> 6.50 ms, the decode kernels 3-9% slower): back to
    # row-major held words, now with the weights' own K order (a group's words exchange nibble pairs) -- FP4 GPU
    # tests, decode and prefill against the twelfth session's code (_baseline/)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4"
    timeout 170 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash" 2>&1 | tail -3
    timeout 150 $M --out "$OUT" --regime decode --decode-tokens 64,256,1024 2>&1 | grep -E "^\| decode|rror" | cut -c1-150
    (cd _baseline && timeout 80 $M --regime decode --decode-tokens 64,1024 --quick 2>&1 | grep -E "^\| decode|rror" \
        | cut -c1-120)
    timeout 80 $M --out "$OUT" --regime prefill --quick 2>&1 | grep -E "^\| prefill|rror" | cut -c1-120 ;;
53) # thirteenth session, one GPU: the model holds routed experts' FP4 weights as kernel words (fp4_kernel_weights),
    # decode tiles of 128 weight rows -- the FP4 block (default tiles) and the whole layer, decode and prefill; the
    # tenth session's model-level FP4 step (part 45's command), each against the twelfth session's code (_baseline/)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --formats fp4"
    timeout 100 $M --out "$OUT" --impls mgpu,layer --regime decode,prefill --decode-tokens 64,256,1024 --quick 2>&1 \
        | grep -E "^\| (decode|prefill)|rror" | cut -c1-110
    (cd _baseline && timeout 100 $M --impls mgpu,layer --regime decode,prefill --decode-tokens 64,256,1024 --quick \
        2>&1 | grep -E "^\| (decode|prefill)|rror" | cut -c1-110)
    S="--preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 --prefill-batch 2 --context 32768"
    timeout 150 $B $S --new-tokens 4096 --step verify --tag s13_fp4_words 2>&1 | tail -4
    (cd _baseline && timeout 150 $B $S --new-tokens 4096 --step verify --tag s13_fp4_baseline --out "$OUT/base" 2>&1 \
        | tail -4) ;;
54) # after 53: the FP4 swap kernels keep one step's wgmma group in flight (wgmma_wait(1), as the dense ones; the
    # register operands of the next step are decoded meanwhile) -- FP4 GPU tests, decode and prefill against
    # 20213e3 (_baseline/, a git archive). Ran once: 9 of 12 GPU tests gave wrong results (the next step's decode
    # overwrote registers an in-flight wgmma still read), so the change was reverted; it no longer runs as meant
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4"
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash and not act_quant" \
        2>&1 | tail -3
    timeout 90 $M --out "$OUT" --regime decode,prefill --decode-tokens 64,256,1024 --quick 2>&1 \
        | grep -E "^\| (decode|prefill)|rror" | cut -c1-110
    (cd _baseline && timeout 90 $M --regime decode,prefill --decode-tokens 64,256,1024 --quick 2>&1 \
        | grep -E "^\| (decode|prefill)|rror" | cut -c1-110) ;;
55) # fourteenth session: a step's FP4 held words of all its scale groups as one TMA copy ([bn, 8G] uint16, 32-byte
    # rows at block_k 64) instead of one [bn, 8] copy per group (gate/up 5 copies a step instead of 7) -- FP4 GPU
    # tests, decode (sweep: block_k 64 / 128) and prefill against 53da7f2 (_baseline/, a git archive), the L2 probe
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4"
    C='"swap_ab": true, "block_n": 128, "block_n_down": 128, "warp_specialized": false'
    timeout 170 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash" 2>&1 | tail -3
    timeout 150 $M --out "$OUT" --regime decode --decode-tokens 64,256,1024 --mgpu-configs "[
        {$C, \"block_m\": 16, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 6},
        {$C, \"block_m\": 16, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 3},
        {$C, \"block_m\": 16, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 4},
        {$C, \"block_m\": 32, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 5}]" 2>&1 \
        | grep -E "^\| decode|rror" | cut -c1-190
    (cd _baseline && timeout 80 $M --regime decode --decode-tokens 64,256,1024 --quick 2>&1 \
        | grep -E "^\| decode|rror" | cut -c1-120)
    timeout 80 $M --out "$OUT" --regime prefill --quick 2>&1 | grep -E "^\| prefill|rror" | cut -c1-120
    (cd _baseline && timeout 80 $M --regime prefill --quick 2>&1 | grep -E "^\| prefill|rror" | cut -c1-120)
    timeout 100 python -m experiments.probes.moe_fp4_l2 2>&1 | grep -E "TB/s|rror" ;;
56) # after 55 (one TMA copy of a step's held words: decode 11% faster at 128-column steps): those tiles in SMEM
    # with a TMA swizzle of their row width (32 / 64 / 128 bytes) against 40b654d (_baseline/, unswizzled) --
    # FP4 GPU tests, decode and prefill sweeps (both trees), the L2 probe at 128-column steps
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4"
    C='"swap_ab": true, "block_n": 128, "block_n_down": 128, "warp_specialized": false'
    D="[{$C, \"block_m\": 16, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 4},
        {$C, \"block_m\": 16, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 5},
        {$C, \"block_m\": 16, \"block_k\": 256, \"block_k_down\": 256, \"max_concurrent_steps\": 2},
        {$C, \"block_m\": 16, \"block_k\": 256, \"block_k_down\": 256, \"max_concurrent_steps\": 3},
        {$C, \"block_m\": 32, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 5},
        {$C, \"block_m\": 32, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 3},
        {$C, \"block_m\": 32, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 4}]"
    P='"swap_ab": true, "block_m": 128, "block_n": 128, "block_n_down": 128, "compute_wgs": 2'
    Q="[{$P, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 4},
        {$P, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 2},
        {$P, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 3}]"
    timeout 170 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash" 2>&1 | tail -3
    for tree in . _baseline; do
        echo "== $tree"
        (cd $tree && timeout 100 $M --out "$OUT/$tree" --regime decode --decode-tokens 64,256,1024 --mgpu-configs "$D" \
            2>&1 | grep -E "^\| decode|rror" | cut -c1-190
         timeout 80 $M --out "$OUT/$tree" --regime prefill --mgpu-configs "$Q" 2>&1 | grep -E "^\| prefill|rror" \
            | cut -c1-190)
    done
    timeout 100 python -m experiments.probes.moe_fp4_l2 --configs "[{$C, \"block_m\": 16, \"block_k\": 128,
        \"block_k_down\": 128, \"max_concurrent_steps\": 4}]" 2>&1 | grep -E "TB/s|rror" ;;
57) # after 56 (a TMA swizzle of the held tiles changed nothing; reverted): FP4 decode tiles of 64 and 256 weight
    # rows at 128- and 256-column steps (more CTAs an SM, or longer TMA rows), against part 56's best
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --impls mgpu --formats fp4"
    D="[$(swap_cfg 16 128 128 4), $(swap_cfg 16 64 128 4), $(swap_cfg 16 64 128 6), $(swap_cfg 16 64 256 3), $(swap_cfg 16 64 256 4),
        $(swap_cfg 16 256 128 2), $(swap_cfg 16 256 128 3), $(swap_cfg 32 128 128 3), $(swap_cfg 32 64 128 4), $(swap_cfg 32 64 256 3)]"
    timeout 200 $M --out "$OUT" --regime decode --decode-tokens 64,256,1024 --mgpu-configs "$D" 2>&1 \
        | grep -E "^\| decode|rror" | cut -c1-190 ;;
58) # after 57 (64 weight rows x 256-column steps: FP4 decode 1.149 ms at 64 tokens), the new default tiles:
    # FP4 GPU tests, a sweep around them, then the FP4 block and whole layer (decode, prefill) against 123e7c5
    # (_baseline/, the thirteenth session's code)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --formats fp4"
    timeout 170 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "mgpu and fp4 and not v4_flash" 2>&1 | tail -3
    D="[$(swap_cfg 16 64 256 4), $(swap_cfg 16 64 256 5), $(swap_cfg 16 64 512 2), $(swap_cfg 32 64 256 2), $(swap_cfg 32 64 256 3),
        $(swap_cfg 32 64 256 4)]"
    timeout 100 $M --impls mgpu --out "$OUT" --regime decode --decode-tokens 64,256,1024 --mgpu-configs "$D" 2>&1 \
        | grep -E "^\| decode|rror" | cut -c1-190
    for tree in . _baseline; do
        echo "== $tree"
        (cd $tree && timeout 100 $M --out "$OUT/$tree" --impls mgpu,layer --regime decode,prefill \
            --decode-tokens 64,256,1024 --quick 2>&1 | grep -E "^\| (decode|prefill)|rror" | cut -c1-110)
    done ;;
59) # after 58 (FP4 decode block 1.146 ms at 64 tokens; the layer 1.185 = 1.16x of its floor): the FP4 block at the
    # default tiles (bench_moe's sweeps now list them first), then the tenth session's model-level FP4 step (part
    # 45's command), each against 123e7c5 (_baseline/)
    export PYTHONUNBUFFERED=1
    timeout 60 python -m experiments.bench_moe --routing balanced --iters 10 --formats fp4 --out "$OUT" --impls mgpu \
        --regime decode --decode-tokens 64,256,1024 --quick 2>&1 | grep -E "^\| decode|rror" | cut -c1-110
    S="--preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 --prefill-batch 2 --context 32768"
    timeout 170 $B $S --new-tokens 4096 --step verify --tag s14_fp4_tiles 2>&1 | tail -4
    (cd _baseline && JAXINFER_GIT_REVISION=123e7c5 timeout 170 $B $S --new-tokens 4096 --step verify --tag s14_fp4_baseline --out "$OUT/base" 2>&1 \
        | tail -4) ;;
60) # after 59: correctness of the new default FP4 decode tiles -- the GPU test of FP4 as the model holds it, now
    # at default_config's tiles (16- and 32-token decode tiles), and the block at V4-Flash shapes against XLA
    export PYTHONUNBUFFERED=1
    timeout 120 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "swap_held" 2>&1 | tail -3
    timeout 150 python -m experiments.bench_moe --routing balanced --iters 10 --formats fp4 --out "$OUT" \
        --impls xla,mgpu --regime decode --decode-tokens 64,256,1024 --quick 2>&1 | grep -E "^\| decode|rror" \
        | cut -c1-130 ;;
61) # fifteenth session: the swap kernels' glue -- the dispatch gathers token rows straight into xT (one Triton
    # kernel), the down kernel writes y [P, D] through a transposed SMEM view, the route plan's tile search is one
    # compare-and-count: the MoE GPU tests of the swap path, the FP4 block and layer (decode, prefill) against
    # 0fa3738 (_baseline/), the dispatch / combine probe
    export PYTHONUNBUFFERED=1
    timeout 220 python -m pytest -q -m gpu tests/test_kernels_moe.py \
        -k "swap or balanced192 or half_codes or (act_quant and fp4) or v4_flash_shapes" 2>&1 | tail -3
    for tree in . _baseline; do
        echo "== $tree"
        (cd $tree && timeout 100 python -m experiments.bench_moe --routing balanced --iters 10 --formats fp4 \
            --out "$OUT/$tree" --impls mgpu,layer --regime decode,prefill --decode-tokens 64,256,1024 --quick 2>&1 \
            | grep -E "^\| (decode|prefill)|rror" | cut -c1-110)
    done
    timeout 120 python -m experiments.probes.moe_combine 2>&1 | tail -5 ;;
62) # after 61 (FP4 decode block 1.083 / 1.102 ms at 64 / 256 tokens, prefill 5.407): the tenth session's model-level
    # FP4 step (part 59's command) against 0fa3738 (_baseline/), then the bf16 block and layer as they stand,
    # the L2 probe at the default decode tiles
    export PYTHONUNBUFFERED=1
    S="--preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 --prefill-batch 2 --context 32768"
    timeout 170 $B $S --new-tokens 4096 --step verify --tag s15_fp4_glue 2>&1 | tail -4
    (cd _baseline && JAXINFER_GIT_REVISION=0fa3738 timeout 170 $B $S --new-tokens 4096 --step verify \
        --tag s15_fp4_baseline --out "$OUT/base" 2>&1 | tail -4)
    timeout 120 python -m experiments.bench_moe --routing balanced --iters 10 --formats bf16 --out "$OUT" \
        --impls mgpu,layer --regime prefill,decode --quick 2>&1 | grep -E "^\| (decode|prefill)|rror" | cut -c1-110
    timeout 100 python -m experiments.probes.moe_fp4_l2 --configs "[$(swap_cfg 16 64 256 4)]" 2>&1 | grep -E "TB/s|rror" ;;
63) # part 62 less its baseline and bf16 rows (a helper's device call spent the budget they needed): the model-level
    # FP4 step (part 59's command; 0fa3738 ran it as 4a018db's kernels: part 59) and the L2 probe at the decode tiles
    export PYTHONUNBUFFERED=1
    S="--preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 --prefill-batch 2 --context 32768"
    timeout 170 $B $S --new-tokens 4096 --step verify --tag s15_fp4_glue 2>&1 | tail -4
    timeout 80 python -m experiments.probes.moe_fp4_l2 --configs "[$(swap_cfg 16 64 256 4)]" 2>&1 | grep -E "TB/s|rror" ;;
64) # the bf16 and FP8 rows as they stand after 61 (their row tiles unchanged since the eleventh session but for
    # the route plan's tile search): bf16 block and layer at prefill and decode, FP8 x FP8 (act_quant'd) prefill
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick"
    timeout 150 $M --formats bf16 --impls triton,mgpu,layer --regime prefill,decode 2>&1 \
        | grep -E "^\| (decode|prefill)|rror" | cut -c1-110
    timeout 80 $M --formats fp8 --act-block 128 --impls mgpu --regime prefill 2>&1 | grep -E "^\| prefill|rror" \
        | cut -c1-110 ;;
65) # after 64 (bf16 prefill layer 5.521 ms = 1.28x of its floors, 0.314 of it XLA's dispatch gather of all P rows):
    # take_rows as one Triton kernel over the live tiles -- the row-path and Triton MoE GPU tests, the bf16 block
    # and layer, FP8 x FP8 prefill
    export PYTHONUNBUFFERED=1
    timeout 150 python -m pytest -q -m gpu tests/test_kernels_moe.py \
        -k "(compiled_matches and (triton or rows or balanced192)) or (act_quant and (fp8 or auto))" 2>&1 | tail -3
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick"
    timeout 90 $M --formats bf16 --impls mgpu,layer --regime prefill,decode 2>&1 \
        | grep -E "^\| (decode|prefill)|rror" | cut -c1-110
    timeout 50 $M --formats fp8 --act-block 128 --impls mgpu --regime prefill 2>&1 | grep -E "^\| prefill|rror" \
        | cut -c1-110 ;;
66) # sixteenth session: persistent warp-specialised Mosaic GPU kernels (a CTA per SM looping over the live tiles'
    # items, the next item's copies overlapping the last one's epilogue): the MoE GPU tests of those paths, then the
    # bf16 / FP4 / FP8 x FP8 prefill block and layer against 391e651 (_baseline/)
    export PYTHONUNBUFFERED=1
    timeout 200 python -m pytest -q -m gpu tests/test_kernels_moe.py \
        -k "(compiled_matches and (rows or balanced192 or swap_2wg or swap_held)) or (act_quant and (fp8 or fp4 or auto))" \
        2>&1 | tail -3
    for tree in . _baseline; do
        echo "== $tree"
        M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT/$tree --quick --regime prefill"
        (cd $tree && timeout 100 $M --formats bf16,fp4 --impls mgpu,layer 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
         timeout 60 $M --formats fp8 --act-block 128 --impls mgpu,layer 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110)
    done ;;
67) # after 66 (bf16 192-row layer 5.353 -> 4.980 ms, FP4 layer 5.377 -> 4.788, but the bf16 128-row block 5.331 ->
    # 6.524: its wgmma_wait(0)): the dense kernels keep one wgmma in flight again, the memory warpgroup waiting for
    # the compute warpgroups' drain before the next item -- the MoE GPU tests of the persistent paths, the prefill
    # block and layer, the model-level FP4 step (part 59's command)
    export PYTHONUNBUFFERED=1
    timeout 250 python -m pytest -q -m gpu tests/test_kernels_moe.py \
        -k "(compiled_matches and (rows or balanced192 or swap_2wg or swap_held)) or (act_quant and (fp8 or fp4 or auto))" \
        2>&1 | tail -4
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick --regime prefill"
    timeout 90 $M --formats bf16,fp4 --impls mgpu,layer 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
    timeout 50 $M --formats fp8 --act-block 128 --impls mgpu,layer 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
    timeout 170 $B --preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 --prefill-batch 2 \
        --context 32768 --new-tokens 4096 --step verify --tag s16_persistent 2>&1 | tail -4 ;;
68) # after 67 (the drain barrier kept one wgmma in flight but gave back part 66's bf16 192-row gain, and the bf16
    # 128-row gate/up stayed slow in persistent CTAs: 4.46 ms): persistence is MgpuConfig(persistent=), on in the
    # defaults where part 66 measured it faster (part 66's kernels, wgmma_wait(0)); the bf16 128-row tiles keep a CTA
    # per item -- GPU tests (incl. persistent bf16 rows / FP8 swap), the prefill block and layer, the model step
    export PYTHONUNBUFFERED=1
    timeout 230 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "(compiled_matches and (rows or balanced192 \
        or swap_2wg or swap_held or persistent)) or (act_quant and (fp8 or fp4 or auto))" 2>&1 | tail -2
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick --regime prefill"
    timeout 80 $M --formats bf16,fp4 --impls mgpu,layer 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
    timeout 50 $M --formats fp8 --act-block 128 --impls mgpu,layer 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
    timeout 150 $B --preset v4-flash-4l --expert-weights fp4 --phase prefill,decode --batch 64 --prefill-batch 2 \
        --context 32768 --new-tokens 4096 --step verify --tag s16_persistent 2>&1 | tail -4 ;;
69) # after 68: the expert blocks at default_config's balanced 8K tiles (192 rows, persistent: what the layer runs;
    # --quick runs the sweep's 128-row first entry), then the model's FP4 prefill step against 391e651 (_baseline/)
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --regime prefill --impls mgpu"
    P='"block_m": 192, "persistent": true, "max_concurrent_steps'
    timeout 60 $M --formats bf16 --mgpu-configs "[{$P\": 4, \"compute_wgs\": 3, \"block_n\": 64, \"block_k\": 64,
        \"block_n_down\": 128, \"block_k_down\": 64}]" 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
    timeout 60 $M --formats fp8 --act-block 128 --mgpu-configs "[{$P\": 4, \"compute_wgs\": 3, \"block_n\": 64,
        \"block_k\": 128, \"block_n_down\": 128, \"block_k_down\": 128}]" 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
    timeout 60 $M --formats fp4 --mgpu-configs "[{$P\": 3, \"compute_wgs\": 2, \"swap_ab\": true, \"block_n\": 128,
        \"block_k\": 64, \"block_n_down\": 128, \"block_k_down\": 64}]" 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
    S="--preset v4-flash-4l --expert-weights fp4 --phase prefill --prefill-batch 2 --context 32768"
    timeout 120 $B $S --tag s16_persistent_prefill 2>&1 | tail -2
    (cd _baseline && JAXINFER_GIT_REVISION=391e651 timeout 120 $B $S --tag s16_baseline_prefill --out "$OUT/base" 2>&1 \
        | tail -2) ;;
70) # after 69: the single-warpgroup decode tiles (unchanged but for the epilogue's store wait) -- their GPU tests
    # and the FP4 block at the defaults -- then the FP4 decode / verify tiles with a TMA warpgroup in persistent CTAs
    export PYTHONUNBUFFERED=1
    timeout 120 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "compiled_matches and swap and not 2wg" \
        2>&1 | tail -2
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --formats fp4 --impls mgpu \
        --regime decode --decode-tokens 64,256,1024"
    timeout 60 $M --quick 2>&1 | grep -E "^\| decode|rror" | cut -c1-100
    D='"swap_ab": true, "persistent": true, "block_k": 256, "block_k_down": 256, "max_concurrent_steps": 4'
    timeout 120 $M --mgpu-configs "[{$D, \"block_m\": 32, \"block_n\": 64, \"block_n_down\": 64},
        {$D, \"block_m\": 16, \"block_n\": 64, \"block_n_down\": 64},
        {$D, \"block_m\": 32, \"block_n\": 128, \"block_n_down\": 128, \"compute_wgs\": 2}]" 2>&1 \
        | grep -E "^\| decode|rror" | cut -c1-250 ;;
71) # after 70: the FP4 verify default is two compute warpgroups in persistent CTAs (32-token tiles, 1024 tokens
    # 1.324 ms against 1.417) -- the GPU test of FP4 held at default_config's tiles, the block, the model's verify step
    export PYTHONUNBUFFERED=1
    timeout 90 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "swap_held" 2>&1 | tail -2
    timeout 50 python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --formats fp4 --impls mgpu \
        --regime decode --decode-tokens 1024 --quick 2>&1 | grep -E "^\| decode|rror" | cut -c1-100
    timeout 130 $B --preset v4-flash-4l --expert-weights fp4 --phase decode --batch 64 --context 32768 \
        --new-tokens 4096 --step verify --tag s16_fp4_verify 2>&1 | tail -2 ;;
72) # seventeenth session: issue 6's closing table in one run -- XLA ragged_dot, jax's in-tree ragged_dot_mgpu, the
    # Triton kernels, ours (Mosaic GPU at default_config's tiles for the routing: bench_moe lists them first) and
    # the whole layer, forced balance, decode 64 / 256 tokens and prefill 8K
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick"
    timeout 210 $M --regime decode --formats bf16,fp8,fp4 2>&1 | grep -E "^\| decode|rror" | cut -c1-150
    timeout 200 $M --regime prefill --formats bf16,fp4 2>&1 | grep -E "^\| prefill|rror" | cut -c1-150
    timeout 150 $M --regime prefill,decode --formats fp8 --act-block 128 --impls xla,triton,mgpu 2>&1 \
        | grep -E "^\| (prefill|decode)|rror" | cut -c1-150 ;;
73) # after 72: random routing (the router's spread; the prefill defaults there were made persistent on balanced
    # evidence only) -- the blocks and layers at the defaults, then the FP4 swap and FP8 x FP8 default tiles with
    # persistent CTAs off
    export PYTHONUNBUFFERED=1
    M="python -m experiments.bench_moe --routing random --iters 10 --out $OUT --regime prefill"
    timeout 150 $M --quick --formats bf16,fp4 --impls mgpu,layer 2>&1 | grep -E "^\| prefill|rror" | cut -c1-150
    F='"swap_ab": true, "block_m": 128, "block_n": 128, "block_k": 64, "block_n_down": 128, "block_k_down": 64,
        "compute_wgs": 2, "max_concurrent_steps": 4'
    timeout 120 $M --formats fp4 --impls mgpu --mgpu-configs "[{$F, \"persistent\": true}, {$F}]" 2>&1 \
        | grep -E "^prefill|rror" | cut -c1-110
    R='"block_m": 128, "block_n": 64, "block_k": 128, "block_n_down": 128, "block_k_down": 128, "compute_wgs": 2,
        "max_concurrent_steps": 6'
    timeout 120 $M --formats fp8 --act-block 128 --impls mgpu --mgpu-configs "[{$R, \"persistent\": true}, {$R}]" \
        2>&1 | grep -E "^prefill|rror" | cut -c1-110 ;;
74) # after 73: the gate's logits in IEEE float32 (Precision.HIGHEST; XLA runs a float32 GEMM as TF32 on the GPU):
    # how often TF32 changed the top-6 and what float32 costs (probe), the GPU router / model tests, the layer at
    # prefill and decode, the model's FP4 prefill step (part 69's command)
    router_check 3 s17_router_f32 ;;
75) # after 74 (TF32 changed no expert set with bf16 operands -- it holds them exactly -- and HIGHEST cost 0.30 ms a
    # layer at 8K tokens): HIGHEST for float32 operands only -- the probe with bf16 and float32 operands, the float32
    # gate's GPU test, the layer at prefill and decode
    router_check 5 ;;
76) # after 75: the gate multiplies bf16 operands as they are into float32 (exact products; no convert, bf16 MMA):
    # the probe (logits variants, lax.top_k against six argmax rounds), the router GPU tests (bf16 and float32
    # gates), the layer at prefill and decode, the model's FP4 prefill step
    router_check 7 s17_router_bf16 ;;
77) # after 76 (bf16 logits: 0.026 ms against 0.101 at 8K tokens; six argmax rounds 0.022 against lax.top_k's row sort
    # 0.068, but slower at 64 rows): model.moe.top_k_ids takes the rounds past 512 rows -- the probe's top-k at 64 to
    # 8192 rows, the router and MoE-layer tests, the layer at prefill and decode, the model's FP4 prefill step
    router_check 2 s17_router_topk ;;
78) # eighteenth session: what the vendor's library reaches at the experts' forced-balance shapes (batched cuBLAS
    # GEMMs, bf16 and per-tensor FP8: experiments/probes/vendor_gemm_ceiling.py), then the FP4 prefill tilings not
    # swept persistent yet (192-token tiles: the default, 4 slots, 128-column down steps, 128-column steps)
    export PYTHONUNBUFFERED=1
    timeout 200 python -m experiments.probes.vendor_gemm_ceiling 2>&1 | grep -v Warning
    F='"swap_ab": true, "persistent": true, "compute_wgs": 2, "block_m": 192, "block_n": 128, "block_n_down": 128'
    timeout 250 python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --regime prefill \
        --formats fp4 --impls mgpu --mgpu-configs "[{$F, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 3},
        {$F, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 4},
        {$F, \"block_k\": 64, \"block_k_down\": 128, \"max_concurrent_steps\": 3},
        {$F, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 2}]" 2>&1 \
        | grep -E "^prefill|rror" | cut -c1-150 ;;
79) # after 78 (XLA's batched FP8 GEMM went to Triton, 243 TFLOP/s): the vendor peers at the experts' shapes --
    # XLA's FP8 with Triton GEMMs off (cuBLAS), PyTorch's grouped GEMMs (bf16, FP8 row-wise) -- then the FP4 swap
    # kernels decoding a wgmma's 64 columns at a time against the same tilings at the commit in _baseline (same
    # call): prefill at 192-token tiles with 64- and 128-column steps, decode 64 / 256 and verify 1024 at defaults
    export PYTHONUNBUFFERED=1
    timeout 90 python -m experiments.probes.vendor_gemm_ceiling --torch 2>&1 | grep -v Warning
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 90 python -m experiments.probes.vendor_gemm_ceiling \
        --dtypes fp8 2>&1 | grep -v Warning
    F='"swap_ab": true, "persistent": true, "compute_wgs": 2, "block_m": 192, "block_n": 128, "block_n_down": 128'
    C="[{$F, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 3},
        {$F, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 2},
        {$F, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 3}]"
    for tree in _baseline .; do
        echo "== $tree"
        (cd $tree && timeout 150 python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT \
            --regime prefill --formats fp4 --impls mgpu --mgpu-configs "$C" 2>&1 | grep -E "^prefill|rror" | cut -c1-100
         timeout 100 python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick \
            --regime decode --decode-tokens 64,256,1024 --formats fp4 --impls mgpu 2>&1 | grep -E "^decode|rror" \
            | cut -c1-100)
    done ;;
80) # after 79: the FP4 GPU tests on the chunked decode
    timeout 300 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "fp4 or model_pallas" 2>&1 | tail -3 ;;
81) # after 80 (decoding 64 columns at a time: no gain at prefill, decode 1.09 -> 1.40 ms: dropped; 128-column steps
    # at 192-token tiles: FP4 prefill block 4.157 -> 3.751 ms, now the default): the same steps at 128-token tiles
    # under random routing, then the FP4 prefill layer and the 4-layer model's FP4 prefill 2 x 4096 at the defaults
    # against the commit in _baseline (same call)
    export PYTHONUNBUFFERED=1
    F='"swap_ab": true, "persistent": true, "compute_wgs": 2, "block_m": 128, "block_n": 128, "block_n_down": 128'
    timeout 120 python -m experiments.bench_moe --routing random --iters 10 --out $OUT --regime prefill \
        --formats fp4 --impls mgpu --mgpu-configs "[{$F, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 4},
        {$F, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 4},
        {$F, \"block_k\": 64, \"block_k_down\": 128, \"max_concurrent_steps\": 4}]" 2>&1 \
        | grep -E "^prefill|rror" | cut -c1-100
    for tree in _baseline .; do
        tag=$([ $tree = . ] && echo s18_fp4_bk128 || echo s18_fp4_bk128_baseline)
        echo "== $tree"
        (cd $tree && timeout 80 python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --quick \
            --impls layer --formats fp4 --regime prefill 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110
         timeout 130 $B --preset v4-flash-4l --expert-weights fp4 --phase prefill --prefill-batch 2 --context 32768 \
            --tag $tag 2>&1 | tail -2)
    done ;;
82) # after 81 (128-column FP4 steps also at 128-token tiles, random routing: 4.737 ms against 5.010; the default now
    # for every FP4 prefill tile): the FP4 GPU tests, then the FP4 prefill blocks and layers under both routings at
    # the defaults against the commit in _baseline (same call)
    export PYTHONUNBUFFERED=1
    timeout 280 python -m pytest -q -m gpu tests/test_kernels_moe.py -k "fp4 or model_pallas" 2>&1 | tail -2
    for tree in _baseline .; do
        echo "== $tree"
        (cd $tree && timeout 120 python -m experiments.bench_moe --routing balanced,random --iters 10 --out $OUT \
            --quick --impls mgpu,layer --formats fp4 --regime prefill 2>&1 | grep -E "^\| prefill|rror" | cut -c1-110)
    done ;;
83) # eighteenth session's closing table: PyTorch's grouped GEMMs at the experts' shapes, then part 72 (every issue 6
    # target with XLA, jax's in-tree kernel, Triton and the roofline) at the final kernels
    timeout 90 python -m experiments.probes.vendor_gemm_ceiling --torch 2>&1 | grep -v Warning
    bash "$0" 72 && mv "$OUT/results.tgz" "$OUT/part72.tgz" ;;
84) # after 83: the bf16 prefill row tiles (192 rows, three compute warpgroups) at 128-column steps, as FP4 took them
    F='"persistent": true, "compute_wgs": 3, "block_m": 192, "block_n": 64, "block_n_down": 128'
    timeout 200 python -m experiments.bench_moe --routing balanced --iters 10 --out $OUT --regime prefill \
        --formats bf16 --impls mgpu --mgpu-configs "[{$F, \"block_k\": 64, \"block_k_down\": 64, \"max_concurrent_steps\": 4},
        {$F, \"block_k\": 128, \"block_k_down\": 128, \"max_concurrent_steps\": 4},
        {$F, \"block_k\": 64, \"block_k_down\": 128, \"max_concurrent_steps\": 4}]" 2>&1 \
        | grep -E "^prefill|rror" | cut -c1-100 ;;
*)  echo "part must be 1 to 84" >&2; exit 2 ;;
esac
(cd "$OUT" && tar czf results.tgz --remove-files -- * && ls -l)
