"""The one array intake (fluxrt.arrays) and the entry points that use it, with fake producers: what is
checked before any CUDA call, so it runs without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from fluxrt import arrays
from fluxrt.errors import (ArrayArgumentError, ArrayTypeError, CollectiveArgumentError, GemmArgumentError,
                           GemmTypeError)

BF16 = np.dtype(ml_dtypes.bfloat16)


class CaiArray:
    """A __cuda_array_interface__ producer (as Numba's device arrays); the pointer is never dereferenced."""

    def __init__(self, shape, typestr="<f4", *, dtype=None, strides=None, ptr=1 << 32, readonly=False,
                 version=3, stream=None, mask=None):
        self.shape = tuple(shape)
        if dtype is not None:
            self.dtype = dtype
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": typestr, "data": (ptr, readonly),
                                         "strides": strides, "version": version, "mask": mask}
        if stream is not None:
            self.__cuda_array_interface__["stream"] = stream


class TorchDtype:
    """Prints like torch.bfloat16; numpy cannot interpret it."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class DlpackArray:
    """A DLPack-only producer: __dlpack__ and __dlpack_device__, shape and dtype attributes."""

    def __init__(self, shape, dtype, device=(2, 0)):
        self.shape, self.dtype, self._device = tuple(shape), dtype, device

    def __dlpack__(self, stream=None):  # pragma: no cover - importing needs a GPU
        raise AssertionError("imported on a CPU-only check")

    def __dlpack_device__(self):
        return self._device


class ArrayImpl(DlpackArray):
    """Looks like jax.Array by its module (jax is never imported)."""


ArrayImpl.__module__ = "jaxlib.xla_extension"


def test_cai_producer_is_read_without_cuda():
    x = CaiArray((4, 6), "<f2", strides=(16, 2), ptr=0x1000, stream=7)
    info = arrays.inspect(x, name="x", op="test")
    assert (info.shape, info.dtype, info.strides, info.ptr, info.device) == ((4, 6), "float16", (16, 2), 0x1000, None)
    assert (info.readonly, info.protocol, info.stream, info.size, info.ndim) == (False, "cai", 7, 24, 2)
    assert info.producer.endswith("CaiArray")
    assert arrays.inspect(CaiArray((3,)), name="x", op="t").strides is None   # C-contiguous by protocol


@pytest.mark.parametrize("dtype, typestr", [(TorchDtype("bfloat16"), "<V2"), (BF16, "<V2"), (None, "<f2"),
                                            (TorchDtype("float16"), "<f2"), (ml_dtypes.bfloat16, "<V2")])
def test_dtype_names_are_normalised(dtype, typestr):
    want = "float16" if typestr == "<f2" else "bfloat16"
    assert arrays.inspect(CaiArray((8, 8), typestr, dtype=dtype), name="A", op="t").dtype == want
    dlpack_only = arrays.inspect(DlpackArray((8,), dtype), name="A", op="t")
    assert dlpack_only.dtype == (want if dtype is not None else "unknown")


def test_read_only_buffers_are_refused_where_written():
    ro = CaiArray((16,), readonly=True)
    assert arrays.inspect(ro, name="out", op="t").readonly
    with pytest.raises(ArrayArgumentError, match="allreduce: out is written by this call, but it is marked read-only"):
        arrays.as_array(ro, name="out", op="allreduce", writable=True)
    jax = ArrayImpl((16,), BF16)
    assert arrays.inspect(jax, name="out", op="t").readonly
    with pytest.raises(ArrayArgumentError, match="immutable JAX array"):
        arrays.as_array(jax, name="out", op="t", writable=True)
    # a JAX array also exporting CAI is read-only whatever its data flag says
    jax_cai = ArrayImpl((16,), BF16)
    jax_cai.__cuda_array_interface__ = {"shape": (16,), "typestr": "<V2", "data": (64, False), "version": 2}
    assert arrays.inspect(jax_cai, name="out", op="t").readonly


def test_not_cuda_arrays_are_type_errors():
    with pytest.raises(ArrayTypeError, match="host numpy array"):
        arrays.inspect(np.zeros(3), name="x", op="t")
    with pytest.raises(ArrayTypeError, match="is None"):
        arrays.inspect(None, name="x", op="t")
    with pytest.raises(ArrayTypeError, match="list is not a CUDA array"):
        arrays.inspect([1, 2], name="x", op="t")
    with pytest.raises(ArrayTypeError, match=r"host \(CPU\) memory"):
        arrays.inspect(DlpackArray((3,), "float32", device=(1, 0)), name="x", op="t")
    with pytest.raises(GemmTypeError, match="gemm: B"):
        arrays.inspect(object(), name="B", op="gemm", error=GemmArgumentError, type_error=GemmTypeError)


def test_dlpack_only_producer_and_device_check_before_import():
    info = arrays.inspect(DlpackArray((2, 8), TorchDtype("bfloat16"), device=(2, 3)), name="x", op="t")
    assert (info.shape, info.dtype, info.device, info.ptr, info.strides, info.protocol) == \
        ((2, 8), "bfloat16", 3, -1, None, "dlpack")
    with pytest.raises(CollectiveArgumentError, match="x is on GPU 3, but this rank's world uses GPU 0"):
        arrays.as_array(DlpackArray((8,), "float32", device=(2, 3)), name="x", op="allreduce", device=0,
                        error=CollectiveArgumentError, type_error=CollectiveArgumentError)


def test_protocol_errors():
    with pytest.raises(ArrayArgumentError, match="masked"):
        arrays.inspect(CaiArray((3,), mask=object()), name="x", op="t")
    with pytest.raises(ArrayArgumentError, match="stream 0"):
        arrays.inspect(CaiArray((3,), stream=0), name="x", op="t")
    assert arrays.inspect(CaiArray((3,), stream=5, version=2), name="x", op="t").stream is None   # v2: no stream


def test_producer_refusing_cai_falls_back_to_dlpack():
    class GradTensor(DlpackArray):   # torch refuses CAI for tensors that require grad
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")

    info = arrays.inspect(GradTensor((4,), TorchDtype("float32")), name="x", op="t")
    assert (info.protocol, info.dtype, info.ptr) == ("dlpack", "float32", -1)


def test_torch_like_bf16_operands_pass_gemm_validation():
    from fluxrt.gemm import validate_gemm_args

    bf16 = TorchDtype("bfloat16")
    a, b = CaiArray((256, 128), "<V2", dtype=bf16), CaiArray((128, 64), "<V2", dtype=bf16, ptr=1 << 33)
    assert validate_gemm_args(a, b) == (256, 64, 128, "bfloat16", "bfloat16")
    # the DLPack-only form (shape and dtype known, pointer after import)
    assert validate_gemm_args(DlpackArray((256, 128), bf16), DlpackArray((128, 64), bf16))[3] == "bfloat16"
    with pytest.raises(GemmArgumentError, match="gemm: out is written by this call"):
        validate_gemm_args(a, b, CaiArray((256, 64), "<V2", dtype=bf16, ptr=1 << 34, readonly=True))


def test_entry_points_refuse_read_only_outputs_in_their_own_errors():
    from fluxrt import collectives, p2p
    from fluxrt.ops import OpsArgumentError
    from fluxrt.ops import common

    ro = CaiArray((64,), readonly=True)
    world = SimpleNamespace(device_id=0, size=2, rank=0)
    with pytest.raises(CollectiveArgumentError, match="allgather: out is written"):
        collectives._as_array(ro, "out", "allgather", world, None, writable=True)
    with pytest.raises(OpsArgumentError, match="AllGatherGemm: out is written"):
        common.as_device_array(ro, "out", "AllGatherGemm", None, writable=True)
    with pytest.raises(ArrayArgumentError, match=r"p2p.get \(rank 0, peer 1\): dst is written"):
        p2p._check_transfer(world, "get", "copy_engine", p2p.GET_MODES, 1, local=ro, remote=None, stream=None)
    with pytest.raises(ArrayTypeError, match=r"p2p.put \(rank 0, peer 1\): src is a host numpy array"):
        p2p._check_transfer(world, "put", "sm", p2p.PUT_MODES, 1, local=np.zeros(4), remote=None, stream=None)
