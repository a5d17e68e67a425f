"""Cross-machine determinism, checked on one machine by forcing MKL onto other instruction paths.

torch's CPU build does its float32 matrix products in MKL, which picks a code path by CPU (SSE4.2, AVX, AVX2,
AVX-512); the paths round differently.  ``MKL_ENABLE_INSTRUCTIONS`` caps the path on an Intel CPU (an AVX-512
machine then computes as an AVX2 or SSE4.2 one does); on an AMD CPU MKL ignores it (measured on an EPYC: no
change at any value) and ``MKL_CBWR=COMPATIBLE`` is what moves it off its own path.  ``ATEN_CPU_CAPABILITY``
does the same for torch's own vectorized kernels.  In subprocesses this runs the golden tests, compares every
codec's bytes on real SmolLM2 KV across settings (all must agree but kvtc's), and checks that a kvtc file made
under one setting decodes under the others within spec/kvtc.md §10.8's tolerance (SPEC.md §10 "Determinism")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvcodec

REPO = Path(__file__).resolve().parent.parent
SETTINGS = [{"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, {"MKL_CBWR": "COMPATIBLE"},
            {"ATEN_CPU_CAPABILITY": "default"}]  # the last: torch's own kernels without SIMD, on every machine
# the whole golden suite under the setting that moves an AVX-512 Intel machine onto another machine's path and
# under the one that moves an AMD machine: each subprocess costs seconds
GOLDEN_SETTINGS = [{"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, {"MKL_CBWR": "COMPATIBLE"}]
# every codec whose bytes SPEC promises on every machine, at settings that reach its float computations: steps
# from the data's statistics (cachegen without a profile, kvfetcher's spreads), two chunk sizes
SPECS = ["raw", "fp8", "zstd", "kivi:bits=2,group=16", "kivi:bits=4", "cachegen:level=0", "cachegen:level=2",
         "lmcache-cachegen", "lmcache-cachegen:deep_bins=32", "kvfetcher"]
KVTC_SPEC = "kvtc:level=4,min_std=0"

# Run under one setting: print every codec's digests of the golden source (real SmolLM2 KV) and of a float32
# matrix product, write this setting's kvtc encode of a longer cache made from it, and, given another setting's,
# write its decode here (raw).
SCRIPT = """
import hashlib, json, sys
from importlib.resources import files
from pathlib import Path
import torch
import kvcodec
from kvcodec.cli import parse_codec
from kvcodec.codecs.kvtc import Calibration, register_calibration
golden = files("kvcodec.formats") / "golden"
source = kvcodec.decode((golden / "raw-f16.kvc").read_bytes())
specs, kvtc_spec, out, other = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
digests = {}
for spec in specs:
    for grid in ({}, {"chunk_tokens": 16}):
        digests[f"{spec} {grid}"] = hashlib.sha256(kvcodec.encode(source, parse_codec(spec), **grid)).hexdigest()
cal = register_calibration(Calibration.from_bytes((golden / "kvtc-calibration.kvtc").read_bytes()))
# 16 copies of the golden tokens, each scaled a little differently: enough coefficients that some lie within
# float32 rounding of a half-step
longer = kvcodec.KVCache([(torch.cat([l.keys.float() * (1 + 0.013 * i) for i in range(16)], 1).half(),
                           torch.cat([l.values.float() * (1 - 0.011 * i) for i in range(16)], 1).half())
                          for l in source.layers], model=source.model, rope="pre")
longer.save_safetensors(out / "longer.safetensors")
(out / "kvtc.kvc").write_bytes(kvcodec.encode(longer, parse_codec(kvtc_spec, [f"calibration={cal.digest}"])))
if other:
    (out / "other-decoded.kvc").write_bytes(kvcodec.encode(kvcodec.decode((Path(other) / "kvtc.kvc").read_bytes()), "raw"))
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
product = torch.randn(64, 384, generator=g) @ torch.randn(384, 96, generator=g)
digests["float32 product"] = hashlib.sha256(product.numpy().tobytes()).hexdigest()
print(json.dumps(digests))
"""


def _env(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {k for s in SETTINGS for k in s}}
    return env | setting | {"PYTHONDONTWRITEBYTECODE": "1"}


def _run(args: list[str], setting: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_env(setting), capture_output=True, text=True,
                          timeout=300)


def _name(setting: dict[str, str]) -> str:
    return "-".join(f"{k}={v}" for k, v in setting.items()) or "default"


@pytest.mark.parametrize("setting", GOLDEN_SETTINGS, ids=_name)
def test_golden_tests_pass_on_another_instruction_path(setting):
    done = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_golden.py"], setting)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def _script(setting: dict[str, str], out: Path, other: Path | None) -> dict[str, str]:
    out.mkdir()
    done = _run(["-c", SCRIPT, json.dumps(SPECS), KVTC_SPEC, str(out), str(other or "")], setting)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_codecs_agree_across_instruction_paths(tmp_path):
    """Every codec but kvtc makes the same bytes under every setting.  A kvtc file made under the default path
    decodes under every other within spec/kvtc.md §10.8's tolerance of its decode here, and each setting's own kvtc
    encode is the default's or differs from it by a sliver of the codec's error (a coefficient on a half-step).
    At least one setting must round a float32 matrix product differently here, or this checks nothing."""
    from kvcodec.codecs.kvtc import Calibration, register_calibration
    from kvcodec.tools.kvtc_tolerance import assert_within_kvtc_tolerance
    from kvcodec.tools.make_golden import GOLDEN

    register_calibration(Calibration.from_bytes((GOLDEN / "kvtc-calibration.kvtc").read_bytes()))
    base = tmp_path / "default"
    digests = _script({}, base, None)
    product = digests.pop("float32 product")
    assert len(digests) == 2 * len(SPECS)
    products = set()
    blob = (base / "kvtc.kvc").read_bytes()
    decoded = kvcodec.decode(blob)
    source = kvcodec.KVCache.load_safetensors(base / "longer.safetensors")
    for setting in SETTINGS:
        out = tmp_path / _name(setting)
        there = _script(setting, out, base)
        products.add(there.pop("float32 product"))
        assert there == digests, f"under {setting}: {sorted(k for k in digests if there.get(k) != digests[k])} differ"
        assert_within_kvtc_tolerance(blob, kvcodec.decode((out / "other-decoded.kvc").read_bytes()), decoded)
        again = kvcodec.decode((out / "kvtc.kvc").read_bytes())
        for a, b, s in zip(again.layers, decoded.layers, source.layers):
            for x, y, z in zip((a.keys, a.values), (b.keys, b.values), (s.keys, s.values)):
                moved = float((x.float() - y.float()).pow(2).mean())
                assert moved <= 1e-3 * float((y.float() - z.float()).pow(2).mean())
    assert products - {product}, "no setting changed a float32 matrix product on this machine"

