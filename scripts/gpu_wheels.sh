#!/usr/bin/env bash
# Fetch, here, the cp312 wheels that the GPU machine's image lacks, into .whl/ (git-ignored via
# .git/info/exclude), one folder per bench so each device run carries only what it needs (64 MiB a call), and cut
# the real test dump to what kvfetcher's bench reads, since its wheels leave only ~3 MB of that (.cache/gpu-kv).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
fetch() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d ".whl/$1" "${@:2}"
}
fetch cachegen constriction zstandard
fetch kvfetcher av PyNvVideoCodec constriction  # kvcodec imports zstandard only when the zstd codec runs
fetch kvtc constriction pytest pluggy iniconfig packaging pygments  # gpu_kvtc.py imports tests/test_golden.py (SPEC tolerance)
du -sh .whl/*
dump=$(ls .cache/test-kv/license-GPL-3-512-float16-*.safetensors 2>/dev/null | tail -1 || true)
if [ -n "$dump" ] && [ -x .venv/bin/python ]; then
    .venv/bin/python - "$dump" <<'EOF'
import sys
from pathlib import Path

import kvcodec

kv = kvcodec.KVCache.load_safetensors(sys.argv[1])
cut = kvcodec.KVCache([(k[:, :256].clone(), v[:, :256].clone()) for k, v in kv.layers[:8]], model=kv.model)
Path(".cache/gpu-kv").mkdir(parents=True, exist_ok=True)
cut.save_safetensors(".cache/gpu-kv/license-GPL-3-256-float16-8layers.safetensors")
EOF
    du -sh .cache/gpu-kv
else
    echo "gpu_wheels.sh: no real dump in .cache/test-kv (run the tests once): the kvfetcher bench will use synthetic KV" >&2
fi
