#!/usr/bin/env bash
# One run on a lent GPU machine (the `device` tool): unpack the packages its image lacks, run the GPU
# benches, and leave their tables and logs in $OUT.  Make what it carries here first: bash scripts/gpu_wheels.sh.
#
#   device run:  bash scripts/gpu_check.sh            carry: .whl, .cache/bench-kv
#
# With no argument it runs every GPU bench, each correctness first, then timings, each under its own time limit so
# one that hangs leaves the others their time (a session's device time is 15 minutes, the machine's start
# included): cachegen's kernels, kvfetcher's NVDEC decode, kvtc's device decode and the store's load into paged
# memory.  `gpu_check.sh NAME [bench options]` runs one (cachegen, kvfetcher, kvtc or load) with its own options.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcodec-gpu}
mkdir -p "$out"
site=/tmp/kvcodec-site
mkdir -p "$site"
tar -C "$site" -xJf .whl/site.tar.xz || exit
# kvcodec from this checkout, not pip-installed: its pyproject needs setuptools 77, which the image may not have.
export PYTHONUNBUFFERED=1 PYTHONPATH="$site:$PWD"
# The real KV the benches read: that machine cannot run the model, so the dump made here travels (bench/real_kv.py).
KVCODEC_BENCH_KV=$(ls .cache/bench-kv/license-GPL-3-512-float16-*.safetensors | tail -n 1) || exit
export KVCODEC_BENCH_KV
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
run() {  # run LIMIT_S NAME [options]: one bench, its log and table into $out
    local limit=$1 name=$2
    shift 2
    echo "=== gpu_$name ($limit s at most): $*"
    timeout "$limit" python3 "bench/gpu_$name.py" "$@" > "$out/gpu_$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/gpu_$name.log"
    cp "bench/results/gpu_$name.md" "$out/" 2>/dev/null
    echo "=== gpu_$name: exit $rc"
    return "$rc"
}
if [ "$#" -gt 0 ]; then
    name=$1
    shift
    run 590 "$name" "$@"
    exit
fi
# Limits from the first device run as one call (H200, 2026-12-04: load needed about 70 s, cold); sizes cut where a
# default would not fit beside the others.
status=0
run 130 cachegen --tokens 256,2048,8192 --repeat 20 || status=1
run 90 kvfetcher --layers 8 --tokens 2048 || status=1
run 150 kvtc --tokens 256,2048 --repeat 10 || status=1
run 120 load || status=1
exit "$status"
