"""Timing helpers shared by the single-GPU benchmarks (the GEMM bench scripts under perf/): back-to-back
calls between two CUDA events, and CUDA-graph capture and replay of the same calls."""
from __future__ import annotations

import math
import time


def eager_ms(fn, iters: int, stream) -> float:
    """Milliseconds per call of `iters` back-to-back calls on `stream`, between two events (host time
    between the launches included, as a user sees it)."""
    return eager_ms_and_host_us(fn, iters, stream)[0]


def eager_ms_and_host_us(fn, iters: int, stream) -> tuple[float, float]:
    """(ms per call between events, host microseconds per call spent issuing them)."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / iters, (t1 - t0) * 1e6 / iters


def capture(fn, iters: int, stream):
    """A CUDA graph of `iters` calls of `fn` captured on `stream` (a CuPy stream, not the null stream)."""
    stream.begin_capture()
    try:
        for _ in range(iters):
            fn()
    finally:
        graph = stream.end_capture()
    return graph


def graph_ms(graph, iters: int, stream) -> float:
    """Milliseconds per call of one replay of a graph made by :func:`capture` with `iters` calls."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / iters


def geomean(xs) -> float:
    """Geometric mean of the positive values of `xs` (missing and non-positive ones left out); NaN if none."""
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
