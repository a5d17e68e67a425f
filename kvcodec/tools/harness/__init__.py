"""Real engines and servers that the tests and the benches both drive, each in a module of its own:
:mod:`~kvcodec.tools.harness.vllm_server` (vLLM's CPU build in a child process), :mod:`~.lmcache_engine` (an
``LMCacheEngine`` on the CPU), :mod:`~.lmcache_server` (LMCache's multiprocess server and its bench client),
:mod:`~.mooncake` (a ``mooncake_master`` and a segment holder) and :mod:`~.sglang_pools` (SGLang's host pools).

Each imports its engine when used, so it runs only in that engine's environment (``.venv-engines``,
``.venv-sglang``).  What an environment lacks is an :class:`~kvcodec.errors.UnsupportedError` or a reason returned,
never a test-framework call: the tests turn it into a skip."""
