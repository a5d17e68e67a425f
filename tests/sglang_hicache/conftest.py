"""Fixtures for the tests of kvcodec's HiCache storage backend against SGLang's own classes, on the CPU.

These tests run in ``.venv-sglang`` (``bash scripts/setup_sglang.sh``, then
``.venv-sglang/bin/python -m pytest -q tests/sglang_hicache``).  The pools are SGLang's: a device pool
(``MHATokenToKVPool``) built on the CPU, and host pools (``MHATokenToKVPoolHost``, SGLang's L2) in each of the
layouts the backend reads, sized for SmolLM2-135M (30 layers, 3 KV heads of 64).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    raise pytest.UsageError("tests/sglang_hicache/ needs sglang: run them in .venv-sglang (bash scripts/setup_sglang.sh; "
                            ".venv-sglang/bin/python -m pytest -q tests/sglang_hicache)")

from kvcodec.tools.harness.sglang_pools import DIM, HEADS, LAYERS, TOKENS  # noqa: E402


@pytest.fixture(scope="session")
def real_pages(real_kv):
    """The first 512 tokens of a real SmolLM2 float16 cache (8 pages of 64) and made-up token ids for them."""
    from kvcodec.cache import KVCache

    kv = KVCache([(l.keys[:, :TOKENS].contiguous(), l.values[:, :TOKENS].contiguous()) for l in real_kv.layers])
    assert (kv.num_layers, kv.shapes[0].heads, kv.shapes[0].key_dim) == (LAYERS, HEADS, DIM)
    return kv, list(range(1000, 1000 + TOKENS))
