#!/usr/bin/env bash
# Set up .venv and run the whole test suite (real SmolLM2 KV is dumped once and cached in .cache/), then set up
# .venv-engines and run the engine tests (tests/engines/) against the real vLLM (CPU build), LMCache and Mooncake,
# then .venv-sglang and the SGLang HiCache backend's tests (tests/sglang_hicache/) against SGLang's own classes.
# With arguments (e.g. tests/test_store.py -k redis), only the main suite runs, with those arguments.
#
# The three environments take about 13 GB together (.venv 2.7, .venv-engines 4.2, .venv-sglang 6.2).  On a disk
# with less room than the next one needs, an environment that this run created itself (none that was here before
# it started) is removed once its tests are done, so a fresh clone needs about 7.5 GB free at once, not 13.
set -euo pipefail
cd "$(dirname "$0")/.."
free_mb() { df -Pm . | awk 'NR == 2 { print $4 }'; }
made_here=()
for venv in .venv .venv-engines .venv-sglang; do
    [ -x "$venv/bin/python" ] || made_here+=("$venv")
done
echo "test.sh: $(free_mb) MB free on this disk"
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
    . .venv/bin/activate
    exec python -m pytest -q "$@"
fi
# make_room NEED_MB VENV: before VENV is created, remove the environments this run made whose tests have run.
done_with=()
make_room() {
    [ -x "$2/bin/python" ] && return 0
    local v
    for v in "${done_with[@]}"; do
        [ "$(free_mb)" -ge "$1" ] && return 0
        if [[ " ${made_here[*]} " == *" $v "* ]]; then
            echo "test.sh: $(free_mb) MB free, $2 needs about $1 MB: removing $v, which this run created for its tests"
            rm -rf "$v"
        fi
    done
    [ "$(free_mb)" -ge "$1" ] \
        || echo "test.sh: only $(free_mb) MB free and $2 needs about $1 MB; its installation may fail for lack of space" >&2
}
status=0
(. .venv/bin/activate && python -m pytest -q) || status=$?
done_with+=(.venv)
make_room 5000 .venv-engines
bash scripts/setup_engines.sh
echo "test.sh: engine tests (tests/engines/) in .venv-engines: vLLM's CPU build, LMCache and Mooncake, about 15 minutes"
(. .venv-engines/bin/activate && python -m pytest -q tests/engines) || status=$?
done_with+=(.venv-engines)
make_room 7500 .venv-sglang
bash scripts/setup_sglang.sh
echo "test.sh: SGLang HiCache backend tests (tests/sglang_hicache/) in .venv-sglang: about 2 minutes"
(. .venv-sglang/bin/activate && python -m pytest -q tests/sglang_hicache) || status=$?
exit "$status"
