"""Quality of a codec measured with a real model: the model continues a text from the
decoded cache, and we compare its perplexity and its greedy choices with the
continuation from the cache as stored before encoding."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.chunking import DEFAULT_CHUNK_TOKENS
from kvcodec.codecs import Codec
from kvcodec.errors import InvalidInputError
from kvcodec.models import LoadedModel
from kvcodec.texts import load_text


@dataclass
class EvalCase:
    """One text cut into a prefix (whose KV is compressed) and a continuation (which is scored)."""

    name: str
    kv: KVCache
    continuation: list[int]
    ref_nll: torch.Tensor
    ref_pred: torch.Tensor

    @property
    def ref_ppl(self) -> float:
        return math.exp(float(self.ref_nll.mean()))


@dataclass
class EvalRow:
    """A codec's numbers, summed or averaged over the cases."""

    codec: str
    bytes: int
    bits_per_element: float
    ppl_change: float
    agreement: float
    encode_s: float
    decode_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _score(model: LoadedModel, kv: KVCache, continuation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model.continue_from(kv, continuation[:-1])
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(continuation[1:]), reduction="none")
    return nll, logits.argmax(-1)


def prepare(model: LoadedModel, text: str, prefix_tokens: int, continuation_tokens: int,
            dtype: torch.dtype = torch.float16) -> EvalCase:
    """Prefill ``prefix_tokens`` of ``text`` (a spec for :func:`load_text`) and score the reference continuation."""
    ids = model.tokenize(load_text(text))
    need = prefix_tokens + continuation_tokens + 1
    if len(ids) < need:
        raise InvalidInputError(f"text {text!r} has {len(ids)} tokens; {need} are needed")
    kv = model.prefill(ids[:prefix_tokens], dtype=dtype)
    continuation = ids[prefix_tokens:need]
    nll, pred = _score(model, kv, continuation)
    return EvalCase(text, kv, continuation, nll, pred)


def evaluate(model: LoadedModel, cases: Sequence[EvalCase], codecs: Sequence[Codec], *,
             chunk_tokens: int = 256, labels: Sequence[str] | None = None,
             progress: Callable[[Iterable[Any], int], Iterable[Any]] | None = None) -> list[EvalRow]:
    """Encode every case with every codec, decode, continue and score.  Rows are named by ``labels``
    (default: :func:`spec_string` of each codec)."""
    rows = []
    jobs = [(c, case) for c in codecs for case in cases]
    it: Iterable[tuple[Codec, EvalCase]] = progress(jobs, len(jobs)) if progress else jobs
    acc: dict[int, dict[str, float]] = {}
    for codec, case in it:
        t0 = time.perf_counter()
        blob = encode(case.kv, codec, chunk_tokens=chunk_tokens)
        t1 = time.perf_counter()
        decoded = decode(blob)
        t2 = time.perf_counter()
        nll, pred = _score(model, decoded, case.continuation)
        a = acc.setdefault(id(codec), dict(bytes=0, elements=0, change=0.0, agree=0.0, enc=0.0, dec=0.0))
        a["bytes"] += len(blob)
        a["elements"] += case.kv.num_elements
        a["change"] += math.exp(float(nll.mean())) / case.ref_ppl - 1
        a["agree"] += float((pred == case.ref_pred).float().mean())
        a["enc"] += t1 - t0
        a["dec"] += t2 - t1
    for i, codec in enumerate(codecs):
        a = acc[id(codec)]
        n = len(cases)
        rows.append(EvalRow(labels[i] if labels else spec_string(codec), int(a["bytes"]), 8 * a["bytes"] / a["elements"], a["change"] / n,
                            a["agree"] / n, a["enc"], a["dec"]))
    return rows


@dataclass
class Throughput:
    """Median encode and decode times of a codec on a cache, and what they amount to."""

    bytes: int
    encode_s: float
    decode_s: float
    elements: int
    raw_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "bits_per_element": 8 * self.bytes / self.elements,
                "encode_MBps": self.raw_bytes / self.encode_s / 1e6, "decode_MBps": self.raw_bytes / self.decode_s / 1e6,
                "encode_Melem_s": self.elements / self.encode_s / 1e6, "decode_Melem_s": self.elements / self.decode_s / 1e6}


def measure_throughput(kv: KVCache, codec: Codec, repeat: int = 3, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                       backend: str = "auto") -> Throughput:
    """Encode and decode ``kv`` ``repeat`` times through the container, on ``kv``'s device; median wall times
    (a CUDA device is synchronised before the encode clock starts and before the decode clock stops; the
    encode ends in host bytes, so it has finished when it returns)."""
    sync = torch.cuda.synchronize if kv.device.type == "cuda" else (lambda: None)
    enc, dec = [], []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        blob = encode(kv, codec, chunk_tokens=chunk_tokens, backend=backend)
        t1 = time.perf_counter()
        decode(blob, device=kv.device, backend=backend)
        sync()
        dec.append(time.perf_counter() - t1)
        enc.append(t1 - t0)
    return Throughput(len(blob), statistics.median(enc), statistics.median(dec), kv.num_elements, kv.nbytes)


def preset_label(codec_id: str, preset: dict[str, Any]) -> str:
    """``id:key=value,...`` for a sweep preset."""
    return codec_id + (":" + ",".join(f"{k}={v}" for k, v in preset.items()) if preset else "")


def spec_string(codec: Codec) -> str:
    """``id:key=value,...`` with the options that differ from the codec's defaults: the form ``--codec`` takes."""
    defaults = type(codec)().get_config()
    changed = {k: v for k, v in codec.get_config().items() if defaults.get(k) != v}
    return codec.codec_id + (":" + ",".join(f"{k}={v}" for k, v in changed.items()) if changed else "")
