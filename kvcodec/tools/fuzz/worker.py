"""The fuzz child process: decodes the files it is sent through one of the three read paths, under an
address-space limit, and reports the outcome and its peak memory.

Protocol (stdin/stdout): each message is a u64 length and a pickle.  The first message is the list of seed
files and the kvtc calibration files they name; the seeds are decoded once through every path so that lazy
imports and caches are in place before the limit is set and memory is measured; each further message is
``(path, data, piece_seed, max_bytes)``.
"""

from __future__ import annotations

import os
import pickle
import random
import resource
import struct
import sys
import time
import traceback
from typing import Any, BinaryIO, Iterator

PATHS = ("decode", "open", "stream")
LENGTH = struct.Struct("<Q")


def send(f: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    f.write(LENGTH.pack(len(data)) + data)
    f.flush()


def receive(f: BinaryIO) -> Any:
    head = f.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    return pickle.loads(f.read(LENGTH.unpack(head)[0]))


def pieces(data: bytes, seed: int) -> Iterator[bytes]:
    """``data`` in pieces of random sizes, as a socket would deliver it."""
    rng, pos = random.Random(seed), 0
    while pos < len(data):
        n = rng.choice((1, 7, 64, 1000, 4096, 65536))
        yield data[pos:pos + n]
        pos += n


def decode(path: str, data: bytes, piece_seed: int, max_bytes: int | None) -> None:
    import kvcodec

    if path == "decode":
        check_shapes(kvcodec.decode(data, max_bytes=max_bytes), data)
    elif path == "open":
        with kvcodec.open(data, max_bytes=max_bytes) as r:
            for i in range(r.num_chunks):
                r.read_chunk(i)
    else:
        check_shapes(kvcodec.decode(pieces(data, piece_seed), max_bytes=max_bytes), data)


def header_of(data: bytes) -> Any:
    from kvcodec.container.frames import parse_header_block
    from kvcodec.formats.v1 import PREAMBLE

    pos = PREAMBLE.size

    def read(n: int) -> bytes:
        nonlocal pos
        pos += n
        return data[pos - n:pos]

    return parse_header_block(data[:PREAMBLE.size], read)[0]


def check_shapes(kv: Any, data: bytes) -> None:
    """A decode that succeeds must give exactly the shapes and dtype the header declares."""
    header = header_of(data)
    got = [(tuple(l.keys.shape), tuple(l.values.shape)) for l in kv.layers]
    want = [((s.heads, s.tokens, s.key_dim), (s.heads, s.tokens, s.value_dim)) for s in header.layers]
    if got != want or str(kv.dtype).removeprefix("torch.") != header.dtype:
        raise AssertionError(f"decoded shapes {got} {kv.dtype}, the header declares {want} {header.dtype}")


def declared_bytes(data: bytes) -> int:
    """Output bytes the file's header declares (0 when the header does not parse)."""
    try:
        from kvcodec.chunking import output_bytes

        h = header_of(data)
        return output_bytes(h, range(len(h.layers)), 0, h.max_tokens)
    except Exception:
        return 0


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the next case's allocations show in VmHWM
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux 4.0+)


def _is_memory(e: BaseException) -> bool:
    seen = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, MemoryError) or "can't allocate memory" in str(x) or "DefaultCPUAllocator" in str(x):
            return True
        x = x.__cause__ or x.__context__
    return False


def run_case(path: str, data: bytes, piece_seed: int, max_bytes: int | None) -> dict[str, Any]:
    from kvcodec.errors import KVCodecError

    _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    outcome, detail = "decoded", ""
    try:
        decode(path, data, piece_seed, max_bytes)
    except KVCodecError as e:
        outcome, detail = "KVCodecError", f"{type(e).__name__}: {e}"[:300]
    except BaseException as e:  # noqa: BLE001 - every other escape is what the fuzzer looks for
        outcome = "memory" if _is_memory(e) else "other"
        detail = "".join(traceback.format_exception(e))[-3000:]
    return {"outcome": outcome, "detail": detail, "seconds": time.perf_counter() - t0,
            "peak": max(_status("VmHWM") - base, 0), "declared": declared_bytes(data)}


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    extra = int(sys.argv[1])
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # library chatter must not corrupt the protocol
    inp = sys.stdin.buffer
    seeds, calibrations = receive(inp)
    from kvcodec.codecs.kvtc import Calibration, register_calibration

    for cal in calibrations:  # the seeds' kvtc calibrations, findable by hash as an installed one would be
        register_calibration(Calibration.from_bytes(cal))
    for data in seeds:
        for path in PATHS:
            result = run_case(path, data, 0, None)
            if result["outcome"] != "decoded":
                raise SystemExit(f"seed does not decode through {path}: {result['detail']}")
    limit = _status("VmSize") + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    send(out, {"ready": True, "limit": limit})
    while (msg := receive(inp)) is not None:
        send(out, run_case(*msg))


if __name__ == "__main__":
    main()
