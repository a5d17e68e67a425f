#!/usr/bin/env bash
# Set up .venv and run the whole test suite (real SmolLM2 KV is dumped once and cached in .cache/), then set up
# .venv-engines and run the engine tests (tests/engines/) against the real vLLM (CPU build), LMCache and Mooncake,
# then .venv-sglang and the SGLang HiCache backend's tests (tests/sglang_hicache/) against SGLang's own classes.
# With arguments (e.g. tests/test_store.py -k redis), only the main suite runs, with those arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
    . .venv/bin/activate
    exec python -m pytest -q "$@"
fi
bash scripts/setup_engines.sh
bash scripts/setup_sglang.sh
status=0
(. .venv/bin/activate && python -m pytest -q) || status=$?
echo "test.sh: engine tests (tests/engines/) in .venv-engines: vLLM's CPU build, LMCache and Mooncake, about 15 minutes"
(. .venv-engines/bin/activate && python -m pytest -q tests/engines) || status=$?
echo "test.sh: SGLang HiCache backend tests (tests/sglang_hicache/) in .venv-sglang: about 2 minutes"
(. .venv-sglang/bin/activate && python -m pytest -q tests/sglang_hicache) || status=$?
exit "$status"
