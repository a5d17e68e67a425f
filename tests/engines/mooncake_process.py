"""Mooncake Store for the engine tests and benches: the check that Mooncake imports in this venv, a real
``mooncake_master`` (``tests/test_mooncake_tier.Master``) and a segment holder.

Mooncake keeps a value in the memory segment of the client that put it and drops it with that process, so engines
that come and go mount no segment (``mooncake://MASTER?segment=0``) and a :class:`SegmentHolder`, a small process
lending its memory to the store, keeps what they save."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: test_mooncake_tier, redis_process

HOLDER = """
import sys
from kvcodec.store.tiers import MooncakeTier
tier = MooncakeTier(sys.argv[1], segment_bytes=int(sys.argv[2]), buffer_bytes=1 << 20, timeout_s=5, name="holder")
assert tier.available, "the segment holder could not set up with the master"
print("ready", flush=True)
sys.stdin.read()  # until the parent closes our stdin
tier.close()
"""


def master_class() -> Any:
    """``Master`` of ``tests/test_mooncake_tier.py``; without Mooncake a skip, and under CI (whose set-up installs
    it) a failure."""
    import pytest

    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        why = (f"Mooncake Store is unavailable in this venv ({e}): bash scripts/setup_engines.sh installs "
               "mooncake-transfer-engine-non-cuda, which needs libibverbs1 ibverbs-providers (scripts/setup.sh)")
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    from test_mooncake_tier import Master

    return Master


class SegmentHolder:
    """A process lending ``segment_bytes`` of its memory to the Mooncake Store of ``master`` (``HOST:PORT``)."""

    def __init__(self, master: str, segment_bytes: int = 256 << 20) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, master, str(segment_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the Mooncake segment holder did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> SegmentHolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
