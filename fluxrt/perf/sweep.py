"""Sweep options and message sizes for fluxrt's perf tools, with nccl-tests' flags and conventions.

Everything here is pure Python (no GPU, no CuPy): a perf script parses its command line with
:func:`add_sweep_arguments` / :meth:`SweepOptions.from_args`, asks :func:`sizes` for the message sizes
and scales measured bandwidth with :func:`bus_bandwidth_factor`. Keeping the flags and the busbw
factors identical to nccl-tests lets a fluxrt table be read next to an ``all_reduce_perf`` one.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

__all__ = [
    "DTYPE_SIZES",
    "OPS",
    "SweepOptions",
    "add_sweep_arguments",
    "bus_bandwidth_factor",
    "describe",
    "element_size",
    "format_size",
    "normalize_datatype",
    "normalize_op",
    "parse_size",
    "sizes",
]

# Binary multipliers, as nccl-tests uses them: "1K" and "1KB" both mean 1024 bytes.
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)

#: Canonical datatype names and their sizes in bytes.
DTYPE_SIZES = {"fp32": 4, "fp16": 2, "bf16": 2, "int32": 4}
_DTYPE_ALIASES = {
    "fp32": "fp32", "float": "fp32", "float32": "fp32", "f32": "fp32",
    "fp16": "fp16", "half": "fp16", "float16": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "int32": "int32", "int": "int32", "i32": "int32",
}

#: Reduction operators the sweeps accept (``-o``).
OPS = ("sum", "max", "min")

# busbw factor as a function of the rank count, keyed by collective name without '_' / '-'.
# Why these: each is the fraction of the payload that must cross the busiest link of an ideal
# algorithm, so busbw is comparable to the hardware's link bandwidth whatever the rank count
# (nccl-tests doc/PERFORMANCE.md).
_BUSBW = {
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "alltoallv": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}


def parse_size(text: str | int) -> int:
    """Bytes from an nccl-tests size ("8", "64K", "1M", "1G", "256MB", "1GiB"; case-insensitive).

    Suffixes are binary (K = 1024) whether or not a "B"/"iB" follows, because that is what nccl-tests
    does and sweeps are expected to land on powers of two. An int is returned unchanged (if >= 0).
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid size {text!r}: expected bytes like 8, 64K, 1M, 256MB, 1GiB")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: must be >= 0")
        return text
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise ValueError(f"invalid size {text!r}: expected bytes like 8, 64K, 1M, 256MB, 1GiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(nbytes: int) -> str:
    """Short human form of a byte count ("8", "64K", "1M", "1.5G"), for plot ticks and log lines."""
    for suffix, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult:
            value = nbytes / mult
            return f"{value:.0f}{suffix}" if value == int(value) else f"{value:.3g}{suffix}"
    return str(int(nbytes))


def normalize_datatype(name: str) -> str:
    """Canonical datatype ("fp32", "fp16", "bf16", "int32") from an nccl-tests or short name."""
    key = str(name).strip().lower()
    if key not in _DTYPE_ALIASES:
        known = ", ".join(sorted(_DTYPE_ALIASES))
        raise ValueError(f"unknown datatype {name!r}: expected one of {known}")
    return _DTYPE_ALIASES[key]


def element_size(datatype: str) -> int:
    """Bytes per element of a datatype (any accepted alias)."""
    return DTYPE_SIZES[normalize_datatype(datatype)]


def normalize_op(name: str) -> str:
    """Canonical reduction operator ("sum", "max", "min")."""
    key = str(name).strip().lower()
    if key not in OPS:
        raise ValueError(f"unknown reduction op {name!r}: expected one of {', '.join(OPS)}")
    return key


@dataclass
class SweepOptions:
    """What one sweep does; field defaults are the command-line defaults.

    ``stepbytes == 0`` means "multiply by ``stepfactor``" (nccl-tests ``-i 0``). ``graph_iters > 0``
    means: capture that many iterations in one CUDA graph and time its replays, which removes host
    launch overhead from small-message latency.
    """

    minbytes: int = 8
    maxbytes: int = 64 << 20
    stepfactor: int = 2
    stepbytes: int = 0
    iters: int = 20
    warmup_iters: int = 5
    check: int = 1
    datatype: str = "bf16"
    op: str = "sum"
    graph_iters: int = 0
    json_path: str | None = None
    plot_path: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        # Normalize here so that every consumer sees canonical names, then fail early on bad values.
        self.minbytes = parse_size(self.minbytes)
        self.maxbytes = parse_size(self.maxbytes)
        self.stepbytes = parse_size(self.stepbytes)
        self.datatype = normalize_datatype(self.datatype)
        self.op = normalize_op(self.op)
        self.validate()

    @property
    def element_size(self) -> int:
        """Bytes per element of :attr:`datatype`."""
        return DTYPE_SIZES[self.datatype]

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent option (flag letters included)."""
        if self.minbytes < 1:
            raise ValueError(f"-b/--minbytes must be >= 1, got {self.minbytes}")
        if self.maxbytes < self.minbytes:
            raise ValueError(
                f"-e/--maxbytes ({self.maxbytes}) must be >= -b/--minbytes ({self.minbytes})")
        if self.stepbytes < 0:
            raise ValueError(f"-i/--stepbytes must be >= 0, got {self.stepbytes}")
        if self.stepbytes == 0 and self.stepfactor <= 1:
            raise ValueError(
                f"-f/--stepfactor must be > 1 (or give -i/--stepbytes > 0), got {self.stepfactor}")
        if self.iters < 1:
            raise ValueError(f"-n/--iters must be >= 1, got {self.iters}")
        if self.warmup_iters < 0:
            raise ValueError(f"-w/--warmup_iters must be >= 0, got {self.warmup_iters}")
        if self.check not in (0, 1):
            raise ValueError(f"-c/--check must be 0 or 1, got {self.check}")
        if self.graph_iters < 0:
            raise ValueError(f"-G/--graph must be >= 0, got {self.graph_iters}")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "SweepOptions":
        """Options from a namespace filled by :func:`add_sweep_arguments` (other attributes ignored)."""
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        return cls(**values)


def _argtype(fn, label: str):
    """Wrap a parser so argparse prints our message (not "invalid <fn> value") on bad input."""
    def parse(text):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = label
    return parse


def add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add nccl-tests' sweep flags (-b -e -f -i -n -w -c -d -o -G) plus --json, --plot, --no-progress."""
    d = SweepOptions.__dataclass_fields__
    size = _argtype(parse_size, "size")
    g = parser.add_argument_group("sweep (nccl-tests flags)")
    g.add_argument("-b", "--minbytes", type=size, metavar="SIZE", default=d["minbytes"].default,
                   help="smallest message size in bytes, e.g. 8, 64K, 1M (default: %(default)s)")
    g.add_argument("-e", "--maxbytes", type=size, metavar="SIZE", default=d["maxbytes"].default,
                   help="largest message size in bytes (default: %(default)s = 64M)")
    g.add_argument("-f", "--stepfactor", type=int, metavar="N", default=d["stepfactor"].default,
                   help="multiply the size by this factor between steps (default: %(default)s)")
    g.add_argument("-i", "--stepbytes", type=size, metavar="SIZE", default=d["stepbytes"].default,
                   help="add this many bytes between steps instead; 0 = use -f (default: %(default)s)")
    g.add_argument("-n", "--iters", type=int, metavar="N", default=d["iters"].default,
                   help="timed iterations per size (default: %(default)s)")
    g.add_argument("-w", "--warmup_iters", type=int, metavar="N", default=d["warmup_iters"].default,
                   help="untimed warmup iterations per size (default: %(default)s)")
    g.add_argument("-c", "--check", type=int, choices=(0, 1), default=d["check"].default,
                   help="check results for correctness: 1 yes, 0 no (default: %(default)s)")
    g.add_argument("-d", "--datatype", metavar="TYPE", type=_argtype(normalize_datatype, "datatype"),
                   default=d["datatype"].default,
                   help="fp32|fp16|bf16|int32 (or float|half|bfloat16) (default: %(default)s)")
    g.add_argument("-o", "--op", metavar="OP", type=_argtype(normalize_op, "op"), default=d["op"].default,
                   help="reduction operator: sum|max|min (default: %(default)s)")
    g.add_argument("-G", "--graph", "--cudagraph", dest="graph_iters", type=int, metavar="N",
                   default=d["graph_iters"].default,
                   help="capture this many iterations in a CUDA graph and time replays; 0 = off "
                        "(default: %(default)s)")
    g.add_argument("--json", dest="json_path", metavar="PATH", default=None,
                   help="write the results as JSON to PATH")
    g.add_argument("--plot", dest="plot_path", metavar="PATH", default=None,
                   help="write a latency/busbw PNG plot to PATH (needs matplotlib)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="do not show a progress indicator on stderr")
    return parser


def sizes(opts: SweepOptions, align: int | None = None) -> list[int]:
    """Message sizes in bytes from ``opts.minbytes`` to ``opts.maxbytes`` inclusive, like nccl-tests.

    Steps multiply by ``stepfactor`` or, when ``stepbytes > 0``, add ``stepbytes``. Each size is rounded
    down to a multiple of ``align`` (and is at least ``align``) so that it is a whole number of elements;
    ``align=None`` means the element size of ``opts.datatype``. Pass ``element_size * nranks`` for
    collectives that split the buffer evenly across ranks. Sizes made equal by rounding appear once.
    """
    opts.validate()
    if align is None:
        align = opts.element_size
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    out: list[int] = []
    size = opts.minbytes
    while size <= opts.maxbytes:
        aligned = max(align, size - size % align)
        if not out or aligned != out[-1]:
            out.append(aligned)
        size = size + opts.stepbytes if opts.stepbytes > 0 else size * opts.stepfactor
    return out


def bus_bandwidth_factor(op: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw factor for a collective over ``nranks`` ranks.

    allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall (n-1)/n; broadcast, reduce, sendrecv/p2p 1.
    Names are case-insensitive and may use '_' or '-' (``all_reduce``, ``reduce-scatter``).
    """
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    key = str(op).lower().replace("_", "").replace("-", "")
    if key not in _BUSBW:
        raise ValueError(f"unknown collective {op!r} for busbw: expected one of {', '.join(_BUSBW)}")
    return float(_BUSBW[key](nranks))


def describe(opts: SweepOptions) -> list[str]:
    """nccl-tests-like '#' preamble lines recording the sweep parameters (for the table header)."""
    step = f"{opts.stepbytes}(bytes)" if opts.stepbytes > 0 else f"{opts.stepfactor}(factor)"
    return [
        f"# minBytes {opts.minbytes} maxBytes {opts.maxbytes} step: {step} "
        f"warmup iters: {opts.warmup_iters} iters: {opts.iters} validation: {opts.check} "
        f"graph: {opts.graph_iters}",
        f"# datatype {opts.datatype} redop {opts.op}",
    ]
