"""GEMM configuration planner: which tile shape, pipeline depth and tile order a problem gets.

Pure Python, no CUDA: the plan is visible (``plan_gemm(...)`` returns a frozen dataclass; print it)
and overridable (pass ``plan=`` to :func:`fluxrt.gemm.gemm`, or ``dataclasses.replace`` a chosen one).

Every field maps onto a compile-time macro or a launch argument of kernels/gemm/hopper_gemm.cu:

=============  =====================================================================================
block_m        tile rows = 64 x consumers (one m64 wgmma row block per consumer warpgroup)
block_n        tile columns = wgmma N (64, 128, 192, 256)
block_k        one 128-byte swizzled row: 64 for 16-bit inputs, 128 for fp8 (FP8_BLOCK_K); fixed per type
stages         depth of the shared-memory ring of (A, B) K blocks
consumers      consumer warpgroups (1 or 2); the producer warpgroup is always one
cluster        CTAs per thread-block cluster along M: 1, or 2 (the pair shares the B tile through TMA multicast)
cluster_n      CTAs along N: 1, or 2 (the pair shares the A tile; 16-bit plain GEMMs). A cluster is
               cluster x cluster_n CTAs: with 2 x 2, each CTA loads half of A's and half of B's rows
order          'grouped' (bands of group_m tile rows) or 'hilbert' (host-built curve table)
group_m        band height in tiles for 'grouped'
m_tile_offset  rank offset: m_tile = (m_tile + m_tile_offset) % m_tiles (a rank starts at its shard)
max_ctas       cap on the persistent grid (None = one CTA per SM)
epilogue       'tma': consumers stage C in smem, a storer warp TMA-stores it (overlaps the next tile);
               'direct': consumers store from registers (no staging smem, so one more stage fits)
c_staging      with epilogue 'tma': 'per_consumer' (one staging region per consumer, the storer drains
               the whole tile at once) or 'shared' (FLUXRT_GEMM_C_SHARED=1: one consumer-sized region
               the consumers fill in turn, the storer drains it once per consumer; half the staging
               with 2 consumers, e.g. 4 stages at 128x256 bf16). No effect with one consumer.
split_k        K in this many slices (whole K blocks, the last shorter: any K), each a band of rows of one
               launch writing fp32 partials, summed in slice order by a second kernel (deterministic): more
               tiles where M x N alone leaves SMs idle
stream_k       True: the tiles of the last one or two waves are cut into K ranges that fill the waves
               (stream_k_geometry; the earlier waves run whole tiles); a cut tile's last piece adds the
               others' fp32 partials in piece order (deterministic, one launch)
pingpong       True (FLUXRT_GEMM_PINGPONG=1; 2 consumers, a plain or grouped GEMM with the 'tma' epilogue, a
               tile width of PINGPONG_BLOCK_N): each consumer computes whole tiles, the CTA's tiles alternating
               between them, so one consumer's epilogue runs beside the other's MMAs (short K); a whole
               128 x block_n tile of accumulators per consumer warpgroup (block_n per thread), and twice the C
               staging of 'per_consumer' (one tile-sized region per consumer; 'shared': one, taken in turns)
=============  =====================================================================================
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

BLOCK_K = 64
FP8_BLOCK_K = 128                  # fp8: a 128-byte row is 128 elements (and one block-scale block of K)
ROW_BYTES = 128                    # bytes of K per stage row, both input widths
SMEM_LIMIT_BYTES = 232448          # 227 KiB: the opt-in maximum dynamic shared memory per block on H100/H200
SMEM_ALIGN_BYTES = 1024            # the kernel aligns its base to a 128B-swizzle atom
MAX_STAGES = 8
# ping-pong tile widths: block_n fp32 accumulators per consumer thread fit (the fitted ones: B [N, K])
PINGPONG_BLOCK_N = (64, 128, 144, 160, 176, 192)
FP8_FIT_WIDTHS = (144, 160, 176, 208, 224, 240)   # fitted widths with fp8 wgmma (kernels/gemm/gen_wgmma.py NS_FP8)
H100_H200_SMS = 132
BLOCK_NS = (256, 192, 128, 64)     # wgmma N of the tile widths the kernel instantiates
ORDERS = ("grouped", "hilbert")
EPILOGUES = ("tma", "direct")
C_STAGINGS = ("per_consumer", "shared")
IN_DTYPES = ("bfloat16", "float16")
# fp8 formats: the GEMM reads uint8 arrays (CuPy has no fp8 dtype) as one of these (ml_dtypes' names)
FP8_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
FP8_DTYPES = tuple(FP8_FORMATS.values())
FP8_OUT_DTYPES = ("bfloat16", "float16")
SCALE_MODES = ("none", "tensor", "block")   # fp8 dequantisation (FLUXRT_GEMM_SCALE 0, 1, 2)
FP8_SCALE_BLOCK = 128                      # block scales: A 1 x 128, B 128 x 128
# block-scaled fp8 tile widths: inside one 128-column scale block of B, or 192 (a tile starts at column 0 or 64 of a
# block and spans two; 256 would span two too, but the promotion's second set of accumulators would not fit)
FP8_BLOCK_SCALE_WIDTHS = (64, 128, 192)
OUT_DTYPES = ("bfloat16", "float16", "float32")
TMA_ALIGN = 16                     # bytes: TMA global addresses and row strides are multiples of 16
MAX_GROUPS = 256                   # grouped GEMM: groups per call (kMaxGroups of the kernel)
GROUP_TABLE_BYTES = (2 * (MAX_GROUPS + 1) + 2) * 4   # its shared-memory table: first rows, tile-row prefix sums,
                                                     # work items


ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}   # bytes per element of each GEMM dtype


def _bytes_of(dtype_name: str) -> int:
    return ITEMSIZE[dtype_name]


def consumers_for(block_m: int) -> int:
    """The consumer warpgroups of a cooperative tile of block_m rows: 1 for 64 rows, else 2 (128 rows: one 64-row
    block each; 256 rows: two each)."""
    return min(block_m // 64, 2)


TALL_MAX_BLOCK_N = 192             # 256-row tiles: block_n fp32 accumulators per consumer thread (256 would spill)
TALL_STREAM_K_MAX_BLOCK_N = 176    # ... in stream-K form (192 spills: the fixup's loads beside the accumulators)
# GemmPlan.describe's line: tile, stages, order (and group), epilogue (and staging), cluster, split-K or stream-K
_DESCRIBE = re.compile(r"(\d+)x(\d+)x(\d+) s(\d+) (grouped|hilbert)(?:/g(\d+))? epi=(tma|direct)(/shared)? "
                       r"x(\d+)(?:x(\d+))?(?: k(\d+)| (sk))?( pp)?")


@dataclass(frozen=True)
class GemmPlan:
    block_m: int = 128
    block_n: int = 256
    block_k: int = BLOCK_K
    stages: int = 3
    consumers: int = 2
    cluster: int = 1
    cluster_n: int = 1
    order: str = "grouped"
    group_m: int = 16
    m_tile_offset: int = 0
    max_ctas: int | None = None
    epilogue: str = "tma"
    c_staging: str = "per_consumer"
    split_k: int = 1
    stream_k: bool = False
    pingpong: bool = False

    def validate(self, out_dtype: str = "bfloat16", b_kmajor: bool = True) -> "GemmPlan":
        """Raise ValueError when the kernel cannot be instantiated with this plan (b_kmajor: B as [N, K]; False for
        [K, N], whose fitted widths take more shared memory)."""
        if self.split_k < 1:
            raise ValueError(f"GemmPlan.split_k must be >= 1, got {self.split_k}")
        if self.split_k > 1:
            if self.cluster != 1 or self.epilogue != "tma":
                raise ValueError("GemmPlan.split_k > 1 needs cluster=1 and epilogue='tma' (fp32 partials stored by "
                                 "the storer warp)")
            out_dtype = "float32"   # the GEMM itself writes fp32 partials
        if self.stream_k and (self.split_k > 1 or self.cluster_n != 1 or self.epilogue != "tma"):
            raise ValueError("GemmPlan.stream_k needs split_k=1, cluster_n=1 and epilogue='tma'")
        if self.pingpong and (self.consumers != 2 or self.epilogue != "tma" or self.split_k > 1 or self.stream_k
                              or self.cluster_n != 1 or self.block_n not in PINGPONG_BLOCK_N):
            raise ValueError(f"GemmPlan.pingpong needs 2 consumers, epilogue='tma', no split-K or stream-K, cluster_n=1 "
                             f"and a tile width in {PINGPONG_BLOCK_N} (block_n fp32 accumulators per consumer thread)")
        if self.consumers not in (1, 2):
            raise ValueError(f"GemmPlan.consumers must be 1 or 2, got {self.consumers}")
        if self.block_m == 2 * 64 * self.consumers == 256:   # 256-row tiles (row_blocks = 2)
            if self.pingpong or self.split_k > 1 or self.block_k != BLOCK_K or self.block_n > TALL_MAX_BLOCK_N:
                raise ValueError(f"GemmPlan.block_m=256 (two consumers of 128 rows) needs 16-bit inputs (block_k="
                                 f"{BLOCK_K}), no ping-pong or split-K and block_n <= "
                                 f"{TALL_MAX_BLOCK_N} (block_n fp32 accumulators per consumer thread), got "
                                 f"{self.describe()}")
            if self.stream_k and self.block_n > TALL_STREAM_K_MAX_BLOCK_N:
                raise ValueError(f"GemmPlan.block_m=256 in stream-K form needs block_n <= {TALL_STREAM_K_MAX_BLOCK_N} "
                                 f"(the fixup's loads beside the accumulators spill above), got {self.describe()}")
        elif self.block_m != 64 * self.consumers:
            raise ValueError(f"GemmPlan.block_m must be 64 * consumers = {64 * self.consumers} (or 256 with two "
                             f"consumers), got {self.block_m}")
        if self.block_n % 16 or not 64 <= self.block_n <= 256:
            raise ValueError(f"GemmPlan.block_n must be a multiple of 16 from 64 to 256, got {self.block_n}")
        if self.fitted_n and (self.split_k > 1 or (self.cluster != 1 and self.block_k != BLOCK_K)):
            raise ValueError(f"GemmPlan.block_n={self.block_n} (not a multiple of 64) needs no split-K, and cluster=1 "
                             f"with fp8 (block_k={self.block_k})")
        if self.block_k not in (BLOCK_K, FP8_BLOCK_K):
            raise ValueError(f"GemmPlan.block_k must be {BLOCK_K} (16-bit inputs) or {FP8_BLOCK_K} (fp8): one 128-byte "
                             f"swizzled row, got {self.block_k}")
        if self.cluster not in (1, 2):
            raise ValueError(f"GemmPlan.cluster must be 1 or 2 (CTAs sharing B by TMA multicast), got {self.cluster}")
        if self.cluster_n not in (1, 2):
            raise ValueError(f"GemmPlan.cluster_n must be 1 or 2 (CTAs sharing A by TMA multicast), "
                             f"got {self.cluster_n}")
        if self.cluster_n > 1 and (self.split_k > 1 or self.stream_k):
            raise ValueError(f"GemmPlan.cluster_n=2 needs split_k=1 and no stream-K, got {self.describe()}")
        if self.order not in ORDERS:
            raise ValueError(f"GemmPlan.order must be one of {ORDERS}, got {self.order!r}")
        if self.group_m < 1:
            raise ValueError(f"GemmPlan.group_m must be >= 1, got {self.group_m}")
        if self.m_tile_offset < 0:
            raise ValueError(f"GemmPlan.m_tile_offset must be >= 0, got {self.m_tile_offset}")
        if self.max_ctas is not None and self.max_ctas < 1:
            raise ValueError(f"GemmPlan.max_ctas must be >= 1 or None, got {self.max_ctas}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"GemmPlan.epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if self.c_staging not in C_STAGINGS:
            raise ValueError(f"GemmPlan.c_staging must be one of {C_STAGINGS}, got {self.c_staging!r}")
        if self.c_staging == "shared" and self.epilogue != "tma":
            raise ValueError(f"GemmPlan.c_staging='shared' needs epilogue='tma' (the '{self.epilogue}' epilogue "
                             "has no C staging)")
        if self.stages < 2:
            raise ValueError(f"GemmPlan.stages must be >= 2, got {self.stages}")
        need = self.smem_bytes(out_dtype, b_kmajor=b_kmajor)
        if need > SMEM_LIMIT_BYTES:
            raise ValueError(f"GemmPlan {self.block_m}x{self.block_n}x{self.block_k} with {self.stages} stages, "
                             f"{out_dtype} output and {self.epilogue}/{self.c_staging} C staging needs {need} B of "
                             f"shared memory > {SMEM_LIMIT_BYTES} B")
        return self

    @property
    def cluster_ctas(self) -> int:
        """CTAs per thread-block cluster (cluster x cluster_n)."""
        return self.cluster * self.cluster_n

    @property
    def row_blocks(self) -> int:
        """64-row wgmma blocks per consumer of a cooperative tile: 1, or 2 in a 256-row tile (the kernel's
        FLUXRT_GEMM_ROW_BLOCKS); ping-pong consumers compute whole tiles instead."""
        return 1 if self.pingpong else max(1, self.block_m // (64 * self.consumers))

    @property
    def fitted_n(self) -> bool:
        """A tile width between the multiples of 64 (a tile fitted to the SMs' waves): B [N, K] (trans_b=True),
        16-bit inputs, plain GEMMs only (no hooks, bands, split-K, stream-K or cluster)."""
        return self.block_n % 64 != 0

    def describe(self) -> str:
        """One line for tables and logs, e.g. '128x256x64 s3 grouped/g16 epi=tma x1'."""
        staging = "/shared" if self.c_staging == "shared" else ""
        order = self.order + (f"/g{self.group_m}" if self.order == "grouped" else "")
        split = f" k{self.split_k}" if self.split_k > 1 else (" sk" if self.stream_k else "")
        return (f"{self.block_m}x{self.block_n}x{self.block_k} s{self.stages} {order} epi={self.epilogue}{staging} "
                f"x{self.cluster}{f'x{self.cluster_n}' if self.cluster_n > 1 else ''}{split}"
                f"{' pp' if self.pingpong else ''}")

    @classmethod
    def parse(cls, text: str) -> "GemmPlan":
        """The plan a :meth:`describe` line names (tables, logs, results JSON); m_tile_offset and max_ctas, which the
        line leaves out, take their defaults. Not validated (:meth:`validate` takes the output dtype). ValueError
        on a line of another form."""
        m = _DESCRIBE.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"{text!r} is not a GemmPlan description such as "
                             f"'128x256x64 s3 grouped/g16 epi=tma x1' (GemmPlan.describe)")
        bm, bn, bk, stages, order, group, epi, shared, cl, cn, split, sk, pp = m.groups()
        kw = dict(block_m=int(bm), block_n=int(bn), block_k=int(bk), stages=int(stages),
                  consumers=consumers_for(int(bm)), order=order, epilogue=epi, cluster=int(cl),
                  cluster_n=int(cn or 1), split_k=int(split or 1), stream_k=bool(sk),
                  c_staging="shared" if shared else "per_consumer", pingpong=bool(pp))
        if group:
            kw["group_m"] = int(group)
        return cls(**kw)

    # --- shared-memory budget (mirrors the constants of hopper_gemm.cu) ---------------------------
    def stage_bytes(self, b_kmajor: bool = True) -> int:
        """One ring stage: A's rows and B's; B as [K, N] (b_kmajor=False) in whole 64-column slabs (kTileBBytes)."""
        b_cols = self.block_n if b_kmajor else -(-self.block_n // 64) * 64
        return (self.block_m + b_cols) * ROW_BYTES

    @property
    def c_turns(self) -> int:
        """Storer turns per tile (= c_full/c_empty barrier pairs, kCTurns in the kernel): one per consumer
        with shared staging or ping-pong, else one. A single consumer is the same either way."""
        return self.consumers if self.c_staging == "shared" or self.pingpong else 1

    def c_staging_bytes(self, out_dtype: str) -> int:
        if self.epilogue == "direct":
            return 0
        slabs = -(-self.block_n * _bytes_of(out_dtype) // 128)   # 128-byte column slabs, the last part-filled
        rows = self.block_m if self.pingpong else self.block_m // self.consumers   # kRowsPerConsumer
        regions = 1 if self.c_staging == "shared" else self.consumers   # kCSlots
        return regions * rows * slabs * 128

    def smem_bytes(self, out_dtype: str = "bfloat16", shard_copy: bool = False, grouped: bool = False,
                   b_kmajor: bool = True) -> int:
        """Dynamic shared memory of the kernel; shard_copy: with GEMM hook 4 (its copier's buffer of one
        A piece and its barrier); grouped: the grouped GEMM (its group table); b_kmajor: B as [N, K] (False: [K, N],
        which differs only for a fitted width, whose last 64-column slab of B is loaded whole)."""
        barriers = 8 * (2 * self.stages + 2 * self.c_turns + int(shard_copy))
        copy = self.block_m * ROW_BYTES if shard_copy else 0
        table = GROUP_TABLE_BYTES if grouped else 0
        return (self.stages * self.stage_bytes(b_kmajor) + self.c_staging_bytes(out_dtype) + copy + barriers + table
                + SMEM_ALIGN_BYTES)

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        return math.ceil(m / self.block_m), math.ceil(n / self.block_n)

    def grid(self, m: int, n: int, num_sms: int = H100_H200_SMS, max_clusters: int | None = None) -> int:
        """Persistent grid: CTAs = cluster_ctas * min(resident clusters, work items). A work item is one
        tile per CTA of a cluster (cluster consecutive M tiles x cluster_n consecutive N tiles)."""
        mt, nt = self.tiles(m, n)
        items = -(-mt // self.cluster) * -(-nt // self.cluster_n)
        if self.stream_k:   # the K blocks are cut over every SM, however few the tiles
            items = num_sms
        cap = num_sms if self.max_ctas is None else min(self.max_ctas, num_sms)
        clusters = max(1, cap // self.cluster_ctas)
        if max_clusters is not None:
            clusters = min(clusters, max_clusters)
        return self.cluster_ctas * max(1, min(clusters, items))


def max_stages(block_m: int, block_n: int, out_dtype: str, epilogue: str = "tma",
               c_staging: str = "per_consumer", pingpong: bool = False, b_kmajor: bool = True) -> int:
    """Deepest ring that fits next to the C staging buffer (and the barriers), up to MAX_STAGES."""
    probe = GemmPlan(block_m=block_m, block_n=block_n, consumers=consumers_for(block_m), stages=1, epilogue=epilogue,
                     c_staging=c_staging, pingpong=pingpong)
    s = 0
    while s + 1 <= MAX_STAGES and dataclasses.replace(probe, stages=s + 1).smem_bytes(
            out_dtype, b_kmajor=b_kmajor) <= SMEM_LIMIT_BYTES:
        s += 1
    return s


def _wave_efficiency(tiles: int, ctas: int) -> float:
    waves = math.ceil(tiles / ctas)
    return tiles / (waves * ctas)


@functools.lru_cache(maxsize=1024)   # GemmPlan is frozen: the same problem gets the same object, fast
def plan_gemm(m: int, n: int, k: int, *, in_dtype: str = "bfloat16", out_dtype: str = "bfloat16",
              num_sms: int = H100_H200_SMS, order: str = "grouped", m_tile_offset: int = 0) -> GemmPlan:
    """Choose a plan for C[m, n] = A[m, k] @ B.

    Heuristic (cheap, deterministic, documented so it can be second-guessed):
      * 128 x 256 tiles (2 consumers, m64n256 wgmma: 128 fp32 accumulators per math thread) whenever
        the output staging allows >= 3 stages; fp32 output (128 KiB staging) uses 128 x 128.
      * N <= 128 or a clearly better wave fill: 128 x 128.
      * M <= 64: one consumer (64-row tiles) so that a thin problem does not compute padding.
      * stages: as many as fit in 227 KiB next to the C staging buffer.
      * group_m ~ sqrt(2 * #SMs) tile rows: the A bands and B columns resident per wave are balanced.
    """
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"unsupported input dtype {in_dtype!r} (expected one of {IN_DTYPES})")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"unsupported output dtype {out_dtype!r} (expected one of {OUT_DTYPES})")
    consumers = 1 if m <= 64 else 2
    block_m = 64 * consumers
    candidates = []
    for bn in (256, 128):
        if max_stages(block_m, bn, out_dtype) < 3:
            continue
        mt, nt = math.ceil(m / block_m), math.ceil(n / bn)
        eff = _wave_efficiency(mt * nt, min(num_sms, mt * nt))
        # padding waste along N also counts
        eff *= n / (nt * bn)
        candidates.append((bn, eff))
    if not candidates:
        candidates = [(128, 1.0)]
    block_n, best = candidates[0]
    for bn, eff in candidates[1:]:
        if eff > best + 0.10:  # a 128-wide tile costs ~8% per flop (more B traffic, smaller MMAs)
            block_n, best = bn, eff
    stages = min(max_stages(block_m, block_n, out_dtype), 6)
    m_tiles = math.ceil(m / block_m)
    group_m = max(1, min(m_tiles, round(math.sqrt(2 * num_sms))))
    return GemmPlan(block_m=block_m, block_n=block_n, block_k=BLOCK_K, stages=stages, consumers=consumers,
                    cluster=1, order=order, group_m=group_m, m_tile_offset=m_tile_offset).validate(out_dtype)


# Relative throughput of one SM on a tile shape (block_m, block_n, cluster) against 128x256 without a
# cluster, fitted to the per-candidate times of an autotuning pass over the shape suite (docs/tuning.md).
TILE_RATE = {(128, 256, 1): 1.00, (128, 256, 2): 0.98, (128, 192, 1): 0.776, (128, 192, 2): 0.93,
             (128, 128, 1): 0.898, (128, 128, 2): 0.741, (128, 64, 1): 0.70,
             (64, 256, 1): 0.62, (64, 192, 1): 0.75, (64, 128, 1): 0.55, (64, 64, 1): 0.40}
TILE_FIXED_K = 256     # per-tile cost outside the main loop (ring fill, epilogue), in K-steps of work
CLUSTER_MIN_TILE_ROWS = 16   # cluster-2 plans only where at least this many 128-row tiles pair up
# B's rows not whole 32-byte sectors (K of B stored [N, K], N of B stored [K, N], times the element size) make
# every TMA load of B touch one more sector; sharing B across a cluster halves those loads. Factor on the
# rates of every cluster-1 plan (plain, split-K, stream-K) where such rows are loaded.
MISALIGNED_B_CLUSTER1_RATE = 0.80
# K not a multiple of 64 (rows of A not whole 128-byte lines): a smaller factor on plain cluster-1 plans only,
# where measurements disagree (docs/tuning.md); B's sectors take precedence.
UNALIGNED_K_CLUSTER1_RATE = 0.88
SECTOR_BYTES = 32


def misaligned_b_rows(n: int, k: int, trans_b: bool = True, itemsize: int = 2) -> bool:
    """True where B's rows are not whole 32-byte sectors: rows of K elements when B is stored [N, K] (trans_b),
    of N elements when stored [K, N]."""
    return bool(((k if trans_b else n) * itemsize) % SECTOR_BYTES)


def _cluster1_factor(m: int, n: int, k: int, trans_b: bool, plain: bool = False) -> float:
    """The rate factor of a cluster-1 plan where cluster-2 plans are an alternative (enough tile rows pair up):
    MISALIGNED_B_CLUSTER1_RATE where B's rows are misaligned, else (plain plans only) UNALIGNED_K_CLUSTER1_RATE
    where K % 64 != 0, else 1."""
    if math.ceil(m / 128) < CLUSTER_MIN_TILE_ROWS:
        return 1.0
    if misaligned_b_rows(n, k, trans_b):
        return MISALIGNED_B_CLUSTER1_RATE
    return UNALIGNED_K_CLUSTER1_RATE if plain and k % 64 else 1.0


# Rates of the fitted widths (128-row tiles, cluster 1; GemmPlan.fitted_n), fitted as TILE_RATE is (docs/tuning.md).
FIT_RATE = {80: 0.749, 96: 0.750, 112: 0.849, 144: 0.990, 160: 0.900, 176: 0.990, 208: 1.000, 224: 0.900, 240: 0.944}


def tile_rate(block_m: int, block_n: int, cluster: int = 1) -> float:
    """TILE_RATE of a tile shape; a fitted width its FIT_RATE, or where it has none, the rate between its
    neighbours in TILE_RATE (same rows and cluster), linearly. ValueError where the table has no neighbours on
    both sides (such plans are autotune candidates only)."""
    rate = TILE_RATE.get((block_m, block_n, cluster))
    if rate is not None:
        return rate
    if block_m == 128 and cluster == 1 and block_n in FIT_RATE:
        return FIT_RATE[block_n]
    widths = sorted(bn for bm, bn, c in TILE_RATE if bm == block_m and c == cluster)
    lo = max((w for w in widths if w < block_n), default=None)
    hi = min((w for w in widths if w > block_n), default=None)
    if lo is None or hi is None:
        raise ValueError(f"no modelled rate for {block_m}x{block_n} tiles in clusters of {cluster} (autotune "
                         f"candidates only)")
    r_lo, r_hi = TILE_RATE[(block_m, lo, cluster)], TILE_RATE[(block_m, hi, cluster)]
    return r_lo + (r_hi - r_lo) * (block_n - lo) / (hi - lo)


def tile_cost(m: int, n: int, k: int, block_m: int, block_n: int, cluster: int = 1,
              num_sms: int = H100_H200_SMS, trans_b: bool = True, misaligned: bool = True) -> float:
    """Modelled time of a problem with one tile shape, in arbitrary units: whole waves of persistent
    CTAs, each tile taking (K + TILE_FIXED_K) steps at its shape's rate; a partial last wave costs a
    whole one, and padding rows and columns cost like real ones. trans_b: B stored [N, K] (its rows are K
    long) rather than [K, N] (rows N long): whether B's rows are misaligned (:func:`misaligned_b_rows`);
    misaligned=False leaves that factor out (a caller that applies it on the whole problem)."""
    tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
    waves = math.ceil(tiles / num_sms)
    rate = tile_rate(block_m, block_n, cluster)
    if cluster == 1 and misaligned:
        rate *= _cluster1_factor(m, n, k, trans_b, plain=True)
    return waves * block_m * block_n * (k + TILE_FIXED_K) / rate


def tile_shapes(m: int) -> list[tuple[int, int, int]]:
    """The (block_m, block_n, cluster) the planner and the autotuner consider for M rows."""
    return [key for key in TILE_RATE if key[2] == 1 or math.ceil(m / 128) >= CLUSTER_MIN_TILE_ROWS]


SPLITS = (2, 3, 4, 6, 8)
SPLIT_MIN_K = 512          # K of one slice at least this: shorter slices spend their time filling the ring
SPLIT_FIXED_COST = 9e6     # the second launch (the reduce), in tile_cost units: about 3 us at 128x256 rates
SPLIT_RATE = 0.95          # fp32 partials need 4x C staging: fewer stages than the same tile with 16-bit out


def split_slices(k: int, splits: int, block_k: int = BLOCK_K) -> tuple[int, int]:
    """How split-K cuts K: (k_slice, count). Every slice but the last is k_slice columns, a whole number of
    K blocks (so it ends on a block boundary and never reads the next slice's columns); the last one holds
    the rest, 1 .. k_slice columns. count <= splits: slices of whole blocks cover K in fewer pieces when K has
    few blocks (7 blocks in 4 slices: 2 + 2 + 2 + 1; 5 blocks: 2 + 2 + 1, three slices)."""
    if k < 1 or splits < 1:
        raise ValueError(f"split_slices: K={k} and splits={splits} must be positive")
    blocks = -(-k // block_k)
    k_slice = -(-blocks // splits) * block_k
    return k_slice, -(-k // k_slice)


def split_cost(m: int, n: int, k: int, block_m: int, block_n: int, splits: int, num_sms: int = H100_H200_SMS,
               trans_b: bool = True) -> float:
    """Modelled time of a split-K plan in :func:`tile_cost` units (one unit: one multiply-add of one SM at the
    128x256 rate, about 0.33 ps on H100/H200, which makes a byte of DRAM traffic about one unit): the launch
    over splits bands of padded rows with K / splits, its fp32 partials written and read back once, C
    written, and the reduce launch."""
    m_pad = math.ceil(m / block_m) * block_m
    gemm = tile_cost(splits * m_pad, n, k // splits, block_m, block_n, 1, num_sms, misaligned=False) / SPLIT_RATE
    gemm /= _cluster1_factor(m, n, k, trans_b)   # the slices read B's rows as the whole problem does
    return gemm + 2 * splits * m * n * 4 + m * n * 2 + SPLIT_FIXED_COST


def split_plans(m: int, n: int, k: int, out_dtype: str = "bfloat16", num_sms: int = H100_H200_SMS, *,
                partial_waves: bool = False) -> list[GemmPlan]:
    """Split-K plans worth considering: where a tile shape's tiles fill less than one wave, for every slice
    count that cuts K (any K: :func:`split_slices`) into slices of at least SPLIT_MIN_K and keeps the tiles
    within two waves.
    partial_waves (the autotuner's wider set): also where the tiles make a few waves whose last one is mostly
    idle (at most SPLIT_WAVES_MAX waves, last wave below SPLIT_PARTIAL_FILL), with slices that fill the waves
    better, up to SPLIT_WAVES_MAX waves of work items: small-M problems that stream B once (M <= 512) run at the
    memory's rate only when every SM reads."""
    out = []
    for bm, bn, cluster in TILE_RATE:
        if cluster != 1:
            continue
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        few = tiles < num_sms
        if not few and not (partial_waves and _ragged_waves(tiles, num_sms)):
            continue
        stages = min(max_stages(bm, bn, "float32"), 6)
        if stages < 3:
            continue
        most = (2 if few else SPLIT_WAVES_MAX) * num_sms
        for splits in SPLITS:
            if k // splits < SPLIT_MIN_K or split_slices(k, splits)[1] != splits or splits * tiles > most:
                continue
            if not few and _wave_fill(splits * tiles, num_sms) <= _wave_fill(tiles, num_sms):
                continue
            out.append(GemmPlan(block_m=bm, block_n=bn, stages=stages, consumers=bm // 64, split_k=splits,
                                group_m=max(1, min(math.ceil(splits * m / bm), 16))))
    return out


SPLIT_WAVES_MAX = 4          # partial_waves: tiles of at most this many waves, work items of at most as many
SPLIT_PARTIAL_FILL = 0.75    # partial_waves: a last wave filled below this is worth slicing K for


def _wave_fill(items: int, num_sms: int) -> float:
    """The busy fraction of SM-waves when `items` equal work items run persistently on num_sms SMs."""
    return items / (math.ceil(items / num_sms) * num_sms)


def _ragged_waves(tiles: int, num_sms: int) -> bool:
    waves = math.ceil(tiles / num_sms)
    return waves <= SPLIT_WAVES_MAX and _wave_fill(tiles, num_sms) < SPLIT_PARTIAL_FILL


STREAM_K_MAX_FILL = 0.9      # stream-K plans where the tiles' waves are busy less than this
STREAM_K_TUNE_MAX_FILL = 0.97   # ... for the autotuner (every_shape): a last wave short by more than 3 % of the call,
STREAM_K_TUNE_TILE = (128, 256)   # for this tile between the two fills (where it was measured)
STREAM_K_MIN_K = 1024        # ... and K has at least this many columns (16 K blocks) to cut
STREAM_K_MAX_PIECES = 16     # K ranges a cut tile may be cut into
STREAM_K_MIN_PIECE_BLOCKS = 4    # K blocks of a piece at least (shorter pieces spend their time filling the ring)
STREAM_K_PIECE_COST = 2      # K blocks' time of one partial's round trip through L2 (stored, or folded by the finisher)
STREAM_K_MAX_PARTIAL_BYTES = 128 << 20   # the cut tiles' fp32 partials at most
STREAM_K_RATE = 0.85         # the model's discount of stream-K plans (not fitted): picked only where clearly ahead
STREAM_K_MIN_TILE = (128, 128)   # the heuristic's stream-K tiles at least this (narrower cut tiles lost when measured)
STREAM_K_MAX_ALL_CUT_PIECES = 2  # the heuristic's stream-K plans that cut every tile: at most this many pieces


def stream_k_geometry(tiles: int, k_blocks: int, ctas: int, tile_bytes: int = 128 * 256 * 4) -> tuple[int, int, int]:
    """How stream-K cuts a problem of `tiles` tiles of `k_blocks` K blocks on `ctas` persistent CTAs:
    (dp_tiles, pieces, piece_blocks). The first dp_tiles tiles (whole waves) run whole; each of the others is cut
    into `pieces` K ranges of piece_blocks blocks (the last shorter; every piece non-empty), units that continue
    the round robin. Chosen to minimise the modelled time per CTA in K blocks: the waves of units times a unit's
    blocks plus TILE_FIXED_K, plus the partials' round trips on the finisher's path; among the whole waves all
    or all but the last run whole. pieces == 1: nothing cut (a plain schedule)."""
    fixed = TILE_FIXED_K // 64
    r = tiles % ctas
    if r == 0 or k_blocks < 2 * STREAM_K_MIN_PIECE_BLOCKS:
        return tiles - r, 1, k_blocks
    best = None
    for dp in sorted({tiles - r, max(0, tiles - r - ctas)}, reverse=True):
        cut = tiles - dp
        for p in range(1, STREAM_K_MAX_PIECES + 1):
            pb = -(-k_blocks // p)
            pieces = -(-k_blocks // pb)
            if pieces != p or (p > 1 and pb < STREAM_K_MIN_PIECE_BLOCKS) or cut * (p - 1) * tile_bytes > STREAM_K_MAX_PARTIAL_BYTES:
                continue
            cost = (dp // ctas) * (k_blocks + fixed) + -(-cut * p // ctas) * (pb + fixed)
            if p > 1:
                cost += STREAM_K_PIECE_COST * p
            if best is None or cost < best[0]:
                best = (cost, dp, p, pb)
    return best[1], best[2], best[3]


def stream_k_cost(m: int, n: int, k: int, block_m: int, block_n: int, num_sms: int = H100_H200_SMS,
                  trans_b: bool = True, cluster: int = 1) -> float:
    """Modelled time of a stream-K plan in :func:`tile_cost` units: :func:`stream_k_geometry`'s K blocks per CTA
    at the tile shape's rate times STREAM_K_RATE. cluster=2: the geometry over pairs of M tiles and clusters, at
    the cluster-2 rate of the tile."""
    items = math.ceil(math.ceil(m / block_m) / cluster) * math.ceil(n / block_n)
    ctas = num_sms // cluster
    kb = -(-k // BLOCK_K)
    dp, pieces, pb = stream_k_geometry(items, kb, ctas, cluster * block_m * block_n * 4)
    fixed = TILE_FIXED_K // BLOCK_K
    cut = items - dp
    blocks = (dp // ctas) * (kb + fixed) + -(-cut * pieces // ctas) * (pb + fixed)
    if pieces > 1:
        blocks += STREAM_K_PIECE_COST * pieces
    rate = tile_rate(block_m, block_n, cluster) * STREAM_K_RATE
    if cluster == 1:
        rate *= _cluster1_factor(m, n, k, trans_b)
    return block_m * block_n * BLOCK_K * blocks / rate


def stream_k_plans(m: int, n: int, k: int, out_dtype: str = "bfloat16", num_sms: int = H100_H200_SMS, *,
                   every_shape: bool = False) -> list[GemmPlan]:
    """Stream-K plans worth considering: every cluster-1 tile shape of at least STREAM_K_MIN_TILE (every_shape:
    any, and the cluster-2 tiles of TILE_RATE where M has two tile rows: the autotuner's set) whose work items
    (tiles; pairs of M tiles with a cluster) fill their waves less than STREAM_K_MAX_FILL (every_shape: also
    the tile STREAM_K_TUNE_TILE under STREAM_K_TUNE_MAX_FILL), when K has at least
    STREAM_K_MIN_K columns. Not for the heuristic (every_shape=False): a geometry that cuts every tile into more
    than STREAM_K_MAX_ALL_CUT_PIECES pieces (few tiles: each finisher folds many partials alone, where split-K's
    reduction spreads over the GPU; measured slower than split-K or a narrower tile on H200)."""
    if k < STREAM_K_MIN_K:
        return []
    out = []
    for bm, bn, cluster in TILE_RATE:
        if not every_shape and (cluster != 1 or (bm, bn) < STREAM_K_MIN_TILE):
            continue
        if cluster != 1 and math.ceil(m / bm) < cluster:   # else every pair computes a phantom tile
            continue
        items = math.ceil(math.ceil(m / bm) / cluster) * math.ceil(n / bn)
        ctas = num_sms // cluster   # with a cluster: items are pairs of M tiles, run by clusters
        fill = _wave_fill(items, ctas)
        if fill >= STREAM_K_MAX_FILL and not (every_shape and fill < STREAM_K_TUNE_MAX_FILL
                                              and (bm, bn) == STREAM_K_TUNE_TILE):
            continue
        if not every_shape:
            dp, pieces, _ = stream_k_geometry(items, -(-k // BLOCK_K), ctas, cluster * bm * bn * 4)
            if dp == 0 and pieces > STREAM_K_MAX_ALL_CUT_PIECES:
                continue
        stages = min(max_stages(bm, bn, out_dtype), 6)
        if stages >= 2:
            out.append(GemmPlan(block_m=bm, block_n=bn, stages=stages, consumers=bm // 64, stream_k=True,
                                cluster=cluster, group_m=max(1, min(math.ceil(m / bm), 16))))
    return out


def plan_cost(plan: GemmPlan, m: int, n: int, k: int, num_sms: int = H100_H200_SMS, trans_b: bool = True) -> float:
    """The model's time of a plan (:func:`tile_cost`, :func:`split_cost`, :func:`stream_k_cost`)."""
    if plan.split_k > 1:
        return split_cost(m, n, k, plan.block_m, plan.block_n, plan.split_k, num_sms, trans_b)
    if plan.stream_k:
        return stream_k_cost(m, n, k, plan.block_m, plan.block_n, num_sms, trans_b, plan.cluster)
    if plan.cluster_n != 1:
        raise ValueError(f"plan_cost: no modelled rate for clusters along N ({plan.describe()}: autotune "
                         f"candidates only)")
    return tile_cost(m, n, k, plan.block_m, plan.block_n, plan.cluster, num_sms, trans_b)


# Fitted tile widths (GemmPlan.fitted_n): 128-row tiles of these widths are among the heuristic's plans of a GEMM whose
# B is [N, K], costed at their FIT_RATE (tile_rate), and among the autotuner's with either layout. Provenance:
# docs/tuning.md.
FIT_WIDTHS = (80, 96, 112, 144, 160, 176, 208, 224, 240)
FIT_PAIR_MIN_TILE_ROWS = 8   # the autotuner's fitted pairs where M has this many tile rows (docs/tuning.md)


def staged_ring(block_m: int, block_n: int, out_dtype: str, b_kmajor: bool = True) -> tuple[int, str]:
    """(stages, c_staging) of a staged-epilogue tile at its deepest ring (at most 6 stages): beside per-consumer C
    staging, or, where that leaves fewer than 4 stages, beside shared staging when it adds a stage."""
    stages = min(max_stages(block_m, block_n, out_dtype, b_kmajor=b_kmajor), 6)
    shared = min(max_stages(block_m, block_n, out_dtype, c_staging="shared", b_kmajor=b_kmajor), 6)
    return (shared, "shared") if stages < 4 and shared > stages else (stages, "per_consumer")


def fitted_plans(m: int, out_dtype: str = "bfloat16", b_kmajor: bool = True, pairs: bool = False) -> list[GemmPlan]:
    """128-row tiles of every FIT_WIDTHS width with the staged epilogue at the ring of :func:`staged_ring`.
    b_kmajor=False: the rings of B as [K, N] (whole 64-column slabs of B per stage). pairs: also each in a cluster of
    2 along M (B multicast), where M has FIT_PAIR_MIN_TILE_ROWS tile rows."""
    out = []
    for bn in FIT_WIDTHS:
        stages, staging = staged_ring(128, bn, out_dtype, b_kmajor)
        if stages >= 2:
            out.append(GemmPlan(block_n=bn, stages=stages, c_staging=staging,
                                group_m=max(1, min(math.ceil(m / 128), 16))))
    if pairs and math.ceil(m / 128) >= FIT_PAIR_MIN_TILE_ROWS:   # the widths above 128 (the narrower: small M)
        out += [dataclasses.replace(p, cluster=2) for p in out if p.block_n > 128]
    return out


def fitted_stream_k_plans(m: int, n: int, k: int, out_dtype: str = "bfloat16", num_sms: int = H100_H200_SMS,
                          b_kmajor: bool = True) -> list[GemmPlan]:
    """The stream-K forms of the :func:`fitted_plans` wider than 128 whose tiles fill their waves less than
    STREAM_K_MAX_FILL, where K has at least STREAM_K_MIN_K columns: a width that wastes few columns of N with the
    partial wave cut along K. The autotuner's candidates; not in the cost model."""
    if k < STREAM_K_MIN_K:
        return []
    return [dataclasses.replace(p, stream_k=True) for p in fitted_plans(m, out_dtype, b_kmajor)
            if p.block_n > 128 and _wave_fill(math.ceil(m / p.block_m) * math.ceil(n / p.block_n), num_sms)
            < STREAM_K_MAX_FILL]


# 256-row tiles (two consumers of 128 rows, GemmPlan.row_blocks = 2): the autotuner's candidates where M has more
# than 256 rows, each width at its deepest ring (3-4 stages: A's stage is 32 KiB), in pairs along M where M has
# TALL_PAIR_MIN_TILE_ROWS of them, in pairs along N (A multicast: each CTA loads 128 of the 256 rows) where N has two
# tile columns, in stream-K form where the waves are ragged; where the staged ring has fewer than 4 stages, also with
# the direct epilogue in pairs along N (4 stages: no C staging); where N has two tile columns, also in 2 x 2
# clusters with the direct epilogue. Measured on H200 (docs/tuning.md): 1.05-1.07x the tuned winner at
# 9166x664x12896 NK (256 x 96, the tile cuBLASLt runs there), pairs along N 1.0-1.1x on six shapes
# (11603x3408x11800, 2692x1960x8424 KN: 256 x 176), the direct epilogue 1.13-1.17x at 461x9128x13208, and there
# 2 x 2 clusters (256 x 160) 1.09-1.12x the pairs along N at full clocks, level in the suite's timing. Not in the
# cost model.
TALL_WIDTHS = (96, 128, 144, 160, 176, 192)
TALL_PAIR_MIN_TILE_ROWS = 4


def tall_plans(m: int, n: int, k: int, out_dtype: str = "bfloat16", num_sms: int = H100_H200_SMS,
               b_kmajor: bool = True) -> list[GemmPlan]:
    """256 x TALL_WIDTHS plans at the ring of :func:`staged_ring` (shared C staging wherever it adds a stage), also
    in clusters of 2 along M where M has TALL_PAIR_MIN_TILE_ROWS 256-row tiles, in clusters of 2 along N where N has
    two tile columns (and there, where the staged ring is shallower than 4 stages, with the direct epilogue at its
    deeper ring, and in 2 x 2 clusters with the direct epilogue), and in stream-K form (widths up to
    TALL_STREAM_K_MAX_BLOCK_N) where their waves are busy less than STREAM_K_MAX_FILL and K has STREAM_K_MIN_K
    columns. None where M has 256 rows or fewer."""
    if m <= 256:
        return []
    rows = math.ceil(m / 256)
    out = []
    for bn in TALL_WIDTHS:
        stages, staging = staged_ring(256, bn, out_dtype, b_kmajor)
        if stages < 2:
            continue
        plan = GemmPlan(block_m=256, block_n=bn, stages=stages, c_staging=staging, group_m=max(1, min(rows, 8)))
        out.append(plan)
        if rows >= TALL_PAIR_MIN_TILE_ROWS:
            out.append(dataclasses.replace(plan, cluster=2))
        if math.ceil(n / bn) >= 2:
            out.append(dataclasses.replace(plan, cluster_n=2))
            direct = min(max_stages(256, bn, out_dtype, epilogue="direct", b_kmajor=b_kmajor), 6)
            if stages < 4 <= direct:
                out.append(dataclasses.replace(plan, cluster_n=2, epilogue="direct", c_staging="per_consumer",
                                               stages=direct))
            # 2 x 2: A and B both multicast (M has two tile rows: m > 256)
            out.append(dataclasses.replace(plan, cluster=2, cluster_n=2, epilogue="direct",
                                           c_staging="per_consumer", stages=direct))
        if (bn <= TALL_STREAM_K_MAX_BLOCK_N and k >= STREAM_K_MIN_K
                and _wave_fill(rows * math.ceil(n / bn), num_sms) < STREAM_K_MAX_FILL):
            out.append(dataclasses.replace(plan, stream_k=True))
    return out


@functools.lru_cache(maxsize=4096)
def heuristic_plan(m: int, n: int, k: int, *, in_dtype: str = "bfloat16", out_dtype: str = "bfloat16",
                   trans_b: bool = False, num_sms: int = H100_H200_SMS, stream_k: bool = True) -> GemmPlan:
    """The plan of a plain GEMM without measuring: the plan of least modelled time (:func:`plan_cost`; ties go
    to the one considered first) among every tile shape of TILE_RATE at its deepest ring (at most 6 stages),
    the split-K plans of :func:`split_plans` and the stream-K plans of :func:`stream_k_plans`, grouped order with
    bands of up to 16 tile rows; with B as [N, K] (``trans_b``) whose rows are whole 32-byte sectors also the
    fitted widths of :func:`fitted_plans` (with B off the sectors a fitted width lost to stream-K:
    461x9128x13208). What :func:`fluxrt.gemm.gemm` takes when the autotune cache has no entry. stream_k=False:
    without the stream-K plans (for comparisons)."""
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"unsupported input dtype {in_dtype!r} (expected one of {IN_DTYPES})")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"unsupported output dtype {out_dtype!r} (expected one of {OUT_DTYPES})")
    best = None
    for plan in (plain_plans(m, out_dtype) + split_plans(m, n, k, out_dtype, num_sms)
                 + (stream_k_plans(m, n, k, out_dtype, num_sms) if stream_k else [])
                 + (fitted_plans(m, out_dtype) if trans_b and not misaligned_b_rows(n, k, trans_b) else [])):
        cost = plan_cost(plan, m, n, k, num_sms, trans_b)
        if best is None or cost < best[0] * 0.999:
            best = (cost, plan)
    return best[1].validate(out_dtype)


def plain_plans(m: int, out_dtype: str = "bfloat16") -> list[GemmPlan]:
    """Every tile shape of :func:`tile_shapes` at its deepest ring (at most 6 stages), grouped order."""
    out = []
    for bm, bn, cluster in tile_shapes(m):
        stages = min(max_stages(bm, bn, out_dtype), 6)
        if stages >= 2:
            out.append(GemmPlan(block_m=bm, block_n=bn, stages=stages, consumers=bm // 64, cluster=cluster,
                                group_m=max(1, min(math.ceil(m / bm), 16))))
    return out


# Ping-pong consumers (GemmPlan.pingpong): (block_n, c_staging) of the autotuner's candidates, each at its deepest
# ring (at most 6 stages), without and with a cluster pair. Measured on H200 (docs/tuning.md): 128 x 128 gains 5-11 %
# over the best cooperative plan on fp8 shapes with K 768-1536 and 2-5 % on bf16 ones with K 768-4096; 128 x 64 lost
# everywhere measured. Not in the cost model: only the autotuner tries them.
PINGPONG_TILES = ((128, "per_consumer"), (128, "shared"), (192, "shared"))


def pingpong_plans(m: int, out_dtype: str = "bfloat16", block_k: int = BLOCK_K, tiles=PINGPONG_TILES,
                   pairs: bool = True) -> list[GemmPlan]:
    """Plans of ``tiles`` ((block_n, c_staging) pairs; 128-row tiles, only where M has more than one 64-row block),
    also with cluster 2 where ``pairs`` and M has two tile rows (fp8's fitted ping-pong tiles are given without)."""
    if m <= 64:
        return []
    out = []
    for bn, staging in tiles:
        stages = min(max_stages(128, bn, out_dtype, c_staging=staging, pingpong=True), 6)
        if stages < 2:
            continue
        for cluster in (1, 2) if pairs and math.ceil(m / 128) >= 2 else (1,):
            out.append(GemmPlan(block_m=128, block_n=bn, block_k=block_k, stages=stages, cluster=cluster,
                                c_staging=staging, pingpong=True, group_m=max(1, min(math.ceil(m / 128), 16))))
    return out


# Clusters along N (GemmPlan.cluster_n = 2, A shared by TMA multicast as B is along M): (block_m, block_n,
# cluster) of the autotuner's candidates, the 2 x 2 clusters that won a shape in the measured pass; 1 x 2 clusters
# (also of the narrow tiles cuBLASLt clusters for small M) won none (docs/tuning.md). Not in the cost model.
CLUSTER_N_TILES = ((128, 256, 2), (128, 192, 2), (128, 128, 2))


def cluster_n_plans(m: int, out_dtype: str = "bfloat16", n: int | None = None) -> list[GemmPlan]:
    """Plans of CLUSTER_N_TILES at their deepest ring (at most 6 stages), grouped order; only where M has at least
    two tile rows and N (when given) at least two tile columns (else half of every cluster computes phantom tiles)."""
    out = []
    for bm, bn, cluster in CLUSTER_N_TILES:
        if math.ceil(m / bm) < cluster or (n is not None and math.ceil(n / bn) < 2):
            continue
        stages = min(max_stages(bm, bn, out_dtype), 6)
        out.append(GemmPlan(block_m=bm, block_n=bn, stages=stages, consumers=bm // 64, cluster=cluster, cluster_n=2,
                            group_m=max(1, min(math.ceil(m / bm), 16))))
    return out


# --- tile orders ------------------------------------------------------------------------------------

def _hilbert_d2xy(order: int, d: int) -> tuple[int, int]:
    """Point number d on the Hilbert curve filling a 2^order x 2^order square."""
    x = y = 0
    s = 1
    t = d
    while s < (1 << order):
        rx = 1 & (t // 2)
        ry = 1 & (t ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x += s * rx
        y += s * ry
        t //= 4
        s *= 2
    return x, y


def hilbert_order(m_tiles: int, n_tiles: int) -> list[tuple[int, int]]:
    """All (m_tile, n_tile) of the grid in Hilbert-curve order (the curve of the enclosing power-of-two
    square, with the points outside the grid skipped)."""
    side = max(m_tiles, n_tiles, 1)
    order = max(0, (side - 1).bit_length())
    out = []
    for d in range(1 << (2 * order)):
        x, y = _hilbert_d2xy(order, d)
        if x < m_tiles and y < n_tiles:
            out.append((x, y))
    return out


def grouped_order(m_tiles: int, n_tiles: int, group_m: int) -> list[tuple[int, int]]:
    """Host mirror of the kernel's grouped order (for tests and tools)."""
    out = []
    per_group = group_m * n_tiles
    for t in range(m_tiles * n_tiles):
        g = t // per_group
        first = g * group_m
        rows = min(m_tiles - first, group_m)
        r = t - g * per_group
        out.append((first + r % rows, r // rows))
    return out


def tile_order(plan: GemmPlan, m: int, n: int) -> list[tuple[int, int]]:
    """The (m_tile, n_tile) sequence the kernel walks (work item order; the CTAs of a cluster take the
    consecutive tile rows and columns of one item, M rank fastest), rank offset applied."""
    mt, nt = plan.tiles(m, n)
    slots, cols = -(-mt // plan.cluster), -(-nt // plan.cluster_n)
    group = max(1, plan.group_m // plan.cluster)
    base = hilbert_order(slots, cols) if plan.order == "hilbert" else grouped_order(slots, cols, group)
    off = plan.m_tile_offset % mt
    return [((row * plan.cluster + r + off) % mt, col * plan.cluster_n + c) for row, col in base
            for c in range(plan.cluster_n) for r in range(plan.cluster)
            if row * plan.cluster + r < mt and col * plan.cluster_n + c < nt]


def replace(plan: GemmPlan, **changes) -> GemmPlan:
    return dataclasses.replace(plan, **changes)


# --- fp8 ---------------------------------------------------------------------------------------------

# Ping-pong tiles of the fitted widths for fp8 (B is always [N, K]): cuBLASLt's fp8 kernel on short-K shapes runs
# 128 x 176 ping-pong tiles (`gemm-pingpong-study-*`). Shared staging: per-consumer staging leaves 3 stages.
FP8_PINGPONG_FIT_TILES = (144, 160, 176)
# The fp8 heuristic's ping-pong plans (per-tensor or no scales): tile width -> relative rate, fitted on interleaved
# timings of the heuristic's cooperative plan and every ping-pong width over the suite (docs/tuning.md).
FP8_PINGPONG_RATE = {128: 1.0, 144: 1.031, 160: 1.0, 176: 1.010, 192: 1.0}


def fp8_plans(m: int, scale: str = "tensor", out_dtype: str = "bfloat16") -> list[GemmPlan]:
    """The fp8 plans: every tile shape of :func:`plain_plans` with the fp8 K block (128), then (not with block
    scales) the ping-pong plans of :func:`pingpong_plans`. Block scales keep a second set of accumulators per K block
    (the promotion), so their tiles are at most 192 wide (FP8_BLOCK_SCALE_WIDTHS)."""
    if scale not in SCALE_MODES:
        raise ValueError(f"unknown scale mode {scale!r} (expected one of {SCALE_MODES})")
    out = []
    for plan in plain_plans(m, out_dtype):
        if scale == "block" and plan.block_n not in FP8_BLOCK_SCALE_WIDTHS:
            continue
        out.append(dataclasses.replace(plan, block_k=FP8_BLOCK_K))
    if scale != "block":
        out += pingpong_plans(m, out_dtype, block_k=FP8_BLOCK_K)
        fitted = [(bn, "shared") for bn in FP8_PINGPONG_FIT_TILES]
        out += pingpong_plans(m, out_dtype, block_k=FP8_BLOCK_K, tiles=fitted, pairs=False)
    return out


@functools.lru_cache(maxsize=1024)
def fp8_heuristic_plan(m: int, n: int, k: int, *, scale: str = "tensor", out_dtype: str = "bfloat16",
                       num_sms: int = H100_H200_SMS) -> GemmPlan:
    """The plan of an fp8 GEMM without measuring. Per-tensor or no scales, M > 64, N >= 128, a wave of 128 x 128
    tiles or more and B's rows on whole sectors: the ping-pong plan (cluster 1, shared staging) of least
    waves x width / FP8_PINGPONG_RATE.
    Otherwise: least :func:`tile_cost` among the cooperative :func:`fp8_plans` (no split-K); K counts in 128-byte
    rows, like the 16-bit model's (an fp8 K block is as long as a 16-bit one)."""
    if out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"unsupported fp8 output dtype {out_dtype!r} (expected one of {FP8_OUT_DTYPES})")
    best = None
    if scale != "block" and m > 64 and n >= 128 and math.ceil(m / 128) * math.ceil(n / 128) >= num_sms \
            and not misaligned_b_rows(n, k, True, itemsize=1):
        # two 64-row blocks, a 128-wide tile column, a wave of tiles or more, B's rows on whole sectors (else the
        # cooperative plans' clusters or narrow tiles win): ping-pong tiles without a cluster, the width whose whole
        # waves of tiles cost least at FP8_PINGPONG_RATE
        for plan in fp8_plans(m, scale, out_dtype):
            if not (plan.pingpong and plan.cluster == 1 and plan.c_staging == "shared"):
                continue
            waves = math.ceil(math.ceil(m / plan.block_m) * math.ceil(n / plan.block_n) / num_sms)
            cost = waves * plan.block_n / FP8_PINGPONG_RATE.get(plan.block_n, 1.0)
            if best is None or cost < best[0] * 0.999:
                best = (cost, plan)
        if best is not None:
            return best[1].validate(out_dtype)
    for plan in fp8_plans(m, scale, out_dtype):
        if plan.pingpong:   # not in the cost model (PINGPONG_TILES): the autotuner's
            continue
        # block scales, tiles over two scale blocks: 128 rows only (64-row ones, one consumer whose promotion runs
        # beside no other consumer's MMAs, won no shape of the tuned block-scaled suite: docs/tuning.md)
        if scale == "block" and plan.block_n > FP8_SCALE_BLOCK and plan.block_m < 128:
            continue
        cost = tile_cost(m, n, k // 2, plan.block_m, plan.block_n, plan.cluster, num_sms)
        if best is None or cost < best[0] * 0.999:
            best = (cost, plan)
    return best[1].validate(out_dtype)
