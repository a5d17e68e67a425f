"""A short run of bench/fault_load.py: 8 processes share one KVStore (a disk folder and a real redis-server) under
injected faults, and every chunk they load is checked bit for bit against its reference decode.

Part of the default suite (not marked slow): about a minute on two busy cores.  It needs redis-server (skipped
with a message without it) and root for the disk-full fault (that fault alone is skipped, with a warning, without
root); CI runs as root, so there every fault runs.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _harness():
    sys.path.insert(0, str(REPO / "bench"))  # as when it runs as a script: its harness imports live beside it
    spec = importlib.util.spec_from_file_location("fault_load", REPO / "bench" / "fault_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_load"] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_fault_load(real_dump, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH: the fault-and-load test needs a real Redis "
                    "(Debian: apt-get install -y redis-server; scripts/setup.sh does it when run as root)")
    fl = _harness()
    cfg = fl.Config(workers=8, seconds=30, rounds=1, tokens=192, chunk_tokens=64, codec="cachegen")
    kv = [real_dump("license:GPL-3", 512), real_dump("pydoc-topics", 300)]  # dumps other tests share
    messages = []
    rep = fl.run(cfg, kv, tmp_path / "fault_load", folder=tmp_path / "run", log=messages.append)
    for m in rep["skipped"]:
        warnings.warn(m)
    table = (tmp_path / "fault_load.md").read_text()

    assert rep["worker_processes"] >= 8 and rep["counts"]["loads"] >= 40 and rep["counts"]["chunks_served"] > 0, table
    faults = rep["faults"]
    for name in cfg.faults:
        if name == "disk-full" and rep["skipped"]:
            continue
        assert faults[name]["injected"] >= 1, f"fault {name} was never injected\n{table}"

    final = rep["final"]
    assert final["tmp_files_after_reopen"] == [], table
    assert final["redis_clients_left"] == [], table
    assert rep["processes_left"] == [], table
    assert final["rewrite_ok"], table
    assert set(rep["worker_exit_codes"].values()) <= {0, -9}, table
    assert not rep["load_exceptions"], table

    # Wrong chunks from anything but a value of another configuration would be a bug in the store or the tiers.
    others = {n: row["wrong_chunks"] for n, row in faults.items() if not n.startswith("foreign")}
    assert not any(others.values()), f"wrong chunks served: {others}\n{table}"
    # Today's store checks only the model string and token ids of a stored value, so another codec's (or codec
    # setting's) container for the same tokens passes as this configuration's: these fail until stored values
    # carry a digest of their key's identity (issue 19).
    foreign = {n: row["wrong_chunks"] for n, row in faults.items() if n.startswith("foreign")}
    assert rep["wrong_chunks_served"] == 0, f"wrong chunks served: {foreign}\n{table}"
