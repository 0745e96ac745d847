"""The GEMM's hooks: what the fused ops compile into the kernel (arrival waits, tile destinations and
flags, the chunk reduce, the own-shard copy) and the row-band layout of a padded operand. Plain
dataclasses, no CUDA calls except :meth:`TileDestinations.tensor_maps`."""
from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import normalize_dtype
from ..errors import GemmArgumentError
from .plan import ITEMSIZE as _ITEMSIZE
from .plan import OUT_DTYPES, TMA_ALIGN

DEFAULT_TIMEOUT_NS = 10_000_000_000
OUT_IDS = OUT_DTYPES


@dataclass(frozen=True)
class ArrivalWait:
    """Hook 1: producer waits for ``flags[chunk] >= epoch`` before loading A rows of that chunk.

    flags: device pointer (int) or array of uint64, one word per chunk of ``chunk_rows`` rows of A.
    err: device/host-mapped pointer of a fluxrt ErrorRecord (6 uint64 words) filled on timeout.
    """
    flags: object
    epoch: int
    chunk_rows: int
    err: object
    chunks_per_peer: int = 1
    timeout_ns: int = DEFAULT_TIMEOUT_NS
    op_id: int = 0
    rank: int = 0


class TileDestinations:
    """Hook 2's per-chunk destinations: the tiles of chunk c (rows ``[c*chunk_rows, (c+1)*chunk_rows)`` of
    C) go to the row-major array at ``ptrs[c]`` (row 0 = the chunk's first row, ``ld`` elements per row,
    element type ``dtype``): local memory or a peer's symmetric buffer alike.

    The kernel stores through one TMA descriptor per chunk, which this object builds per call geometry
    (M, N, chunk_rows: each map holds exactly the rows and columns the call writes, so the TMA clips the
    tails) and keeps in device memory for as long as it lives: build it once, reuse it for every call.
    """

    def __init__(self, ptrs, ld: int, dtype):
        self.ptrs = tuple(int(p) for p in ptrs)
        self.ld = int(ld)
        self.dtype = normalize_dtype(dtype).name
        if not self.ptrs:
            raise GemmArgumentError("gemm: TileDestinations needs at least one destination")
        if self.dtype not in OUT_IDS:
            raise GemmArgumentError(f"gemm: TileDestinations dtype {self.dtype} is not an output type "
                                    f"({', '.join(OUT_IDS)})")
        for c, p in enumerate(self.ptrs):
            if p == 0 or p % TMA_ALIGN:
                raise GemmArgumentError(f"gemm: TileDestinations destination {c} at 0x{p:x} must be non-null and "
                                        f"{TMA_ALIGN}-byte aligned (TMA)")
        if self.ld <= 0 or (self.ld * _ITEMSIZE[self.dtype]) % TMA_ALIGN:
            raise GemmArgumentError(f"gemm: TileDestinations rows of ld={self.ld} {self.dtype} elements must be a "
                                    f"positive multiple of {TMA_ALIGN} bytes (TMA)")
        self._tables: dict = {}

    def check(self, m: int, n: int, chunk_rows: int, out_dtype: str) -> None:
        """The call (M, N, chunk_rows, output type) fits these destinations; before any launch."""
        chunks = -(-m // chunk_rows)
        if chunks > len(self.ptrs):
            raise GemmArgumentError(f"gemm: M={m} in chunks of {chunk_rows} rows needs {chunks} destinations, "
                                    f"TileDestinations has {len(self.ptrs)}")
        if n > self.ld:
            raise GemmArgumentError(f"gemm: N={n} exceeds the destinations' row length ld={self.ld}")
        if out_dtype != self.dtype:
            raise GemmArgumentError(f"gemm: the GEMM writes {out_dtype}, the destinations hold {self.dtype}")

    def tensor_maps(self, m: int, n: int, chunk_rows: int, device_id: int, box_cols: int, box_rows: int):
        """Device array of the call's per-chunk tensor maps (one 128-byte CUtensorMap each), cached."""
        key = (m, n, chunk_rows, device_id, box_cols, box_rows)
        table = self._tables.get(key)
        if table is None:
            import cupy
            import numpy as np

            from .tmaps import tensor_map as _tensor_map

            maps = [_tensor_map(p, self.dtype, min(chunk_rows, m - c * chunk_rows), n, box_cols, box_rows, ld=self.ld,
                                cache=False)
                    for c, p in enumerate(self.ptrs[:-(-m // chunk_rows)])]
            with cupy.cuda.Device(device_id):
                table = cupy.asarray(np.concatenate(maps).view(np.uint64))   # 256-byte aligned allocation
                # the upload is ordered on the current stream, the kernels that read it may run on any
                cupy.cuda.get_current_stream().synchronize()
            self._tables[key] = table
        return table


@dataclass(frozen=True)
class GroupArrival:
    """Hook 1 of the grouped GEMM (:func:`fluxrt.gemm.grouped_gemm`): before the first load of group g's rows
    of A, the loader waits until ``flags[g * sources + s] >= *epoch_at`` for every source s < sources, then
    loads them (``fence.proxy.async`` after the acquires). Tiles of groups whose rows have arrived start while
    other groups' rows are still on their way (the MoE layer's dispatch -> gate/up overlap).

    flags: device pointer of uint64 words, ``sources`` per group (G x sources).
    epoch_at: device pointer of the uint64 the flags must reach, read by the kernel (not the host), so a CUDA
        graph replay waits for the replayed round.
    err, timeout_ns, op_id, rank: where a wait that runs out is reported (peer = the source s).
    """
    flags: int
    epoch_at: int
    sources: int
    err: int
    timeout_ns: int = DEFAULT_TIMEOUT_NS
    op_id: int = 0
    rank: int = 0


@dataclass(frozen=True)
class GroupScatter:
    """Hook 2 of the grouped GEMM (:func:`fluxrt.gemm.grouped_gemm`): no row goes to ``out``. Row y of the output
    goes to row ``rows[y] // homes`` of home ``rows[y] % homes``'s buffer (``dsts[home]``, ``ld`` elements per
    row, out's type; a peer's symmetric memory or local), and once a tile's rows (of one storer turn) are
    stored, the storer adds (rows x columns) of each home's rows to that home's counter ``*flags[home]`` (a
    release at system scope after every lane's fence): the home knows its rows have landed when its counter has
    grown by (its rows) x N. The MoE layer's down projection -> combine overlap.

    rows: device pointer of int32, one per row of the output (read on the device; rows outside every group are
        never read). dsts, flags: device pointers of ``homes`` uint64 each (buffer and counter addresses).
    entries: rows of each destination buffer; a row whose entry is not below it is neither stored nor counted
        (its home's wait runs out instead of reading a wrong row).
    """
    rows: int
    dsts: int
    flags: int
    homes: int
    ld: int
    entries: int


@dataclass(frozen=True)
class ChunkReduce:
    """Hook 3: chunk ``chunk``'s tiles are summed with the other sources' partials of the same rows in the
    consumers' epilogue and TMA-stored to ``out`` ([rows of the chunk, N], C's type), with no flag.

    partials: device pointer of source 0's partial of the chunk's rows (row-major, ``ld`` elements per
        row, C's element type); source s's at ``partials + s * source_bytes``. Source ``chunk`` is this
        GEMM itself (its accumulator): never waited for nor read.
    flags: device pointer of source 0's flags (uint64); source s's at ``flags + 8 * s * flag_stride``:
        one per tile (``local_m_tile * n_tiles + n_tile``), or with ``group_n > 0`` one per group of that
        many tile columns (``n_tile // group_n``). A partial is read once its flag is >= ``epoch``
        (bounded wait; on timeout ``err`` names ``op_id``, ``rank`` and the source).
    Sources are added in fixed order 0, 1, ... in fp32 after the accumulator: deterministic.

    where: 'epilogue' (above) or 'tail': the chunk's tiles are stored like the others, into their
        destination, which must be source ``chunk``'s slot of the partials, and each raises source
        ``chunk``'s per-tile flag to ``epoch``. Every consumer warp that has no tile left then claims
        16-row slabs of the chunk (in the order the schedule made their tiles) and sums all sources,
        source ``chunk`` included, in order 0, 1, ... in fp32 into ``out``. The reduce then runs on the
        SMs that the last wave of tiles leaves idle instead of after the GEMM. Needs ``counter``: the
        device pointer of a uint32 that is 0 before the launch (the launch leaves it 0 again), one per
        stream-ordered sequence of launches; and a cluster-1 plan in grouped order whose schedule makes
        the chunk's tiles in one run (its first tile row after ``m_tile_offset`` a multiple of group_m).
    """
    chunk: int
    out: object
    partials: int
    source_bytes: int
    ld: int
    sources: int
    flags: int
    flag_stride: int
    epoch: int
    err: object
    group_n: int = 0
    timeout_ns: int = DEFAULT_TIMEOUT_NS
    op_id: int = 0
    rank: int = 0
    where: str = "epilogue"
    counter: int = 0

    @property
    def hook_id(self) -> int:
        """FLUXRT_GEMM_HOOK_REDUCE of this reduce: 1 in the epilogue, 2 in the tail."""
        return reduce_hook_id(self.where)


REDUCE_WHERE = ("epilogue", "tail")


def reduce_hook_id(where: str | None) -> int:
    """FLUXRT_GEMM_HOOK_REDUCE for a hook-3 reduce at `where` ('epilogue' 1, 'tail' 2; anything else 0)."""
    return REDUCE_WHERE.index(where) + 1 if where in REDUCE_WHERE else 0


@dataclass(frozen=True)
class ShardCopy:
    """Hook 4 (with hook 1): A's rows ``[row0, row0 + rows)`` are read from ``src`` ([rows, K], A's type,
    C-contiguous) instead of A, and the GEMM copies them into A while it runs: a copier warp in every CTA
    moves its share of {64 K x block_m rows} pieces from ``src`` into A by TMA, through a 16 KiB buffer
    of its own (the GEMM's ring never waits for it), then adds the number it stored (release at system
    scope, after the stores completed) to ``counters[chunk]``, chunk = the piece's rows' chunk of
    ``chunk_rows`` counted from row0. Those rows need no arrival flag (hook 1 skips their chunks).

    The fused AllGather+GEMM uses it for the rank's own shard: no copy into the gathered buffer before the
    GEMM starts, and peers learn that a chunk of it is in place by polling its counter, which grows by
    :meth:`pieces_per_chunk` per call.
    row0 and rows: whole chunks (multiples of ``ArrivalWait.chunk_rows``). counters: device pointer of
    uint64 words, one per chunk of these rows.
    """
    src: object
    row0: int
    counters: int

    @staticmethod
    def pieces_per_chunk(chunk_rows: int, k: int, block_m: int = 128, block_k: int = 64) -> int:
        """What a call adds to each chunk's counter: its {block_k x block_m} pieces."""
        return chunk_rows // block_m * -(-k // block_k)


@dataclass(frozen=True)
class TileEpilogue:
    """Hook 2: per-chunk destination + per-tile release flag, written by the storer warp.

    destinations: :class:`TileDestinations` (chunk c's tiles go to its c-th array). flag_table: device
    array (uint64) of per-chunk flag-array pointers (or None for no signal); tile (local_m_tile, n_tile)
    of chunk c raises ``flag_table[c][local_m_tile * n_tiles + n_tile]`` once the tile is stored, or with
    ``flag_group_n > 0`` ``flag_table[c][n_tile // flag_group_n]``: one counter per group of that many
    n tiles, which every tile of the group in the chunk's rows raises (use ``signal_add``).
    reduce: optional :class:`ChunkReduce` (hook 3) for one chunk, whose tiles then skip their destination
    and flag.
    """
    destinations: TileDestinations
    chunk_rows: int
    flag_table: object = None
    signal_value: int = 1
    signal_add: bool = False
    flag_group_n: int = 0
    reduce: ChunkReduce | None = None


@dataclass(frozen=True)
class RowBands:
    """An operand that holds the GEMM's M rows in bands of ``stride`` rows, of which only the first ``rows``
    are in the array: GEMM row y is array row ``(y // stride) * rows + y % stride`` when ``y % stride <
    rows``, else a padding row. As A ([bands * rows, K]) padding rows read as zeros (TMA's out-of-bounds
    fill); as C ([bands * rows, N]) they are not written (TMA clips them). The kernel takes the band height
    from the hooks' chunk geometry, so ``stride`` must be ``ArrivalWait.chunk_rows * chunks_per_peer`` with
    hook 1, ``TileEpilogue.chunk_rows`` with hook 2, and a multiple of the plan's block_m (no tile
    straddles two bands)."""
    rows: int
    stride: int


BANDS_A, BANDS_C = 1, 2   # FLUXRT_GEMM_BANDS bits: banded A, banded C


def band_bits(a_bands: RowBands | None, c_bands: RowBands | None) -> int:
    """FLUXRT_GEMM_BANDS of a launch."""
    return (BANDS_A if a_bands is not None else 0) | (BANDS_C if c_bands is not None else 0)


