#!/usr/bin/env bash
# Set up .venv, then the main job on real data: dump a real SmolLM2 KV cache, compress it, inspect and
# verify the container, decode it, and measure size, perplexity change and speed of each codec.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p out
set -x
kvcodec dump --model smollm2 --text license:GPL-3 --tokens 1536 -o out/kv.safetensors
kvcodec encode out/kv.safetensors -o out/kv.kvc --codec cachegen
kvcodec info out/kv.kvc
kvcodec verify out/kv.kvc --against out/kv.safetensors
kvcodec decode out/kv.kvc -o out/kv-decoded.safetensors
kvcodec bench out/kv.safetensors --codec raw --codec kivi:bits=4 --codec lmcache-cachegen --codec cachegen --codec kvfetcher
kvcodec eval --codec raw --codec kivi:bits=2 --codec kivi:bits=4 --codec lmcache-cachegen \
    --codec cachegen:level=0 --codec cachegen --codec cachegen:level=4 --codec kvfetcher --plot out/rate-distortion.png \
    --json-file out/eval.json
set +x
python scripts/demo_summary.py out/eval.json
