#!/usr/bin/env bash
# Named GPU suites, rerunnable on one H200 (the device tool runs this from the repo root; results land in
# experiments/results and in $OUT, archived into one file at the end):
#   bash experiments/device/suites.sh SUITE [SUITE ...]
# Suites:
#   step-release    the whole step in the release format (FP8 dense + FP4 experts), v4-flash-4l and
#                   v41-flash 4 layers: verify 8 / 64 / 256 x 4 and prefill 1 / 2 x 4096 at 32K, benchmark mode,
#                   per-component breakdown (--kernel-times)
#   step-release-targets   the same at the issue targets' points only (V4: verify 8/64/256, prefill 2;
#                   V4.1: verify 64, prefill 1)
#   step-bf16       the same two models in bf16 (dense and experts) at verify 64 x 4 and prefill 2 x 4096
#   step-realistic  realistic mode (router's own choices, distinct prompts, the whole speculative step),
#                   release format, verify 64 x 4 at 32K
#   peer-ours       ours (release format and bf16) at the peer's shapes: prefill 1 x 4096 with no context,
#                   verify 64 x 4 at 1K context
#   peer-hf         HF transformers (bf16, eager) at the same shapes (carry .whl: transformers 5.24)
#   gpu-tests       the GPU tests (pytest -m gpu)
# Environment: BENCH_ARGS adds arguments to every bench run; SUITE_TIMEOUT (s) bounds each command (default 240).
set -u
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
T=${SUITE_TIMEOUT:-240}
B="python -m experiments.bench --quiet --moe-impl pallas --attention-impl pallas ${BENCH_ARGS:-}"
RELEASE="--dense-weights fp8 --expert-weights fp4"
V4="--preset v4-flash-4l"
V41="--preset v41-flash --layers 4 --engram-vocab 160000"   # small Engram tables, the same lookups

bench() {  # bench TAG ARGS...: one bench.py run, its table's last lines on stdout
    local tag=$1; shift
    timeout "$T" $B "$@" --tag "$tag" 2>&1 | grep -E "^\| (prefill|decode)|rror|refused" | cut -c1-220
}

wheels() {  # the carried wheels (.whl) into /tmp/site, on PYTHONPATH
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
}

for suite in "$@"; do
    echo "== $suite"
    case "$suite" in
    step-release)
        bench v4_release $V4 $RELEASE --phase decode,prefill --batch 8,64,256 --prefill-batch 1,2 --context 32768 \
            --kernel-times 2
        bench v41_release $V41 $RELEASE --phase decode,prefill --batch 8,64,256 --prefill-batch 1,2 \
            --context 32768 --kernel-times 2 ;;
    step-release-targets)
        bench v4_release $V4 $RELEASE --phase decode,prefill --batch 8,64,256 --prefill-batch 2 --context 32768 \
            --kernel-times 2
        bench v41_release $V41 $RELEASE --phase decode,prefill --batch 64 --prefill-batch 1 --context 32768 \
            --kernel-times 2 ;;
    step-bf16)
        bench v4_bf16 $V4 --phase decode,prefill --batch 64 --prefill-batch 2 --context 32768 --kernel-times 2 ;;
    step-realistic)
        bench v4_release_realistic $V4 $RELEASE --mode realistic --phase decode --batch 64 --context 32768 ;;
    peer-ours)
        for fmt in "$RELEASE" ""; do
            bench peer $V4 $fmt --phase prefill --prefill-batch 1 --context 0
            bench peer $V4 $fmt --phase decode --batch 64 --context 1024
        done ;;
    peer-hf)
        (wheels && timeout "$T" python -m experiments.peer_hf --phase prefill --batch 1 --new-tokens 4096 &&
         timeout "$T" python -m experiments.peer_hf --phase decode --batch 64 --context 1024 --rows 4) 2>&1 |
            grep -E "^\| |rror" | cut -c1-200 ;;
    gpu-tests)
        timeout "$T" python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -15 ;;
    *)
        echo "unknown suite $suite"; exit 2 ;;
    esac
done
# a call returns at most 8 files: one archive
if [ -n "${OUT:-}" ]; then
    (cd "$OUT" && tar czf results.tgz --remove-files --exclude results.tgz -- * 2>/dev/null; ls -l)
fi
