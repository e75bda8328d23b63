#!/usr/bin/env bash
# One nvidia-h200-x2 device call (<= 10 minutes) for issues 10 and 11; run from the repo root, .whl carried
# (transformers 5.24 for the HF peer). Two-GPU runs first, then two single-GPU chains in parallel, one per
# GPU (each process sees one GPU). Every script copies its results to $OUT, archived at the end.
#   bash experiments/device/h200x2_tables.sh
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
B="python -m experiments.bench --quiet --mode deepinfer --moe-impl pallas --attention-impl pallas"
# 1. expert / data parallel on both GPUs, FP4 experts, attention kernels per batch shard
timeout 150 python -m experiments.sweep --spec experiments/sweeps/h200x2_ep.yaml --name h200x2-ep-bp \
    --mesh "1,2,1;2,1,1" --batch 64,256 --quiet | tail -1
cp experiments/results/sweep_h200x2-ep-bp* "$OUT"/
# 2a. GPU 0: bf16 at 1K/4K contexts (the 32K points are in results/bench_20261129-164717_gpu_h200.md),
#     then FP4 experts at 32K
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  timeout 140 $B --phase decode --batch 8,64,256 --context 1024,4096 --tag h200_bf16_ctx4k
  timeout 90 $B --phase prefill --prefill-batch 1,4 --context 0,4096 --tag h200_bf16_prefill4k
  timeout 130 $B --phase decode,prefill --batch 8,64,256 --prefill-batch 1,4 --context 32768 \
      --expert-weights fp4 --tag h200_fp4
}
# 2b. GPU 1: the release's formats (FP8 dense + FP4 experts), V4.1 widths, the HF peer, 43-layer compile
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  timeout 110 $B --phase decode,prefill --batch 8,64,256 --prefill-batch 1 --context 32768 \
      --dense-weights fp8 --expert-weights fp4 --tag h200_fp8_fp4
  timeout 110 $B --preset v41-flash --layers 4 --phase decode,prefill --batch 8,64,256 --prefill-batch 1 \
      --context 32768 --tag h200_v41_4l
  (python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site JAX_PLATFORMS=cpu &&
   timeout 60 python -m experiments.peer_hf --phase prefill --batch 1 --new-tokens 4096 &&
   timeout 60 python -m experiments.peer_hf --phase decode --batch 8,64 --context 1024 --rows 1,4)
  timeout 120 python -m experiments.compile_time --preset v4-flash --moe-impl pallas --attention-impl pallas \
      --expert-weights fp4
}
gpu0 > "$OUT"/gpu0.log 2>&1 &
gpu1 > "$OUT"/gpu1.log 2>&1 &
wait
tail -n 5 "$OUT"/gpu0.log "$OUT"/gpu1.log
# a call returns at most 8 files: one archive
(cd "$OUT" && tar czf results.tgz --remove-files -- * && ls -l)
