#!/usr/bin/env bash
# Fetch, here, the cp312 wheels that the GPU machine's image lacks, into .whl/ (git-ignored via
# .git/info/exclude), one folder per bench so each device run carries only what it needs (64 MiB a call).
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
du -sh .whl/*
