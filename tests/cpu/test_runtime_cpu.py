"""World, symmetric-memory and error plumbing that needs no GPU: what a CPU-only node must report."""
import numpy as np
import pytest

import fluxrt
from fluxrt import errors, streams, symmetric
from fluxrt.dtypes import normalize_dtype, short_name


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the no-GPU error path cannot be reached")
def test_init_without_gpu_raises_device_error_before_nvshmem():
    with pytest.raises(fluxrt.DeviceError, match="rank 0: no CUDA GPU"):
        fluxrt.init()
    with pytest.raises(fluxrt.NvshmemInitError, match="no active fluxrt world"):
        fluxrt.current()


def test_init_rejects_non_communicators():
    with pytest.raises(TypeError, match="mpi4py communicator"):
        fluxrt.init(comm="COMM_WORLD")


def test_world_options_defaults_and_env(monkeypatch):
    monkeypatch.setenv("FLUXRT_TIMEOUT_S", "2.5")
    opts = fluxrt.WorldOptions()
    assert opts.timeout_s == 2.5 and opts.check_collective_args and opts.heap_size is None


@pytest.mark.parametrize("text, expected", [("1073741824", 1 << 30), ("512M", 512 << 20), ("4G", 4 << 30),
                                            ("2GiB", 2 << 30), ("64k", 64 << 10), (123, 123)])
def test_heap_sizes_parse_like_nvshmem(text, expected):
    assert symmetric.parse_bytes(text) == expected


def test_bad_heap_size_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot read"):
        symmetric.parse_bytes("lots")


def test_heap_capacity_follows_nvshmem_env(monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    assert symmetric.heap_capacity() == symmetric.DEFAULT_HEAP_BYTES
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "3G")
    assert symmetric.heap_capacity() == 3 << 30


def test_dtypes_bf16_is_ml_dtypes_and_names_normalize():
    import ml_dtypes

    assert fluxrt.bfloat16 == np.dtype(ml_dtypes.bfloat16)
    assert normalize_dtype("bf16") == normalize_dtype("bfloat16") == fluxrt.bfloat16
    assert normalize_dtype("half") == np.float16 and normalize_dtype(np.int32) == np.int32
    assert short_name("bfloat16") == "bf16" and short_name(np.float32) == "fp32"
    with pytest.raises(TypeError, match="unsupported dtype"):
        normalize_dtype("float7")


def test_error_record_decodes_to_wait_timeout_naming_op_rank_peer():
    op = errors.op_id("allgather.wait_chunk")
    assert errors.op_id("allgather.wait_chunk") == op  # stable
    words = np.array([errors.STATUS_TIMEOUT, op, 3, 1, 42, 41], dtype=np.uint64)
    err = errors.decode_error_record(words)
    assert isinstance(err, fluxrt.WaitTimeoutError) and isinstance(err, TimeoutError)
    assert (err.op, err.rank, err.peer, err.expected, err.observed) == ("allgather.wait_chunk", 3, 1, 42, 41)
    assert "rank 3" in str(err) and "peer 1" in str(err) and "allgather.wait_chunk" in str(err)
    words[3] = errors.NO_PEER
    assert errors.decode_error_record(words).peer is None
    words[0] = errors.STATUS_WRITING
    assert errors.decode_error_record(words) is None
    assert errors.decode_error_record(np.zeros(errors.ERROR_RECORD_WORDS, np.uint64)) is None


def test_error_record_layout_matches_the_device_header():
    from fluxrt.toolchain import include_dir

    header = (include_dir() / "fluxrt" / "sync.cuh").read_text()
    struct = header[header.index("struct ErrorRecord"):header.index("};", header.index("struct ErrorRecord"))]
    assert struct.count("u64 ") == errors.ERROR_RECORD_WORDS


def test_stream_handles_from_every_accepted_kind():
    class Proto:
        def __cuda_stream__(self):
            return (0, 0x1234)

    assert streams.stream_handle(77) == 77
    assert streams.stream_handle(Proto()) == 0x1234
    with pytest.raises(TypeError, match="cannot use str as a CUDA stream"):
        streams.stream_handle("stream")
