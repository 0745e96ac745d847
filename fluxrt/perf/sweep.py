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
    "AVERAGE_MODES",
    "DTYPE_SIZES",
    "OPS",
    "SweepOptions",
    "add_average_argument",
    "add_gemm_bench_arguments",
    "add_sweep_arguments",
    "add_timeout_argument",
    "bus_bandwidth_factor",
    "describe",
    "element_size",
    "format_size",
    "gemm_datatype",
    "normalize_datatype",
    "normalize_datatype_or_all",
    "normalize_op",
    "parse_root",
    "parse_size",
    "rank_stats",
    "reduce_over_ranks",
    "sizes",
    "sweep_datatypes",
    "sweep_ops",
    "sweep_roots",
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

#: Reduction operators the sweeps accept (``-o``; ``all`` loops over them). nccl-tests also has prod and
#: avg, which fluxrt's collectives do not implement: they are refused with that reason.
OPS = ("sum", "max", "min")
_NCCL_ONLY_OPS = ("prod", "avg")

#: nccl-tests' ``-a``: how the per-rank times of one measurement become the reported time.
AVERAGE_MODES = {0: "rank0", 1: "avg", 2: "min", 3: "max"}

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


_GEMM_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def gemm_datatype(name: str) -> str:
    """The GEMM benches' datatype ("bfloat16" or "float16") from any -d spelling (bf16, half, float16, ...)."""
    canonical = normalize_datatype(name)
    if canonical not in _GEMM_DTYPES:
        raise ValueError(f"datatype {name!r}: the GEMM takes bf16 or fp16")
    return _GEMM_DTYPES[canonical]


def add_gemm_bench_arguments(parser: argparse.ArgumentParser, iters: int, warmup: int | None = None) -> None:
    """The flags perf/bench_gemm.py and perf/gemm_suite.py share with fluxrt-perf: -d, -n, -w, -c (the older
    --dtype, --warmup and --no-check still work)."""
    parser.add_argument("-d", "--datatype", "--dtype", dest="dtype", metavar="TYPE", default="bfloat16",
                        type=_argtype(gemm_datatype, "datatype"), help="bf16|fp16 (or bfloat16|float16) "
                        "(default: bfloat16)")
    parser.add_argument("-n", "--iters", type=int, default=iters, help="timed calls (default: %(default)s)")
    if warmup is not None:
        parser.add_argument("-w", "--warmup_iters", "--warmup", dest="warmup", type=int, default=warmup,
                            help="untimed warm-up calls (default: %(default)s)")
    parser.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                        help="check fluxrt against cuBLAS: 1 yes, 0 no (default: %(default)s)")
    parser.add_argument("--no-check", dest="check", action="store_const", const=0, help="same as -c 0")


def normalize_datatype_or_all(name: str) -> str:
    """:func:`normalize_datatype`, or "all" (nccl-tests ``-d all``: every datatype the op takes)."""
    return "all" if str(name).strip().lower() == "all" else normalize_datatype(name)


def normalize_op(name: str) -> str:
    """Canonical reduction operator ("sum", "max", "min"), or "all" (nccl-tests ``-o all``)."""
    key = str(name).strip().lower()
    if key == "all":
        return key
    if key in _NCCL_ONLY_OPS:
        raise ValueError(f"reduction op {name!r} is an nccl-tests op that fluxrt's collectives do not "
                         f"implement: expected one of {', '.join(OPS)} or all")
    if key not in OPS:
        raise ValueError(f"unknown reduction op {name!r}: expected one of {', '.join(OPS)} or all")
    return key


def parse_root(text) -> int | str:
    """``-r``: a rank (int >= 0), or -1 / "all" (nccl-tests' -1: every rank in turn, for ops with a root)."""
    if str(text).strip().lower() in ("all", "-1"):
        return "all"
    try:
        root = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"invalid root {text!r}: expected a rank (0, 1, ...), -1 or all") from None
    if root < 0:
        raise ValueError(f"invalid root {text!r}: must be >= 0, or -1 for every root")
    return root


def reduce_over_ranks(values, average: int = 1) -> float:
    """The reported value of one measurement from its per-rank values (index = rank), as nccl-tests'
    ``-a``: 0 rank 0's, 1 the mean (nccl-tests' default), 2 the minimum, 3 the maximum."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("reduce_over_ranks needs at least one value")
    if average == 0:
        return values[0]
    if average == 1:
        return sum(values) / len(values)
    if average == 2:
        return min(values)
    if average == 3:
        return max(values)
    raise ValueError(f"-a/--average must be 0 (rank 0), 1 (avg), 2 (min) or 3 (max), got {average!r}")


def rank_stats(values) -> dict:
    """min / avg / max over ranks of per-rank values (the JSON's per-size statistics)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("rank_stats needs at least one value")
    return {"min": min(values), "avg": sum(values) / len(values), "max": max(values), "ranks": len(values)}


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
    average: int = 1
    root: int | str = 0
    blocking: int = 0
    timeout: float = 0.0
    register: int = 0
    ngpus: int = 1
    nthreads: int = 1
    json_path: str | None = None
    plot_path: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        # Normalize here so that every consumer sees canonical names, then fail early on bad values.
        self.minbytes = parse_size(self.minbytes)
        self.maxbytes = parse_size(self.maxbytes)
        self.stepbytes = parse_size(self.stepbytes)
        self.datatype = normalize_datatype_or_all(self.datatype)
        self.op = normalize_op(self.op)
        self.root = parse_root(self.root)
        self.validate()

    @property
    def element_size(self) -> int:
        """Bytes per element of :attr:`datatype` (the largest of them with ``-d all``)."""
        if self.datatype == "all":
            return max(DTYPE_SIZES.values())
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
        if self.average not in AVERAGE_MODES:
            raise ValueError(f"-a/--average must be 0 (rank 0), 1 (avg), 2 (min) or 3 (max), got {self.average}")
        if self.blocking not in (0, 1):
            raise ValueError(f"-z/--blocking must be 0 or 1, got {self.blocking}")
        if self.blocking and self.graph_iters:
            raise ValueError("-z 1 (synchronize after each call) cannot be combined with -G "
                             "(the calls are replayed from one CUDA graph): use one of them")
        if self.timeout < 0:
            raise ValueError(f"-T/--timeout must be >= 0 seconds (0: the library's), got {self.timeout}")
        if self.register not in (0, 1, 2):
            raise ValueError(f"-R/--local_register must be 0, 1 (local) or 2 (symmetric), got {self.register}")
        if self.ngpus != 1:
            raise ValueError(f"-g/--ngpus must be 1: fluxrt runs one GPU per rank (start more ranks "
                             f"with fluxrt-run -n), got {self.ngpus}")
        if self.nthreads != 1:
            raise ValueError(f"-t/--nthreads must be 1: fluxrt runs one thread per rank (start more ranks "
                             f"with fluxrt-run -n), got {self.nthreads}")

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


def add_average_argument(g) -> None:
    """nccl-tests' ``-a`` (shared by every fluxrt-perf subcommand and the GEMM benches)."""
    g.add_argument("-a", "--average", type=int, choices=tuple(AVERAGE_MODES), default=1, metavar="0|1|2|3",
                   help="time reported over ranks: 0 rank 0's, 1 mean, 2 min, 3 max (default: %(default)s, "
                        "as nccl-tests)")


def add_timeout_argument(g) -> None:
    """nccl-tests' ``-T``: fluxrt's bound on every device-side wait (WorldOptions.timeout_s)."""
    g.add_argument("-T", "--timeout", type=float, metavar="SECONDS", default=0.0,
                   help="bound of every device-side wait, in seconds (WorldOptions.timeout_s); "
                        "0 = the library's ($FLUXRT_TIMEOUT_S or 30) (default: %(default)s)")


def add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add nccl-tests' sweep flags (-b -e -f -i -n -w -c -d -o -r -a -z -T -R -g -t -G) plus --json, --plot,
    --no-progress."""
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
    g.add_argument("-d", "--datatype", metavar="TYPE", type=_argtype(normalize_datatype_or_all, "datatype"),
                   default=d["datatype"].default,
                   help="fp32|fp16|bf16|int32 (or float|half|bfloat16), or all (default: %(default)s)")
    g.add_argument("-o", "--op", metavar="OP", type=_argtype(normalize_op, "op"), default=d["op"].default,
                   help="reduction operator: sum|max|min, or all (default: %(default)s)")
    g.add_argument("-r", "--root", metavar="ROOT", type=_argtype(parse_root, "root"), default=d["root"].default,
                   help="root rank of ops with a root (broadcast), or all (default: %(default)s)")
    add_average_argument(g)
    g.add_argument("-z", "--blocking", type=int, choices=(0, 1), default=d["blocking"].default,
                   help="1: synchronize the stream after each timed call (default: %(default)s)")
    add_timeout_argument(g)
    g.add_argument("-R", "--local_register", dest="register", type=int, choices=(0, 1, 2),
                   default=d["register"].default,
                   help="buffer registration: 0 none, 1 local, 2 symmetric. fluxrt: 1 and 2 put the buffers on "
                        "the symmetric heap (as --symmetric); NCCL: registered when the bench can, else the "
                        "header and JSON say why not (default: %(default)s)")
    g.add_argument("-g", "--ngpus", type=int, metavar="1", default=d["ngpus"].default,
                   help="GPUs per thread: only 1 (one GPU per rank; more GPUs = more ranks)")
    g.add_argument("-t", "--nthreads", type=int, metavar="1", default=d["nthreads"].default,
                   help="threads per process: only 1")
    g.add_argument("-G", "--graph", "--cudagraph", dest="graph_iters", type=int, metavar="N",
                   default=d["graph_iters"].default,
                   help="capture the -n calls in a CUDA graph and time N replays of it; 0 = eager calls "
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


def sweep_datatypes(opts: SweepOptions, supported=tuple(DTYPE_SIZES)) -> list[str]:
    """The datatypes a sweep runs: ``-d``'s, or with ``-d all`` every one of `supported` (canonical names)."""
    if opts.datatype == "all":
        return [t for t in DTYPE_SIZES if t in supported]
    if opts.datatype not in supported:
        raise ValueError(f"-d {opts.datatype}: expected one of {', '.join(supported)} or all")
    return [opts.datatype]


def sweep_ops(opts: SweepOptions, reducing: bool = True) -> list[str]:
    """The reduction operators a sweep runs: ``-o``'s, every one with ``-o all``; ["none"] if not reducing."""
    if not reducing:
        return ["none"]
    return list(OPS) if opts.op == "all" else [opts.op]


def sweep_roots(opts: SweepOptions, nranks: int, has_root: bool = True) -> list[int]:
    """The roots a sweep runs: ``-r``'s, every rank with ``-r all``; [-1] for ops without a root."""
    if not has_root:
        return [-1]
    if opts.root == "all":
        return list(range(nranks))
    if not 0 <= opts.root < nranks:
        raise ValueError(f"-r/--root {opts.root} outside {nranks} ranks")
    return [opts.root]


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
        f"# datatype {opts.datatype} redop {opts.op} root {opts.root} blocking: {opts.blocking} "
        f"time over ranks (-a {opts.average}): {AVERAGE_MODES[opts.average]} register (-R): {opts.register}",
    ]
