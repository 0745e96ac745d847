"""GPU-free perf tooling for fluxrt: nccl-tests-compatible sweep flags and sizes, bus-bandwidth
factors, side-by-side tables, JSON results, plots and progress. Benchmarks that measure on the GPU live
under perf/ and build on these."""
from .report import Row, Table, algbw_gbps, plot, progress, results_document, write_json
from .sweep import (DTYPE_SIZES, OPS, SweepOptions, add_sweep_arguments, bus_bandwidth_factor,
                    describe, element_size, format_size, normalize_datatype, normalize_op,
                    parse_size, sizes)

__all__ = [
    "DTYPE_SIZES", "OPS", "Row", "SweepOptions", "Table", "add_sweep_arguments", "algbw_gbps",
    "bus_bandwidth_factor", "describe", "element_size", "format_size", "normalize_datatype",
    "normalize_op", "parse_size", "plot", "progress", "results_document", "sizes", "write_json",
]
