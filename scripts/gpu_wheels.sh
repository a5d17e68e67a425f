#!/usr/bin/env bash
# Pack, here, the Python packages that the GPU machine's image lacks (constriction; PyAV and PyNvVideoCodec for
# kvfetcher) into .whl/site.tar.xz (git-ignored via .git/info/exclude), and dump the real KV the benches read
# (.cache/bench-kv).  The image cannot download, and a device call carries at most 64 MiB: the three cp312 wheels
# are 62 MB as deflated wheels, 28 MB unpacked, trimmed (samples, bundled sources) and xz-compressed with duplicate
# libraries stored once.  zstandard (5.5 MB) stays out: only the zstd baseline imports it, and no GPU bench runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/wheels" constriction av PyNvVideoCodec
mkdir -p "$work/site"
for w in "$work"/wheels/*.whl; do (cd "$work/site" && python3 -m zipfile -e "$w" .); done
rm -rf "$work"/site/{samples,benchmarks} "$work"/site/*.data
python3 - "$work/site" <<'PY'
# A wheel cannot hold links, so PyNvVideoCodec ships each FFmpeg library three times; tar stores hard links once.
import hashlib, os, sys
first = {}
for root, _, files in os.walk(sys.argv[1]):
    for name in sorted(files):
        path = os.path.join(root, name)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).digest()
        if digest in first:
            os.remove(path)
            os.link(first[digest], path)
        else:
            first[digest] = path
PY
mkdir -p .whl
tar -C "$work/site" -cJf .whl/site.tar.xz .
du -h .whl/site.tar.xz
.venv/bin/python -c "import sys; sys.path.insert(0, 'bench'); from real_kv import gpl3_dump; print(gpl3_dump(512))"
du -sh .cache/bench-kv
