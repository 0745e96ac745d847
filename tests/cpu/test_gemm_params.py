"""The GEMM's kernel parameter: the host layout (fluxrt/gemm/params.py) agrees with the device struct
(kernels/gemm/params.cuh) field by field, compiled for sm_90a without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from fluxrt.gemm.params import PARAMS, leaf_fields, new_params

from test_gemm_cpu import _cubin_u32, _nvrtc_available


def test_host_layout_is_c_layout():
    fields = leaf_fields()
    # tensor maps at 64-byte boundaries, every field naturally aligned, no overlaps, all inside the struct
    for name, off, size in fields:
        assert off % (64 if size == 128 else size) == 0, name
    ends = [off + size for _, off, size in fields]
    assert all(e <= o for e, (_, o, _) in zip(ends, fields[1:]))
    assert ends[-1] <= PARAMS.itemsize <= 4096 and PARAMS.itemsize % 64 == 0
    p = new_params()
    assert p.shape == (1,) and p.nbytes == PARAMS.itemsize and not p.tobytes().strip(b"\0")


def test_device_offsets_match_host_layout(tmp_path, monkeypatch):
    """A probe exports offsetof / sizeof of every leaf field of fluxrt_sm90::Params and sizeof(Params) as
    __device__ constants; they must equal the host layout's."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from fluxrt.toolchain import CompileOptions, compile_cubin

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    fields = leaf_fields()
    lines = ['#include "../gemm/params.cuh"', "using fluxrt_sm90::Params;",
             'extern "C" __device__ const unsigned int probe_size = sizeof(Params);']
    for i, (name, _, _) in enumerate(fields):
        lines.append(f'extern "C" __device__ const unsigned int probe_off_{i} = __builtin_offsetof(Params, {name});')
        lines.append(f'extern "C" __device__ const unsigned int probe_len_{i} = sizeof(((Params*)0)->{name});')
    src = tmp_path / "gemm_params_probe.cu"
    src.write_text("\n".join(lines) + "\n")
    try:
        data = compile_cubin(src, CompileOptions(arch="sm_90a")).read_bytes()
    except Exception as e:   # NVRTC 13.0 has no __builtin_offsetof; the size check below still runs elsewhere
        if "__builtin_offsetof" in str(e) and "undefined" in str(e):
            pytest.skip("this NVRTC has no __builtin_offsetof (13.0); every compiled configuration still checks "
                        "sizeof(Params) against the host (fluxrt_gemm_params_bytes)")
        raise
    assert _cubin_u32(data, "probe_size") == PARAMS.itemsize
    device = [(name, _cubin_u32(data, f"probe_off_{i}"), _cubin_u32(data, f"probe_len_{i}"))
              for i, (name, _, _) in enumerate(fields)]
    assert device == fields


def test_params_fields_take_their_values():
    p = new_params()
    p["gemm"]["m"], p["reduce"]["chunk"], p["epilogue"]["signal_value"] = 8192, -1, 1 << 40
    raw = p.tobytes()
    off = dict((n, o) for n, o, _ in leaf_fields())
    assert np.frombuffer(raw, "<i4", 1, off["gemm.m"])[0] == 8192
    assert np.frombuffer(raw, "<i4", 1, off["reduce.chunk"])[0] == -1
    assert np.frombuffer(raw, "<u8", 1, off["epilogue.signal_value"])[0] == 1 << 40


def test_scale_args_keep_the_layout():
    """The grouped fp8 GEMM's b_group_stride lies in ScaleArgs' former tail padding: Params keeps its size and
    every other field its offset (the compiled 16-bit and dense fp8 kernels read the same bytes)."""
    off = dict((n, o) for n, o, _ in leaf_fields())
    assert off["scale.b_group_stride"] == off["scale.k_blocks"] + 4
    assert off["group.offsets"] == off["scale.a"] + 24 and off["group.offsets"] == 824
    p = new_params()
    p["scale"]["k_blocks"], p["scale"]["b_group_stride"] = 56, 16 * 56
    raw = p.tobytes()
    assert np.frombuffer(raw, "<i4", 2, off["scale.k_blocks"]).tolist() == [56, 896]


def test_stream_k_args_keep_the_layout():
    """StreamKArgs is appended to Params: every other field keeps its offset (GroupArgs ends at 896); it ends at 928,
    and FitArgs' tensor map follows at 960 (64-byte aligned): Params is 1088 bytes."""
    off = dict((n, o) for n, o, _ in leaf_fields())
    assert off["stream_k.counters"] == 896 and off["group.scatter_entries"] == 888
    assert off["stream_k.op_id"] == off["stream_k.dp_tiles"] + 4
    assert off["fit.tmap_c_tiles"] == 960 and PARAMS.itemsize == 1088
    assert off["stream_k.piece_blocks"] == off["stream_k.pieces"] + 4 == 924
    p = new_params()
    p["stream_k"]["dp_tiles"], p["stream_k"]["op_id"] = 264, 7
    raw = p.tobytes()
    assert np.frombuffer(raw, "<i4", 2, off["stream_k.dp_tiles"]).tolist() == [264, 7]
