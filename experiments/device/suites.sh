#!/usr/bin/env bash
# Named GPU suites behind the tables of docs/benchmarks.md and docs/kernels.md. Run from the repo root; each suite
# fits one device command of 10 minutes; results land in experiments/results and in $OUT, archived into one
# file at the end:
#   bash experiments/device/suites.sh SUITE [SUITE ...]
# One H200 unless marked [x2] (nvidia-h200-x2). Model step (experiments.bench, V4-Flash widths, 4 layers, 32K
# context, benchmark mode, Pallas kernels; --kernel-times: the per-component breakdown):
#   step-release          release format (FP8 dense + FP4 experts; --dense-impl pallas: the largest FP8 projections
#                         from their bytes at decode), V4 and V4.1: verify 8 / 64 / 256 x 4, prefill 1 / 2 x 4096
#   step-release-targets  the same at the target points only (V4: verify 8 / 64 / 256, prefill 2; V4.1: verify 64,
#                         prefill 1)
#   step-bf16             V4 in bf16 (dense and experts): verify 8 / 64 / 256 x 4, prefill 1 / 4 x 4096; verify
#                         256 x 4 with the bf16 LM head (V4.1's bf16 experts do not fit one GPU)
#   step-fp4-experts      V4, bf16 dense + FP4 experts: verify 8 / 64 / 256 x 4, prefill 1 / 2 / 4 x 4096; verify
#                         64 / 256 with the bf16 LM head
#   step-v41-fp4-experts  V4.1 (Engram vocabulary 160K), bf16 dense + FP4 experts: verify 8 / 64 / 256 x 4 at 4K and
#                         32K, prefill 1 x 4096
#   step-index-keys       V4, FP4 experts, verify 64 x 4 at 128K with bf16 and MXFP4 index keys
#   launch-gap            the host / launch gap of the release-format verify 64 x 4 under XLA's command buffers (CUDA
#                         graphs), XLA's default and every command kind at every graph size: the synchronous step,
#                         back to back, and 10 steps a call in a device loop (--loop-steps; with WHILE and CONDITIONAL
#                         commands the loop itself becomes part of the graph)
#   fp8-dense             the FP8 projections multiplied from their bytes (--dense-impl pallas: the swap_ab tiles at
#                         decode / verify loads) against the in-graph dequantisation: the kernels' GPU tests, each
#                         projection alone (experiments.probes.fp8_linear: V4's, with the 256-token swap tiles at
#                         256 / 1,024 rows, and V4.1's), then release-format V4 verify 8 / 64 / 256 x 4 both ways
#   attention-glue        the indexer's top-k by the selection kernel (pallas_kernels/topk.py) and RoPE written in
#                         place: their GPU tests, each alone at the step shapes (experiments.probes.topk_select,
#                         experiments.probes.rope_in_place), then the release-format V4 verify 256 x 4 and prefill 2 x
#                         4096 (--kernel-times)
#   mhc                   the mHC kernels' GPU tests and pieces (experiments.probes.mhc_kernels, with the coefficient
#                         kernel at three more tilings), then the release-format
#                         steps with the mHC as XLA ops and as the kernels, V4 verify 8 / 64 / 256 x 4 and prefill 2 x
#                         4096 (the kernels with --kernel-times)
#   step-trace            the release-format V4 verify 64 x 4 and prefill 2 x 4096 with a jax.profiler timeline of two
#                         steps each (--trace; in $OUT/trace): what the device does in the gaps between kernels
#   step-scale            the scale check: the release-format V4-Flash at 28 layers (the most of its layer pattern that
#                         one H200 holds beside a 64-sequence 32K cache; 26, then 24 if it fails), scanned layer groups,
#                         verify 64 x 4: per-layer time and compile time against the 4-layer step
#   step-realistic        realistic mode (the router's own choices, distinct prompts, the whole speculative step),
#                         release format, verify 64 x 4
#   peer-ours             ours (release format and bf16) at the peer's shapes: prefill 1 x 4096 without context,
#                         verify 64 x 4 at 1K context
#   peer-hf               HF transformers (bf16, eager) at the same shapes (carry .whl: transformers 5.24)
# Multi-GPU [x2] (NCCL_NVLS_ENABLE=0):
#   multi-gpu-sweep       V4 4 layers, FP4 experts on 1 GPU, ep=2 and dp=2: verify 8 / 64 / 256, prefill 2 x 4096
#                         (experiments/sweeps/h200x2_ep.yaml; resumable: run again to finish the points left)
#   multi-gpu-43l-b64     the 43-layer V4-Flash in the release format at ep=2: verify 64 x 4
#   multi-gpu-43l-b256    the same: verify 256 x 4 and prefill 2 x 4096
#   multi-gpu-ep2         ep=2 verify 256 x 4 per component, realistic mode at ep=2, the EP transport's share of
#                         one MoE layer (experiments.bench_ep)
#   multi-gpu             all four (four device commands)
# Compile time and kernels:
#   compile-time          the 43-layer V4-Flash's prefill and verify steps compiled, FP4 experts and release format
#   compile-time-scan     the same with scanned layer groups (--scan-layers), release format: 4 layers cold, 43
#                         layers cold, then 43 layers warm (a second process on the same compilation cache)
#   compile-time-scan-x2  compile-time-scan on two GPUs (ep=2)
#   compile-time-autotune XLA's GEMM autotuning off (--xla_gpu_autotune_level=0): the 43-layer scanned verify step
#                         compiled cold, and the 4-layer release-format verify 64 x 4 it then runs (what the step pays)
#   kernels-attention     experiments.bench_kernels: sparse attention and the indexer at V4-Flash shapes
#   kernels-moe           experiments.bench_moe, forced balance: every expert format and implementation, decode
#                         64 / 256 tokens and prefill 8K, the whole MoE layer, FP8 x FP8 (act_quant 128)
#   kernels-moe-random    the same prefill blocks and layers under random routing
#   vendor-gemm           the vendor's GEMMs at the experts' shapes (experiments.probes.vendor_gemm_ceiling: XLA,
#                         XLA with Triton GEMMs off, PyTorch grouped GEMMs)
#   kernels               the four above (four device commands)
#   gpu-tests             the GPU tests (pytest -m gpu)
# Engram (experiments.bench_engram, V4.1 widths: 2 layers x 24 columns of FP8 rows, 16M-row tables):
#   engram                the rows' fetch per step for 1 / 64 / 256 / 4096 tokens, alone and beside a GEMM workload:
#                         device, host and host-callback tables on one GPU; on [x2] also split tables (sharded and
#                         host, each exchange)
# Batch invariance (docs/batch_invariance.md):
#   batch-invariance      its GPU tests on the reference paths (tests/test_batch_invariance.py -m gpu: both presets,
#                         float32 then bfloat16; the four take more than 255 s, so they have a call of their own)
#   batch-invariance-bf16 the bfloat16 two alone (about 215 s on one H200)
#   batch-invariance-kernels  the two with FP4 experts on the MoE kernels, then also with the FP8 projections on
#                         their fixed tiles, the mHC kernels and the attention and indexer kernels (bfloat16)
#   batch-invariance-cost the release-format steps with the switch off and on in the same call (--batch-invariant
#                         both): V4 verify 8 / 64 x 4 and prefill 1 x 4096 at 32K context; then three V4 FP8
#                         projections at 32 / 256 / 4,096 rows on the invariant tiles (32 rows, the model's, 64 and
#                         128) against the fast mode's dequantised GEMM (experiments.probes.fp8_linear)
# Each command runs under its own time bound (their sum per suite stays under 10 minutes).
# Environment: BENCH_ARGS adds arguments to every bench run; SUITE_TIMEOUT (s) replaces each command's bound;
# INVARIANT_BLOCKS (ROWS,ENTRY_BLOCK,INDEX_KEY_BLOCK) runs the batch-invariance tests at other block sizes;
# JAXINFER_GIT_REVISION names the commit in every record (give the one the call runs: the device machine's copy of
# the tree keeps the .git of its first call, so its own HEAD names older code), e.g.
#   JAXINFER_GIT_REVISION=<git rev-parse HEAD> bash experiments/device/suites.sh step-release-targets
set -u
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
B="python -m experiments.bench --quiet --moe-impl pallas --attention-impl pallas ${BENCH_ARGS:-}"
FORMATS="--dense-weights fp8 --expert-weights fp4"   # the release's formats
RELEASE="$FORMATS --dense-impl pallas"               # ... with the largest FP8 projections multiplied from their bytes
V4="--preset v4-flash-4l"
V41="--preset v41-flash --layers 4 --engram-vocab 160000"   # small Engram tables, the same lookups
V4_43="--preset v4-flash"
OUTDIR=${OUT:-experiments/results}   # bench_kernels writes its records there (the other tools copy theirs to $OUT)

limit() {  # limit SECONDS CMD...: CMD under timeout (SUITE_TIMEOUT overrides SECONDS)
    local s=$1; shift
    timeout "${SUITE_TIMEOUT:-$s}" "$@"
}

bench() {  # bench SECONDS TAG ARGS...: one bench.py run, its table's rows on stdout
    local s=$1 tag=$2; shift 2
    limit "$s" $B "$@" --tag "$tag" 2>&1 | grep -E "^\| (prefill|decode)|^Verify steps in one device loop|rror|refused" \
        | cut -c1-400
}

moe() {  # moe SECONDS ARGS...: one bench_moe.py run, its table's rows on stdout
    local s=$1; shift
    limit "$s" python -m experiments.bench_moe --iters 10 --out experiments/results "$@" 2>&1 \
        | grep -E "^\| (prefill|decode)|rror" | cut -c1-200
}

wheels() {  # the carried wheels (.whl) into /tmp/site, on PYTHONPATH
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
}

suites=()
for s in "$@"; do
    case "$s" in
    multi-gpu) suites+=(multi-gpu-sweep multi-gpu-43l-b64 multi-gpu-43l-b256 multi-gpu-ep2) ;;
    kernels) suites+=(kernels-attention kernels-moe kernels-moe-random vendor-gemm) ;;
    *) suites+=("$s") ;;
    esac
done

for suite in "${suites[@]}"; do
    echo "== $suite"
    case "$suite" in
    step-release)
        bench 280 v4_release $V4 $RELEASE --phase decode,prefill --batch 8,64,256 --prefill-batch 1,2 \
            --context 32768 --kernel-times 2
        bench 280 v41_release $V41 $RELEASE --phase decode,prefill --batch 8,64,256 --prefill-batch 1,2 \
            --context 32768 --kernel-times 2 ;;
    step-release-targets)
        bench 280 v4_release $V4 $RELEASE --phase decode,prefill --batch 8,64,256 --prefill-batch 2 --context 32768 \
            --kernel-times 2
        bench 280 v41_release $V41 $RELEASE --phase decode,prefill --batch 64 --prefill-batch 1 --context 32768 \
            --kernel-times 2 ;;
    attention-glue)
        limit 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_attention.py tests/test_config.py \
            -k "topk_select or indexer_real_width or rope_in_place" 2>&1 | tail -3
        limit 60 python -m experiments.probes.topk_select 2>&1 | grep -E "^\||rror"
        limit 60 python -m experiments.probes.rope_in_place 2>&1 | grep -E "^\||rror"
        bench 150 v4_release $V4 $RELEASE --phase decode,prefill --batch 256 --prefill-batch 2 --context 32768 \
            --kernel-times 2 ;;
    launch-gap)
        for flags in "" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"; do
            echo "-- XLA_FLAGS=$flags"
            XLA_FLAGS="$flags" bench 200 "v4_release_graphs" $V4 $RELEASE --phase decode --batch 64 --context 32768 \
                --kernel-times 2 --loop-steps 10 --repeats 30
        done ;;
    fp8-dense)
        limit 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_linear.py 2>&1 | tail -4
        limit 120 python -m experiments.probes.fp8_linear 2>&1 | grep -E "^\||rror"
        limit 90 python -m experiments.probes.fp8_linear --rows 256,1024 --ways dequantised,swap \
            --swap-tile-tokens 128,256 --projections wq_b,wo_a,wo_b 2>&1 | grep -E "^\||rror"
        limit 90 python -m experiments.probes.fp8_linear --generation v41 --rows 32,256 --ways dequantised,swap \
            2>&1 | grep -E "^\||rror"
        for impl in reference pallas; do
            bench 120 "v4_release_dense_$impl" $V4 $FORMATS --dense-impl $impl --phase decode --batch 8,64,256 \
                --context 32768 --kernel-times 2
        done ;;
    step-bf16)
        bench 400 v4_bf16 $V4 --phase decode,prefill --batch 8,64,256 --prefill-batch 1,4 --context 32768 \
            --kernel-times 2
        bench 150 v4_bf16_head $V4 --head-dtype bfloat16 --phase decode --batch 256 --context 32768 ;;
    step-fp4-experts)
        bench 400 v4_fp4 $V4 --expert-weights fp4 --phase decode,prefill --batch 8,64,256 --prefill-batch 1,2,4 \
            --context 32768 --kernel-times 2
        bench 170 v4_fp4_bf16_head $V4 --expert-weights fp4 --head-dtype bfloat16 --phase decode --batch 64,256 \
            --context 32768 ;;
    step-v41-fp4-experts)
        bench 560 v41_fp4 $V41 --expert-weights fp4 --phase decode,prefill --batch 8,64,256 --prefill-batch 1 \
            --context 4096,32768 --kernel-times 2 ;;
    step-index-keys)
        for keys in model fp4; do
            bench 280 v4_fp4_index_keys_$keys $V4 --expert-weights fp4 --index-keys $keys --phase decode \
                --batch 64 --context 131072 --time-budget 200
        done ;;
    mhc)
        limit 70 python -m pytest -q -m gpu -p no:cacheprovider tests/test_mhc_kernels.py 2>&1 | tail -3
        limit 90 python -m experiments.probes.mhc_kernels --coef-tilings 16x1,32x1,64x2 2>&1 | grep "^|"
        for impl in reference pallas; do
            kt=""; [ "$impl" = pallas ] && kt="--kernel-times 2"
            bench 190 "v4_release_mhc_$impl" $V4 $RELEASE --mhc-impl $impl --phase decode,prefill --batch 8,64,256 \
                --prefill-batch 2 --context 32768 $kt
        done ;;
    step-trace)
        bench 200 v4_release_trace $V4 $RELEASE --phase decode,prefill --batch 64 --prefill-batch 2 \
            --context 32768 --trace "$OUTDIR/trace" --repeats 5 ;;
    step-scale)
        for n in 28 26 24; do
            rows=$(bench 280 "v4_release_${n}l" --preset v4-flash --layers $n $RELEASE --scan-layers --phase decode \
                --batch 64 --context 32768)
            echo "$n layers: $rows"
            echo "$rows" | grep -qE "^\| decode .*\| [0-9.]+ \| [0-9.]+-[0-9.]+ \|" && break  # timed: stop; else the next count
        done ;;
    step-realistic)
        bench 240 v4_release_realistic $V4 $RELEASE --mode realistic --phase decode --batch 64 --context 32768 ;;
    peer-ours)
        for fmt in "$RELEASE" ""; do
            bench 140 peer $V4 $fmt --phase prefill --prefill-batch 1 --context 0
            bench 140 peer $V4 $fmt --phase decode --batch 64 --context 1024
        done ;;
    peer-hf)
        (wheels && limit 240 python -m experiments.peer_hf --phase prefill --batch 1 --new-tokens 4096 &&
         limit 240 python -m experiments.peer_hf --phase decode --batch 64 --context 1024 --rows 4) 2>&1 |
            grep -E "^\| |rror" | cut -c1-200 ;;
    multi-gpu-sweep)
        limit 590 python -m experiments.sweep --spec experiments/sweeps/h200x2_ep.yaml --name h200x2-ep --quiet \
            2>&1 | tail -20 ;;
    multi-gpu-43l-b64)
        bench 590 h200x2_43l_release $V4_43 $RELEASE --mesh 1,2,1 --phase decode --batch 64 --context 32768 ;;
    multi-gpu-43l-b256)
        bench 590 h200x2_43l_release $V4_43 $RELEASE --mesh 1,2,1 --phase decode,prefill --batch 256 \
            --prefill-batch 2 --context 32768 ;;
    multi-gpu-ep2)
        bench 230 h200x2_ep2_kernels $V4 --expert-weights fp4 --mesh 1,2,1 --phase decode --batch 256 \
            --context 32768 --kernel-times 3
        bench 170 h200x2_ep2_realistic $V4 --expert-weights fp4 --mesh 1,2,1 --mode realistic --phase decode \
            --batch 64 --context 32768
        limit 150 python -m experiments.bench_ep --mesh 1,2,1 --expert-weights fp4 --transport gather \
            --strategy all_to_all --tokens 64,256,2048 --repeats 10 2>&1 | grep -E "^\| |rror" ;;
    compile-time)
        for fmt in "--expert-weights fp4" "$RELEASE"; do
            limit 280 python -m experiments.compile_time $V4_43 --compile-cache off --moe-impl pallas \
                --attention-impl pallas $fmt \
                2>&1 | grep -E "^\| |rror"
        done ;;
    compile-time-scan|compile-time-scan-x2)
        mesh=""; [ "$suite" = compile-time-scan-x2 ] && mesh="--mesh 1,2,1"
        cache=$(mktemp -d)
        for preset in "--preset v4-flash-4l" "$V4_43" "$V4_43"; do  # cold, cold, warm
            limit 190 python -m experiments.compile_time $preset --scan-layers --compile-cache "$cache" $mesh \
                --moe-impl pallas --attention-impl pallas $RELEASE 2>&1 | grep -E "^\| |rror"
        done ;;
    compile-time-autotune)
        (
            export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
            limit 190 python -m experiments.compile_time $V4_43 --scan-layers --compile-cache off --steps verify \
                --moe-impl pallas --attention-impl pallas $RELEASE 2>&1 | grep -E "^\| |rror"
            bench 250 v4_release_autotune0 $V4 $RELEASE --compile-cache off --phase decode --batch 64 --context 32768 \
                --kernel-times 2
        ) ;;
    kernels-attention)
        limit 300 python -m experiments.bench_kernels --only attention_decode,attention_prefill --out "$OUTDIR" \
            2>&1 | grep -E "^\| |rror" | cut -c1-200
        limit 280 python -m experiments.bench_kernels --only indexer_decode,indexer_prefill --out "$OUTDIR" \
            2>&1 | grep -E "^\| |rror" | cut -c1-200 ;;
    kernels-moe)
        moe 210 --routing balanced --quick --regime decode --formats bf16,fp8,fp4
        moe 200 --routing balanced --quick --regime prefill --formats bf16,fp4
        moe 150 --routing balanced --quick --regime prefill,decode --formats fp8 --act-block 128 \
            --impls xla,triton,mgpu ;;
    kernels-moe-random)
        moe 150 --routing random --quick --regime prefill --formats bf16,fp4 --impls mgpu,layer
        moe 120 --routing random --quick --regime prefill --formats fp8 --act-block 128 --impls mgpu ;;
    vendor-gemm)
        limit 200 python -m experiments.probes.vendor_gemm_ceiling 2>&1 | grep -v Warning
        XLA_FLAGS=--xla_gpu_enable_triton_gemm=false limit 90 python -m experiments.probes.vendor_gemm_ceiling \
            --dtypes fp8 2>&1 | grep -v Warning
        limit 90 python -m experiments.probes.vendor_gemm_ceiling --torch 2>&1 | grep -v Warning ;;
    engram)
        limit 560 python -m experiments.bench_engram --rows 16000000 --tokens 1,64,256,4096 --repeats 20 \
            --out "$OUTDIR" 2>&1 | grep -E "^\| |rror" ;;
    gpu-tests)
        limit 560 python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -15 ;;
    batch-invariance|batch-invariance-bf16|batch-invariance-kernels)
        # unpiped: a test run cut at its bound still shows the tests it finished
        case $suite in
            batch-invariance) only="reference" ;;
            batch-invariance-bf16) only="reference and bfloat16" ;;
            *) only="fp4-kernels or release-kernels" ;;
        esac
        limit 560 python -m pytest -q -m gpu -p no:cacheprovider tests/test_batch_invariance.py -k "$only" \
            ${INVARIANT_BLOCKS:+--invariant-blocks "$INVARIANT_BLOCKS"} 2>&1 ;;
    batch-invariance-cost)
        bench 250 v4_release_batch_invariant $V4 $RELEASE --batch-invariant both --phase decode,prefill --batch 8,64 \
            --prefill-batch 1 --context 32768 --time-budget 210
        limit 150 python -m experiments.probes.fp8_linear --rows 32,256,4096 --ways dequantised,invariant \
            --invariant-block-m 32,64,128 --projections wq_a,wq_b,wo_b 2>&1 | grep -E "^\||rror" ;;
    *)
        echo "unknown suite $suite"; exit 2 ;;
    esac
done
# a call returns at most 8 files: one archive
if [ -n "${OUT:-}" ]; then
    (cd "$OUT" && tar czf results.tgz --remove-files --exclude results.tgz -- * 2>/dev/null; ls -l)
fi
