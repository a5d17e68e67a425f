"""Runs mutated containers through the three read paths in a child process with time and memory limits,
and counts the outcomes per seed codec and path.

Outcomes: ``decoded`` (shapes as declared), ``KVCodecError`` (refused cleanly) and the bugs: ``other`` (any
other exception), ``timeout`` (over the time limit), ``memory`` (a failed allocation under the address-space
limit, or a peak over :func:`memory_bound`) and ``crash`` (the child died).
"""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import kvcodec
from kvcodec.formats.v1 import PREAMBLE
from kvcodec.tools.fuzz.container import seal
from kvcodec.tools.fuzz.mutate import Seed, mutate
from kvcodec.tools.fuzz.worker import PATHS, receive, send

OUTCOMES = ("decoded", "KVCodecError", "other", "timeout", "memory", "crash")
BUGS = OUTCOMES[2:]
# SPEC.md §9.1: a decode's peak memory above what it holds before it starts
OUTPUT_FACTOR, INPUT_FACTOR, HEADER_FACTOR, FIXED_BYTES = 16, 4, 64, 64 << 20


def memory_bound(declared: int, max_bytes: int | None, input_bytes: int, header_bytes: int = 0) -> int:
    """The most a decode may add to the process's peak memory (SPEC.md §9.1): 16 x the output the header
    declares for what was asked (at most ``max_bytes``), 4 x the bytes read, 64 x the header JSON (its parsed
    Python objects) and 64 MiB (libraries' working memory: FFmpeg's decoder, constriction's coders)."""
    out = declared if max_bytes is None else min(declared, max_bytes)
    return OUTPUT_FACTOR * out + INPUT_FACTOR * input_bytes + HEADER_FACTOR * header_bytes + FIXED_BYTES


def header_length(data: bytes) -> int:
    return PREAMBLE.unpack_from(data)[3] if len(data) >= PREAMBLE.size else 0


def raised_in_codec(seed: Seed, message: str) -> bool:
    """Whether an error message comes from the section decoder of one of ``seed``'s codecs (each names itself)."""
    return any(v.codec in message or (v.codec == "kvfetcher" and "HEVC" in message) for v in seed.header.variants)


def calibrations_of(files: list[bytes]) -> list[bytes]:
    """The kvtc calibration files the containers ``files`` name (registered in this process), for the child."""
    found: dict[str, bytes] = {}
    for data in files:
        with kvcodec.open(data) as r:
            found |= {c.calibration: c.calibration_data().to_bytes() for c in r.codecs if c.codec_id == "kvtc"}
    return list(found.values())


class WorkerDied(Exception):
    pass


class Worker:
    """One fuzz child process (see :mod:`kvcodec.tools.fuzz.worker`), restarted after a timeout or a crash."""

    def __init__(self, seeds: list[bytes], extra_address_space: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvcodec.tools.fuzz.worker", str(extra_address_space)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        send(self.proc.stdin, (seeds, calibrations_of(seeds)))
        ready = self._receive(600)
        if not ready or not ready.get("ready"):
            raise RuntimeError("the fuzz worker did not start (seeds do not decode?)")

    def _receive(self, timeout: float) -> Any:
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError
        msg = receive(self.proc.stdout)
        if msg is None:
            raise WorkerDied(f"exit status {self.proc.wait()}")
        return msg

    def run(self, msg: tuple[Any, ...], timeout: float) -> dict[str, Any]:
        send(self.proc.stdin, msg)
        return self._receive(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@dataclass
class Tally:
    counts: dict[tuple[str, str], Counter] = field(default_factory=lambda: defaultdict(Counter))
    bugs: list[dict[str, Any]] = field(default_factory=list)
    cases: int = 0
    worst_ratio: float = 0.0  # peak memory over (declared output within max_bytes + input), for budgets >= 1 MiB
    worst_peak: int = 0
    slowest: float = 0.0

    def add(self, seed: Seed, path: str, mutation: str, result: dict[str, Any], data: bytes) -> None:
        self.counts[(seed.name, path)][result["outcome"]] += 1
        if result["outcome"] == "KVCodecError" and raised_in_codec(seed, result["detail"]):
            self.counts[(seed.name, path)]["in codec"] += 1
        self.slowest = max(self.slowest, result.get("seconds", 0.0))
        self.worst_peak = max(self.worst_peak, result.get("peak", 0))
        budget = result.get("budget", 0)
        if budget >= 1 << 20:
            self.worst_ratio = max(self.worst_ratio, result["peak"] / budget)
        if result["outcome"] in BUGS:
            self.bugs.append({"seed": seed.name, "path": path, "mutation": mutation, "data": data, **result})

    def table(self) -> str:
        """Counts per seed and path; ``in codec`` counts the KVCodecErrors a codec's own section checks raised."""
        columns = (*OUTCOMES[:2], "in codec", *OUTCOMES[2:])
        rows = ["| seed | path | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
        for (seed, path), c in sorted(self.counts.items()):
            rows.append(f"| {seed} | {path} | " + " | ".join(str(c[o]) for o in columns) + " |")
        total: Counter = Counter()
        for c in self.counts.values():
            total.update(c)
        rows.append("| **all** | | " + " | ".join(f"**{total[o]}**" for o in columns) + " |")
        return "\n".join(rows)


def fuzz(seeds: list[Seed], donors: list[bytes], *, cases: int | None = None, seconds: float | None = None,
         rng_seed: int = 0, max_bytes: int | None = 64 << 20, timeout: float = 10.0,
         extra_address_space: int = 2 << 30, progress: Callable[[Tally], None] | None = None) -> Tally:
    """Mutate the seeds in turn (case ``i`` from ``Random(f"{rng_seed}-{i}")``, so a run is reproducible) and
    decode each file through every path, until ``cases`` files or ``seconds`` have passed."""
    tally = Tally()
    worker = Worker([s.data for s in seeds], extra_address_space)
    start = time.monotonic()
    try:
        i = 0
        while (cases is None or i < cases) and (seconds is None or time.monotonic() - start < seconds):
            rng = random.Random(f"{rng_seed}-{i}")
            seed = seeds[i % len(seeds)]
            mutation, parts = mutate(rng, seed, donors)
            data = seal(parts)
            for path in PATHS:
                try:
                    result = worker.run((path, data, i, max_bytes), timeout)
                except (TimeoutError, WorkerDied) as e:
                    worker.stop()
                    died = isinstance(e, WorkerDied)
                    result = {"outcome": "crash" if died else "timeout", "detail": str(e), "seconds": timeout,
                              "peak": 0, "declared": 0}
                    worker = Worker([s.data for s in seeds], extra_address_space)
                result["budget"] = (min(result["declared"], max_bytes or result["declared"])) + len(data)
                if result["outcome"] in ("decoded", "KVCodecError") and \
                        result["peak"] > memory_bound(result["declared"], max_bytes, len(data), header_length(data)):
                    result["outcome"] = "memory"
                    result["detail"] = f"peak {result['peak']} bytes over the bound; " + result["detail"]
                tally.add(seed, path, mutation, result, data)
            tally.cases += 1
            i += 1
            if progress:
                progress(tally)
    finally:
        worker.stop()
    return tally
