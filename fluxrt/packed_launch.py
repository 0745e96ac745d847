"""Kernel launches whose arguments are packed once and enqueued with one driver call.

CuPy's ``RawKernel.__call__`` converts every argument on every launch, which for a dozen scalars costs
several microseconds of host time: most of the host cost of a small collective. A launch whose arguments
do not change between calls (a cached collective call on the same arrays) is packed here once into a
``cuLaunchKernel`` parameter array; enqueuing it is then one ``cuLaunchKernel`` through CuPy's driver
binding.

With ``pdl=True`` the launch carries the programmatic-stream-serialization attribute (programmatic
dependent launch, ``cuLaunchKernelEx`` through cuda-python): the grid may be scheduled before the kernel
ahead of it on the stream has finished, and the kernel itself must wait (``griddepcontrol.wait``) before
it touches memory that kernel may write. Only kernels written for it may be launched so.

Arguments are numpy scalars (``np.uint64(ptr)``, ``np.uint32(n)``, ...) or numpy arrays passed by value
(a size-1 structured array for a struct), exactly what the kernel's parameter list declares; anything
else is refused, because a Python int has no declared width.
"""
from __future__ import annotations

import ctypes

import numpy as np


def _arg_buffer(a, index: int) -> np.ndarray:
    if isinstance(a, np.generic):
        return np.array(a)  # 0-d array: owns the scalar's bytes
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).copy()
    raise TypeError(f"kernel argument {index}: expected a numpy scalar or a numpy array passed by value, got "
                    f"{type(a).__name__} (give scalars their declared width, e.g. np.uint64)")


class PackedLaunch:
    """One launch of `kernel` (a ``cupy.RawKernel``) with `grid` x `block` threads (1-D) and `args` packed.
    ``launch(stream_ptr)`` enqueues it on a raw stream handle."""

    __slots__ = ("kernel", "grid", "block", "shared_mem", "args", "pdl", "_buffers", "_params", "_params_ptr",
                 "_func", "_driver_launch", "_config")

    def __init__(self, kernel, grid: int, block: int, args: tuple, shared_mem: int = 0, pdl: bool = False):
        self.kernel, self.grid, self.block, self.shared_mem = kernel, int(grid), int(block), int(shared_mem)
        self.pdl = bool(pdl)
        self.args = tuple(args)
        self._buffers = [_arg_buffer(a, i) for i, a in enumerate(self.args)]
        self._params = (ctypes.c_void_p * max(1, len(self._buffers)))(*[b.ctypes.data for b in self._buffers])
        self._params_ptr = ctypes.addressof(self._params)
        self._func = self._driver_launch = None  # resolved on the first launch (loading needs a GPU)
        self._config = self._launch_config() if self.pdl else None

    def _launch_config(self):
        """The ``CUlaunchConfig`` of a PDL launch, all but its stream."""
        from cuda.bindings import driver

        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block, 1, 1
        config.sharedMemBytes = self.shared_mem
        config.attrs, config.numAttrs = [attr], 1
        return config

    def packed_bytes(self) -> bytes:
        """The argument bytes in order (each at its own address; for tests and logs)."""
        return b"".join(b.tobytes() for b in self._buffers)

    def launch(self, stream_ptr: int) -> None:
        if self._func is None:
            self._resolve()
        if self.pdl:
            self._driver_launch(stream_ptr)
        else:
            self._driver_launch(self._func, self.grid, 1, 1, self.block, 1, 1, self.shared_mem, stream_ptr,
                                self._params_ptr, 0)

    def _resolve(self) -> None:
        if not self.pdl:
            from cupy.cuda import driver

            self._func, self._driver_launch = self.kernel.kernel.ptr, driver.launchKernel
            return
        from cuda.bindings import driver

        func, config, params = driver.CUfunction(self.kernel.kernel.ptr), self._config, self._params_ptr
        launch_ex, stream, ok = driver.cuLaunchKernelEx, driver.CUstream, driver.CUresult.CUDA_SUCCESS
        what = f"{getattr(self.kernel, 'name', 'kernel')} ({self.grid} x {self.block} threads)"

        def enqueue(stream_ptr: int) -> None:
            config.hStream = stream(stream_ptr)
            (err,) = launch_ex(config, func, params, 0)
            if err != ok:
                raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch) of {what} failed: {err!r}")

        self._func, self._driver_launch = func, enqueue


__all__ = ["PackedLaunch"]
