"""How every benchmark times a piece of code: best of N wall-clock runs, with the median and CPU time."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def format_ms(value: float) -> str:
    value = float(value)
    return f"{value:.{1 if value < 10 else 0}f}"


class Ms(float):
    """Best-of-N wall-clock milliseconds, with the median and the CPU time of the best run (all
    threads). Other processes share these cores: the best run is the closest to the code's own
    cost, the median is a busy day, and CPU time / threads is what an idle machine would take."""

    median: float
    cpu: float

    def __new__(cls, times: list[tuple[float, float]]) -> "Ms":  # (wall, cpu) seconds per run
        wall, cpu = min(times)
        ms = super().__new__(cls, 1e3 * wall)
        ms.median = 1e3 * float(np.median([t[0] for t in times]))
        ms.cpu = 1e3 * cpu
        return ms

    @property
    def seconds(self) -> float:
        return float(self) / 1e3

    def __format__(self, spec: str) -> str:  # spec: alignment and width only
        return format(f"{format_ms(self)} ({format_ms(self.median)}) {format_ms(self.cpu)}", spec)


def timed(fn: Callable[[], object], repeats: int = 1, calls: int = 1, warmup: bool = True) -> Ms:
    """Milliseconds per call of `fn` over `repeats` runs of `calls` calls each (one run's figure is
    its mean call), after one warm-up call unless `warmup` is off (a call that changes what the
    next one meets, such as a first write or a cold read)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        times.append(((time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls))
    return Ms(times)


def once(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn`, no warm-up: for a call that changes what the next one
    meets (a first write, a cold read)."""
    return timed(fn, warmup=False).seconds
