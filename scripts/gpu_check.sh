#!/usr/bin/env bash
# One run on a lent GPU machine (the `device` tool): install kvcodec and the wheels its image lacks, run a GPU
# bench, and leave its table and log in $OUT.  The image has torch and triton but not constriction, zstandard,
# av or PyNvVideoCodec, and cannot download; fetch their cp312 wheels here first (scripts/gpu_wheels.sh).
#
#   device run:  bash scripts/gpu_check.sh cachegen [bench options]     carry: .whl/cachegen, .cache/test-kv
#                bash scripts/gpu_check.sh kvfetcher [bench options]    carry: .whl/kvfetcher, .cache/gpu-kv (real KV
#                                                                       cut to fit; else synthetic)
#                bash scripts/gpu_check.sh kvtc [bench options]         carry: .whl/kvtc (its correctness check reads
#                                                                       kvcodec/formats/golden; its speed, synthetic 8B-shaped
#                                                                       chunks); an estimated 4-5 min at its defaults
#                bash scripts/gpu_check.sh load [bench options]         carry: .whl/cachegen (the store's load path
#                                                                       into GPU paged layouts, bit-exact, then GB/s)
set -euo pipefail
cd "$(dirname "$0")/.."
bench=${1:?usage: gpu_check.sh cachegen|kvfetcher|kvtc|load [bench options]}
shift
out=${OUT:-/tmp/kvcodec-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/kvcodec-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PYTHONPATH" \
    .whl/"$([ "$bench" = load ] && echo cachegen || echo "$bench")"/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$PYTHONPATH" .
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ -d .cache/gpu-kv ]; then mkdir -p .cache/test-kv && cp .cache/gpu-kv/*.safetensors .cache/test-kv/; fi
status=0
python3 "bench/gpu_$bench.py" "$@" 2>&1 | tee "$out/gpu_$bench.log" || status=$?
cp "bench/results/gpu_$bench.md" "$out/" 2>/dev/null || true
exit "$status"
