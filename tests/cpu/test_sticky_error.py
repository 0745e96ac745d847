"""A device timeout is sticky (item 5 of the robustness issue): once the host has seen the error record
filled, every later fluxrt call on the world raises it until ``world.reset_error()``. Driven on a World
whose error record is plain host memory (no GPU)."""
import ctypes
import pickle

import numpy as np
import pytest

import fluxrt
from fluxrt import errors
from fluxrt.world import World


class _Op:
    """What forward_operands reads of a fused op before any argument is looked at."""

    def __init__(self, world):
        self.world = world


def _world():
    w = World.__new__(World)
    w.rank, w.size, w._finalized = 1, 2, False
    w._record = (ctypes.c_uint64 * errors.ERROR_RECORD_WORDS)()   # kept alive with the world
    w._bind_error_record(ctypes.addressof(w._record))
    return w


def _time_out(w, op="allreduce.ll", peer=0):
    words = np.ctypeslib.as_array(w._record)
    words[1:] = [errors.op_id(op), w.rank, peer, 7, 6]
    words[0] = errors.STATUS_TIMEOUT   # the device writes the status last


def test_a_recorded_timeout_raises_on_every_later_call_until_reset():
    w = _world()
    w.check_errors()                          # clear: nothing raised
    assert w.error is None
    _time_out(w)
    with pytest.raises(fluxrt.WaitTimeoutError, match=r"allreduce\.ll: rank 1 timed out waiting for peer 0"):
        w.check_errors()
    for _ in range(3):                        # sticky, also for the entries that check it
        with pytest.raises(fluxrt.WaitTimeoutError) as info:
            w.check_errors()
        assert "world.reset_error()" in "".join(getattr(info.value, "__notes__", []))
        assert len(info.traceback) == 2       # a fresh copy: tracebacks do not pile up over raises
    with pytest.raises(fluxrt.WaitTimeoutError):
        w.empty((4,))
    with pytest.raises(fluxrt.WaitTimeoutError):
        w.barrier()
    from fluxrt.ops.common import forward_operands

    with pytest.raises(fluxrt.WaitTimeoutError):
        forward_operands(_Op(w), "gemm_rs", None, None, None, None, sharded_a=False)
    from fluxrt import p2p, signals

    with pytest.raises(fluxrt.WaitTimeoutError):
        p2p.put(w, None, None, 0)
    with pytest.raises(fluxrt.WaitTimeoutError):
        signals.wait(w, 0, 1)
    assert w.error is not None and w.error.peer == 0
    w.reset_error()
    assert w.error is None and not any(np.ctypeslib.as_array(w._record))
    w.check_errors()


def test_the_record_stays_set_so_later_kernels_stop_waiting_early():
    """check_errors leaves the device words as they are: waits in kernels launched after the timeout see
    the record and end instead of waiting out their own bound (sync.cuh's SpinBound)."""
    w = _world()
    _time_out(w, op="gemm_rs.reduce", peer=1)
    with pytest.raises(fluxrt.WaitTimeoutError, match="gemm_rs.reduce"):
        w.check_errors()
    assert np.ctypeslib.as_array(w._record)[0] == errors.STATUS_TIMEOUT


def test_a_half_written_record_is_not_an_error_yet():
    w = _world()
    np.ctypeslib.as_array(w._record)[0] = errors.STATUS_WRITING
    w.check_errors()
    assert w._errors.error is None


def test_timeout_errors_copy_and_pickle_whole():
    err = errors.WaitTimeoutError("allgather.ring", 2, None, 9, 8)
    again = err.again()
    assert again is not err and type(again) is type(err) and str(again) == str(err)
    assert (again.op, again.rank, again.peer, again.expected, again.observed) == ("allgather.ring", 2, None, 9, 8)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.peer is None
    agree = errors.AgreementTimeoutError("allreduce", 0, [1, 3], 5.0)
    assert str(pickle.loads(pickle.dumps(agree))) == str(agree)


def test_a_stream_k_fixup_timeout_raises_at_the_next_launch_until_reset(monkeypatch):
    """The stream-K GEMM's process-wide record (no world): the same sticky view as a world's."""
    from fluxrt.gemm import stream_k

    record = (ctypes.c_uint64 * errors.ERROR_RECORD_WORDS)()
    monkeypatch.setattr(stream_k, "_errors", errors.ErrorRecordView(ctypes.addressof(record)))
    launched = []

    class _Gemm:
        def launch(self, stream_ptr):
            launched.append(stream_ptr)

    launch = stream_k.StreamKLaunch(_Gemm(), None)
    launch.launch(5)                           # clear: enqueued
    words = np.ctypeslib.as_array(record)
    words[1:] = [errors.op_id(stream_k.OP_NAME), 0, 3, 2, 1]
    words[0] = errors.STATUS_TIMEOUT
    for _ in range(2):                         # sticky: nothing more is enqueued
        with pytest.raises(fluxrt.WaitTimeoutError, match="stream-K"):
            launch.launch(6)
    assert launched == [5]
    stream_k.reset_errors()
    assert not any(words)
    launch.launch(7)
    assert launched == [5, 7]
