"""Makes the engine harnesses of the test suite importable by the benches that time the same engines.

``tests/engines/`` drives the real engines (``vllm_engine``: vLLM's server in a child process; ``lmcache_engine``: an
``LMCacheEngine`` on the CPU) and ``tests/redis_process`` a loopback redis-server.  They are test helpers, not part
of the package, so a bench imports this module first (it puts both folders on ``sys.path``) and then them.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(p) for p in (REPO / "tests" / "engines", REPO / "tests") if str(p) not in sys.path]
