"""Cross-machine determinism, checked on one machine by forcing MKL onto other instruction paths.

torch's CPU build does its float32 matrix products in MKL, which picks a code path by CPU (SSE4.2, AVX, AVX2,
AVX-512); the paths round differently.  ``MKL_ENABLE_INSTRUCTIONS`` caps the path on an Intel CPU (an AVX-512
machine then computes as an AVX2 or SSE4.2 one does); on an AMD CPU MKL ignores it and ``MKL_CBWR=COMPATIBLE``
is what moves it off its own path.  In a subprocess per setting this runs the golden tests (every codec's decode
and re-encode against the stored files, kvtc's within SPEC's tolerance) and encodes real SmolLM2 KV with every
codec but kvtc: those bytes must be the same under every setting (SPEC "Determinism")."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETTINGS = [{"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, {"MKL_CBWR": "COMPATIBLE"}]
# every codec whose bytes SPEC promises on every machine, at settings that reach its float computations: steps
# from the data's statistics (cachegen without a profile, kvfetcher's spreads), two chunk sizes
SPECS = ["raw", "fp8", "zstd", "kivi:bits=2,group=16", "kivi:bits=4", "cachegen:level=0", "cachegen:level=2",
         "lmcache-cachegen", "lmcache-cachegen:deep_bins=32", "kvfetcher"]

DIGESTS = """
import hashlib, json, sys
from importlib.resources import files
import kvcodec
from kvcodec.cli import parse_codec
source = kvcodec.decode((files("kvcodec.formats") / "golden" / "raw-f16.kvc").read_bytes())
out = {}
for spec in json.loads(sys.argv[1]):
    for grid in ({}, {"chunk_tokens": 16}):
        blob = kvcodec.encode(source, parse_codec(spec), **grid)
        out[f"{spec} {grid}"] = hashlib.sha256(blob).hexdigest()
print(json.dumps(out))
"""


def _env(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")}
    return env | setting | {"PYTHONDONTWRITEBYTECODE": "1"}


def _run(args: list[str], setting: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_env(setting), capture_output=True, text=True,
                          timeout=300)


def _digests(setting: dict[str, str]) -> dict[str, str]:
    done = _run(["-c", DIGESTS, json.dumps(SPECS)], setting)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_golden_tests_pass_on_another_instruction_path(setting):
    done = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_golden.py"], setting)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_every_codec_but_kvtc_encodes_the_same_bytes_on_every_instruction_path():
    here = _digests({})
    assert len(here) == 2 * len(SPECS)
    for setting in SETTINGS:
        there = _digests(setting)
        assert there == here, f"under {setting}: {sorted(k for k in here if there.get(k) != here[k])} differ"


def test_a_different_instruction_path_is_noticed():
    """The settings above must change something, or the tests above check nothing: under at least one of them
    MKL's float32 matrix product rounds differently from the default path here."""
    probe = ("import hashlib, torch; g = torch.Generator().manual_seed(0); torch.set_num_threads(1); "
             "a, b = torch.randn(64, 384, generator=g), torch.randn(384, 96, generator=g); "
             "print(hashlib.sha256((a @ b).numpy().tobytes()).hexdigest())")
    results = {json.dumps(s): _run(["-c", probe], s).stdout.strip() for s in [{}] + SETTINGS}
    assert all(len(r) == 64 for r in results.values()), results
    assert len(set(results.values())) > 1, "no MKL setting changed a float32 matrix product on this machine"
