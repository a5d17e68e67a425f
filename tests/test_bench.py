"""bench/ measures kvcodec through its public API: no script reaches a private name of kvcodec's, and none changes
sys.path (to reach into tests/, say).  What tests and benches share is tooling: the Redis server and shaped link, the
engine harnesses (kvcodec.tools.harness) and kvtc's decoding tolerance (kvcodec.tools.kvtc_tolerance)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
SCRIPTS = sorted(BENCH.rglob("*.py"))
TEST_MODULES = {p.stem for p in (REPO / "tests").rglob("*.py")}


def _private_uses(path: Path) -> set[str]:
    """Names starting with one underscore that ``path`` imports from kvcodec or reads off an object not its own."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcodec"):
            found |= {a.name for a in node.names if a.name.startswith("_")}
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
    return found


def _touches_sys_path(path: Path) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(ast.parse(path.read_text(), str(path))))


def test_the_scans_see_what_they_look_for(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nfrom kvcodec.tools.evaluate import _score\nsys.path.insert(0, 'tests')\n"
                      "r._container.read_frame(0)\nself._mine, type(r).__name__\n")
    assert _private_uses(script) == {"_score", "_container"}
    assert _touches_sys_path(script)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(BENCH).as_posix())
def test_bench_reaches_no_private_names(path):
    left = _private_uses(path)
    assert not left, f"bench/{path.relative_to(BENCH).as_posix()} reaches private names {sorted(left)}: use or add a public API"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(BENCH).as_posix())
def test_bench_puts_nothing_on_sys_path(path):
    assert not _touches_sys_path(path), (
        f"bench/{path.relative_to(BENCH)} changes sys.path: what it needs from tests/ belongs in kvcodec.tools")


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(BENCH).as_posix())
def test_bench_imports_no_test_module(path):
    left = _imported_modules(path) & TEST_MODULES
    assert not left, f"bench/{path.relative_to(BENCH)} imports {sorted(left)} from tests/: move it into kvcodec.tools"


@pytest.mark.parametrize("path", sorted((REPO / "kvcodec" / "tools").rglob("*.py")),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_tooling_shared_with_bench_needs_no_test_framework(path):
    """Benches run without pytest: what tests and benches share reports a missing engine as an UnsupportedError or a
    reason, and the tests make it a skip."""
    left = _imported_modules(path) & {"pytest", "hypothesis"}
    assert not left, f"{path.relative_to(REPO)} imports {sorted(left)}"


def test_started_redis_without_redis_server_says_what_to_install(tmp_path, monkeypatch):
    from kvcodec.errors import UnsupportedError
    from kvcodec.tools.redis_server import started_redis

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UnsupportedError, match="apt-get install -y redis-server"):
        started_redis(tmp_path)


def test_quality_is_none_lost_from_the_reference_and_some_from_a_damaged_cache(smollm2):
    from kvcodec.cache import KVCache
    from kvcodec.tools.evaluate import prepare, quality

    case = prepare(smollm2, "license:GPL-3", 64, 32)
    same = quality(smollm2, case, case.kv)
    assert same.ppl_change == pytest.approx(0, abs=1e-6) and same.kl == pytest.approx(0, abs=1e-6)
    assert same.agreement == 1
    # the studies' hybrids: some tensors of the cache replaced (here the values, by zeros)
    damaged = KVCache([(l.keys, l.values * 0) for l in case.kv.layers], model=case.kv.model,
                      token_ids=case.kv.token_ids, rope=case.kv.rope)
    worse = quality(smollm2, case, damaged)
    assert worse.kl > 0.01 and worse.ppl_change > 0 and worse.agreement < 1
