"""Timing for the GPU benches (bench/gpu_*.py): the median of repeated runs after warm-up."""

from __future__ import annotations

import statistics
import time
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
