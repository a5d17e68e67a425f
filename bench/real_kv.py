"""The benches' real KV: SmolLM2-135M's float16 cache over the first tokens of ``license:GPL-3``, dumped once with
``kvcodec dump`` into ``.cache/bench-kv`` and reused."""

from __future__ import annotations

import os
from pathlib import Path

import kvcodec

FOLDER = Path(__file__).resolve().parent.parent / ".cache" / "bench-kv"


def gpl3_dump(tokens: int) -> Path:
    """The dump of the first ``tokens`` tokens, made now if missing.  Its name carries kvcodec's and transformers'
    versions, since either can change what the model computes.  ``KVCODEC_BENCH_KV`` names a dump to use instead:
    a machine that cannot run the model (the GPU machine) reads one carried there (scripts/gpu_check.sh)."""
    carried = os.environ.get("KVCODEC_BENCH_KV")
    if carried:
        return Path(carried)
    import transformers

    from kvcodec.cli import main

    versions = f"kvcodec{kvcodec.__version__}-tf{transformers.__version__}"
    path = FOLDER / f"license-GPL-3-{tokens}-float16-{versions}.safetensors"
    if not path.exists():
        FOLDER.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.safetensors")  # renamed when whole, so an interrupted dump is never reused
        code = main(["dump", "--model", "smollm2", "--text", "license:GPL-3", "--tokens", str(tokens),
                     "--dtype", "float16", "-o", str(tmp), "--quiet"])
        if code != 0:
            raise SystemExit(f"kvcodec dump failed with exit code {code}")
        tmp.rename(path)
    return path


def gpl3_kv(tokens: int) -> kvcodec.KVCache:
    """The cache of the first ``tokens`` tokens (see :func:`gpl3_dump`)."""
    path = gpl3_dump(tokens)
    kv = kvcodec.KVCache.load_safetensors(path)
    if kv.num_tokens != tokens:
        raise SystemExit(f"{path} holds {kv.num_tokens} tokens, not the {tokens} asked for")
    return kv
