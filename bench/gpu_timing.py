"""What the GPU benches (bench/gpu_*.py) share: timing (the median of repeated runs after warm-up) and their
markdown report."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch


class Timer:
    """Median seconds of ``fn`` after warm-up: CUDA events on a GPU, the wall clock otherwise."""

    def __init__(self, device: torch.device, repeat: int) -> None:
        self.cuda, self.repeat = device.type == "cuda", repeat

    def __call__(self, fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(2 if self.cuda else 0):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        warm = (time.perf_counter() - t0) / 2
        times = []
        for _ in range(max(3, min(self.repeat, int(5 / max(warm, 1e-9))))):  # about 5 s per measurement at most
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


class Report:
    """A GPU bench's markdown report, each line printed as it comes: its title and the device it ran on, then
    what the bench says.  ``finish`` writes it to ``results/NAME.md`` (``NAME-smoke.md`` off a GPU)."""

    def __init__(self, device: torch.device, name: str, title: str) -> None:
        self.device, self.name, self.lines = device, name, []
        where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter: correctness only)"
        for line in (f"# {title}", "", f"Device: {where}; torch {torch.__version__}; "
                     f"`python bench/{name}.py {' '.join(sys.argv[1:])}`.", ""):
            self(line)

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def finish(self, failures: list[str]) -> int:
        """List ``failures`` under a heading, write the report to its results file, and return the bench's exit
        status (1 when anything failed)."""
        if failures:
            self("")
            self("## FAILURES")
            for f in failures:
                self(f"- {f}")
        out = Path(__file__).parent / "results" / f"{self.name}{'' if self.device.type == 'cuda' else '-smoke'}.md"
        out.write_text("\n".join(self.lines) + "\n")
        print(f"wrote {out}")
        return 1 if failures else 0


def device_or_none(name: str) -> torch.device | None:
    """The device ``--device`` names, or None (with a message) when it is CUDA and there is none."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke run in the interpreter)", file=sys.stderr)
        return None
    return device
