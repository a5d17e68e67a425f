#!/usr/bin/env bash
# Set up .venv and run the whole test suite (real SmolLM2 KV is dumped once and cached in .cache/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
