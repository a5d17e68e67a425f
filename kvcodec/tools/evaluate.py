"""Quality of a codec measured with a real model: the model continues a text from the
decoded cache, and we compare its perplexity and its greedy choices with the
continuation from the cache as stored before encoding."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.chunking import DEFAULT_CHUNK_TOKENS
from kvcodec.codecs import Codec
from kvcodec.errors import InvalidInputError
from kvcodec.models import LoadedModel
from kvcodec.texts import load_text
from kvcodec.threads import DEFAULT_THREADS


@dataclass
class EvalCase:
    """One text cut into a prefix (whose KV is compressed) and a continuation (which is scored)."""

    name: str
    kv: KVCache
    continuation: list[int]
    ref_nll: torch.Tensor
    ref_pred: torch.Tensor
    # the reference's KL_TOP most likely tokens at each position: their log-probabilities and ids (see kl())
    ref_top: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def ref_ppl(self) -> float:
        return math.exp(float(self.ref_nll.mean()))


@dataclass
class EvalRow:
    """A codec's numbers over the cases: ``bytes``, ``encode_s`` and ``decode_s`` are totals over the
    ``cases`` caches (of ``raw_bytes`` in all); the rest are means, or ratios of the totals."""

    codec: str
    bytes: int
    bits_per_element: float
    ppl_change: float
    agreement: float
    encode_s: float
    decode_s: float
    cases: int = 1
    raw_bytes: int = 0
    kl: float = float("nan")  # mean KL divergence from the reference, nats per token (see kl())

    @property
    def bytes_per_cache(self) -> float:
        return self.bytes / self.cases

    @property
    def encode_s_per_cache(self) -> float:
        return self.encode_s / self.cases

    @property
    def decode_s_per_cache(self) -> float:
        return self.decode_s / self.cases

    @property
    def encode_MBps(self) -> float:  # noqa: N802 (MB, not Mb)
        """MB of the caches' own dtype per second: the unit ``kvcodec bench`` reports."""
        return self.raw_bytes / self.encode_s / 1e6

    @property
    def decode_MBps(self) -> float:  # noqa: N802
        return self.raw_bytes / self.decode_s / 1e6

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_cache": self.bytes_per_cache, "encode_s_per_cache": self.encode_s_per_cache,
                "decode_s_per_cache": self.decode_s_per_cache, "encode_MBps": self.encode_MBps,
                "decode_MBps": self.decode_MBps}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> EvalRow:
        """The row :meth:`to_dict` wrote (derived figures are recomputed, not read)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


class Quality(NamedTuple):
    """How a model continues from a cache against a case's reference: the perplexity change (a fraction), the
    share of greedy next tokens that agree, and the mean KL divergence (nats per token; NaN without ``ref_top``)."""

    ppl_change: float
    agreement: float
    kl: float


class EvalJob(NamedTuple):
    """One codec (the ``row``-th) on one case, as :func:`evaluate` hands them to its progress bar."""

    row: int
    label: str
    codec: Codec
    case: EvalCase


KL_TOP = 256


def _score(model: LoadedModel, kv: KVCache, continuation: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per scored token: the negative log-likelihood, the greedy choice, and the log-probabilities ``[N, V]``."""
    logp = torch.log_softmax(model.continue_from(kv, continuation[:-1]).float(), -1)
    nll = -logp.gather(1, torch.tensor(continuation[1:])[:, None])[:, 0]
    return nll, logp.argmax(-1), logp


def kl(ref_top: tuple[torch.Tensor, torch.Tensor], logp: torch.Tensor) -> float:
    """Mean KL divergence (nats per token) of the next-token distributions ``logp [N, V]`` from the reference's,
    both coarsened to the reference's ``KL_TOP`` most likely tokens and one bucket for the rest: a lower bound of
    the full KL (coarsening never raises it), within a small fraction of it where those tokens hold nearly all of
    the reference's mass.  A codec's perplexity change over a few hundred tokens mixes gains and losses of
    single tokens and moves by a point between neighbouring settings; the KL adds only losses, and separates
    settings that the perplexity change cannot."""
    ref_lp, ids = ref_top
    ref_lp, lp = ref_lp.double(), logp.gather(1, ids).double()
    p = ref_lp.exp()
    # the rest's mass, floored: a distribution whose top tokens hold all of it (to rounding) adds 0 for the rest
    rest_ref = (1 - p.sum(1)).clamp(min=1e-12)
    rest = (1 - lp.exp().sum(1)).clamp(min=1e-12)
    terms = (p * (ref_lp - lp)).sum(1) + rest_ref * (rest_ref.log() - rest.log())
    return float(terms.mean())


def quality(model: LoadedModel, case: EvalCase, kv: KVCache) -> Quality:
    """The model continues ``case``'s continuation from ``kv`` (any cache of ``case.kv``'s shape: a decode, or a
    hybrid of decoded and exact tensors), scored against the case's reference."""
    nll, pred, logp = _score(model, kv, case.continuation)
    return Quality(math.exp(float(nll.mean())) / case.ref_ppl - 1, float((pred == case.ref_pred).float().mean()),
                   kl(case.ref_top, logp) if case.ref_top is not None else float("nan"))


def prepare(model: LoadedModel, text: str, prefix_tokens: int, continuation_tokens: int,
            dtype: torch.dtype = torch.float16) -> EvalCase:
    """Prefill ``prefix_tokens`` of ``text`` (a spec for :func:`load_text`) and score the reference continuation."""
    ids = model.tokenize(load_text(text))
    need = prefix_tokens + continuation_tokens + 1
    if len(ids) < need:
        raise InvalidInputError(f"text {text!r} has {len(ids)} tokens; {need} are needed")
    kv = model.prefill(ids[:prefix_tokens], dtype=dtype)
    continuation = ids[prefix_tokens:need]
    nll, pred, logp = _score(model, kv, continuation)
    return EvalCase(text, kv, continuation, nll, pred, logp.topk(KL_TOP, -1))


def evaluate(model: LoadedModel, cases: Sequence[EvalCase], codecs: Sequence[Codec], *,
             chunk_tokens: int = 256, labels: Sequence[str] | None = None,
             progress: Callable[[Iterable[EvalJob], int], Iterable[EvalJob]] | None = None,
             threads: int = DEFAULT_THREADS) -> list[EvalRow]:
    """Encode every case with every codec, decode, continue and score.  Rows are named by ``labels``
    (default: :func:`spec_string` of each codec).  Encode and decode run on ``threads`` CPU threads, as
    ``kvcodec bench`` and ``kvcodec encode`` do, so their times agree; the model runs on torch's own setting."""
    names = list(labels) if labels else [spec_string(c) for c in codecs]
    jobs = [EvalJob(i, name, codec, case) for i, (name, codec) in enumerate(zip(names, codecs)) for case in cases]
    acc: dict[int, dict[str, float]] = {}
    for row, _, codec, case in (progress(jobs, len(jobs)) if progress else jobs):
        t0 = time.perf_counter()
        blob = encode(case.kv, codec, chunk_tokens=chunk_tokens, threads=threads)
        t1 = time.perf_counter()
        decoded = decode(blob, threads=threads)
        t2 = time.perf_counter()
        q = quality(model, case, decoded)
        a = acc.setdefault(row, dict(bytes=0, elements=0, raw=0, change=0.0, agree=0.0, enc=0.0, dec=0.0, kl=0.0))
        a["bytes"] += len(blob)
        a["elements"] += case.kv.num_elements
        a["raw"] += case.kv.nbytes
        a["change"] += q.ppl_change
        a["agree"] += q.agreement
        a["kl"] += q.kl
        a["enc"] += t1 - t0
        a["dec"] += t2 - t1
    n = len(cases)
    return [EvalRow(name, int(a["bytes"]), 8 * a["bytes"] / a["elements"], a["change"] / n, a["agree"] / n, a["enc"],
                    a["dec"], n, int(a["raw"]), a["kl"] / n) for name, a in zip(names, (acc[i] for i in range(len(names))))]


@dataclass
class Throughput:
    """Median encode and decode times of a codec on a cache, and what they amount to."""

    bytes: int
    encode_s: float
    decode_s: float
    elements: int
    raw_bytes: int
    # the process's CPU seconds over the same calls: what a core's worth of work takes, whatever else the
    # machine runs (with one thread, elements per CPU-second is the speed per core)
    encode_cpu_s: float = float("nan")
    decode_cpu_s: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "bits_per_element": 8 * self.bytes / self.elements,
                "encode_s": self.encode_s, "decode_s": self.decode_s,
                "encode_MBps": self.raw_bytes / self.encode_s / 1e6, "decode_MBps": self.raw_bytes / self.decode_s / 1e6,
                "encode_Melem_s": self.elements / self.encode_s / 1e6, "decode_Melem_s": self.elements / self.decode_s / 1e6,
                "encode_cpu_s": self.encode_cpu_s, "decode_cpu_s": self.decode_cpu_s,
                "encode_Melem_per_cpu_s": self.elements / self.encode_cpu_s / 1e6,
                "decode_Melem_per_cpu_s": self.elements / self.decode_cpu_s / 1e6}


def measure_throughput(kv: KVCache, codec: Codec, repeat: int = 3, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                       backend: str = "auto", threads: int = DEFAULT_THREADS) -> Throughput:
    """Encode and decode ``kv`` ``repeat`` times through the container, on ``kv``'s device; median wall times
    (a CUDA device is synchronised before the encode clock starts and before the decode clock stops; the
    encode ends in host bytes, so it has finished when it returns).  ``threads`` as for :func:`kvcodec.encode`."""
    sync = torch.cuda.synchronize if kv.device.type == "cuda" else (lambda: None)
    enc, dec, enc_cpu, dec_cpu = [], [], [], []
    for _ in range(repeat):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        blob = encode(kv, codec, chunk_tokens=chunk_tokens, backend=backend, threads=threads)
        t1, c1 = time.perf_counter(), time.process_time()
        decode(blob, device=kv.device, backend=backend, threads=threads)
        sync()
        dec.append(time.perf_counter() - t1)
        dec_cpu.append(time.process_time() - c1)
        enc.append(t1 - t0)
        enc_cpu.append(c1 - c0)
    return Throughput(len(blob), statistics.median(enc), statistics.median(dec), kv.num_elements, kv.nbytes,
                      statistics.median(enc_cpu), statistics.median(dec_cpu))


def preset_label(codec_id: str, preset: dict[str, Any]) -> str:
    """``id:key=value,...`` for a sweep preset."""
    return codec_id + (":" + ",".join(f"{k}={v}" for k, v in preset.items()) if preset else "")


def spec_string(codec: Codec) -> str:
    """``id:key=value,...`` with the options that differ from the codec's defaults: the form ``--codec`` takes."""
    defaults = type(codec)().get_config()
    changed = {k: v for k, v in codec.get_config().items() if defaults.get(k) != v}
    return codec.codec_id + (":" + ",".join(f"{k}={v}" for k, v in changed.items()) if changed else "")
