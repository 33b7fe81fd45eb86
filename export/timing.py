"""Interleaved timing: each round runs every contender once, so a change in machine load
hits all of them alike and their ratio stays meaningful. Torch-free.

Both clocks are kept: wall time (what a caller waits) and process CPU time (with one thread,
robust to other processes competing for the cores).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable


def _calls_per_block(call: Callable[[], Any], block_seconds: float) -> int:
    """How many calls fill about `block_seconds`, judged from one warm call."""
    call()  # warm-up: first-call allocations and lazy initialisation
    start = time.perf_counter()
    call()
    return max(1, round(block_seconds / max(time.perf_counter() - start, 1e-6)))


def time_interleaved(calls: dict[str, Callable[[], Any]], rounds: int = 7,
                     block_seconds: float = 0.2) -> dict[str, dict[str, float]]:
    """{name: zero-argument call} -> {name: {"wall_ms", "cpu_ms"}}, medians per call."""
    repeats = {name: _calls_per_block(call, block_seconds) for name, call in calls.items()}
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(repeats[name]):
                call()
            wall[name].append((time.perf_counter() - start_wall) / repeats[name])
            cpu[name].append((time.process_time() - start_cpu) / repeats[name])
    return {name: {"wall_ms": 1e3 * statistics.median(wall[name]), "cpu_ms": 1e3 * statistics.median(cpu[name])}
            for name in calls}


def machine_load() -> dict[str, Any]:
    """Cores and 1-minute load average, to say under what load timings were taken."""
    return {"cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2)}
