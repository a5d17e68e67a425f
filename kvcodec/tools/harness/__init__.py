"""Real engines and servers that the tests and the benches both drive, each in a module of its own:
:mod:`~kvcodec.tools.harness.vllm_server` (vLLM's CPU build in a child process), :mod:`~.lmcache_engine` (an
``LMCacheEngine`` on the CPU), :mod:`~.lmcache_server` (LMCache's multiprocess server and its bench client),
:mod:`~.mooncake` (a ``mooncake_master`` and a segment holder) and :mod:`~.sglang_pools` (SGLang's host pools).

Each imports its engine when used, so it runs only in that engine's environment (``.venv-engines``,
``.venv-sglang``).  What an environment lacks is an :class:`~kvcodec.errors.UnsupportedError` or a reason returned,
never a test-framework call: the tests turn it into a skip."""

import time
from collections.abc import Callable
from typing import Any


def wait_until(what: str, cond: Callable[[], Any], timeout_s: float = 60) -> None:
    """Poll ``cond`` until it holds, or fail with ``what`` after ``timeout_s``: what an engine writes behind its
    replies (the vLLM connector's saves, LMCache's L2) reaches the store a little after them."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)
