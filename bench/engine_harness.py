"""The one place bench reaches into tests/: the harnesses of the real engines that tests and benches both drive.

``tests/engines/`` drives the real engines (``vllm_engine``: vLLM's server in a child process; ``lmcache_engine``: an
``LMCacheEngine`` on the CPU; ``lmcache_server``: LMCache's multiprocess server), ``tests/sglang_hicache/`` SGLang's
host pools, ``tests/test_mooncake_tier`` a ``mooncake_master`` and ``tests/test_golden`` spec/kvtc.md's decoding
tolerance.  Until they move into :mod:`kvcodec.tools` (as the Redis server and the shaped link have, issue 32), a
bench imports this module first (it puts those folders on ``sys.path``) and then them.  :func:`vllm_prompt` is the
model folder and prompt the vLLM benches share.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HARNESSES = (REPO / "tests" / "engines", REPO / "tests" / "sglang_hicache", REPO / "tests")
sys.path[:0] = [str(p) for p in HARNESSES if str(p) not in sys.path]


def vllm_prompt(tokens: int) -> tuple[Path, list[int], list[int]]:
    """SmolLM2's HuggingFace folder (made once, cached in ``.cache/models``), the first ``tokens`` token ids of
    ``license:GPL-3`` and a 256-token warm-up prompt from later in the same text (no prefix in common)."""
    from transformers import AutoTokenizer

    from kvcodec.tools.models import export_hf_folder
    from kvcodec.texts import load_text

    model = Path(export_hf_folder("smollm2", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"))
    ids = AutoTokenizer.from_pretrained(model)(load_text("license:GPL-3")).input_ids
    return model, ids[:tokens], ids[4000:4000 + 256]
