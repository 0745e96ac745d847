"""Cross-rank argument agreement for collective calls (collectives and fused ops).

Every rank runs its own argument checks first (:func:`local`), then all ranks exchange a signature of
the call and the outcome of those checks over MPI (:func:`agree`). A rank whose checks failed thereby
makes every rank raise, instead of the others waiting in the exchange or, later, in a device wait; and
ranks that called with different arguments all raise CollectiveMismatchError before anything launches.

The exchange is bounded (:func:`exchange`): point-to-point messages on the world's own duplicate of its
communicator, polled until the world's timeout (``WorldOptions.timeout_s``, FLUXRT_TIMEOUT_S). A rank
that never makes the call -- crashed, stuck, or took another branch -- makes the others raise
AgreementTimeoutError naming it, instead of waiting in an MPI collective forever. After a timeout the
ranks are out of step: that world's next exchanges raise at once, and the job should end (an exception
leaving ``with fluxrt.init()`` aborts it).
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from .errors import AgreementTimeoutError, CollectiveArgumentError, CollectiveMismatchError, FluxrtError

if TYPE_CHECKING:
    from .world import World


TAG = 0x7F1A          # the exchange's messages (on the world's agree_comm when it has one)
SPIN_S = 0.002        # busy-poll this long, then poll every POLL_S (ranks may share few cores)
POLL_S = 0.0005
_orphans: list = []   # sends left pending by a timed-out exchange (their buffers must outlive them)


_KEY = "fluxrt.agreement"
_doubles: dict = {}   # the state of worlds without a registry (test doubles), by id


class _State:
    """A world's count of exchanges, and why it is out of step (after a timeout)."""

    def __init__(self):
        self.seq, self.broken = 0, None


def _state(world) -> _State:
    registry = getattr(world, "registry", None)
    if registry is None:
        return _doubles.setdefault(id(world), _State())
    return registry.get_or_create(_KEY, _State)


def _comm(world):
    return getattr(world, "agree_comm", None) or world.comm


def exchange(world: World, name: str, payload, *, timeout_s: float | None = None) -> list:
    """Every rank's `payload`, by rank, like ``comm.allgather`` but bounded by the world's timeout: raises
    AgreementTimeoutError naming the ranks that did not arrive, and CollectiveMismatchError when a rank is
    at another call (a different count of exchanges or op name). A communicator without matched probes
    (a test double) is asked for its ``allgather``."""
    st = _state(world)
    if st.broken:
        raise FluxrtError(f"{name}: {st.broken}")
    comm = _comm(world)
    if not hasattr(comm, "improbe"):
        return comm.allgather(payload)
    from mpi4py import MPI

    me, size = comm.Get_rank(), comm.Get_size()
    st.seq = seq = st.seq + 1
    timeout = float(world.options.timeout_s) if timeout_s is None else float(timeout_s)
    msg = (seq, name, payload)
    # pickled once for every peer (mpi4py's own pickler, so a matched message's recv() unpickles it)
    buf = MPI.pickle.dumps(msg)
    sends = [comm.Isend([buf, MPI.BYTE], dest=r, tag=TAG) for r in range(size) if r != me]
    got = {me: msg}
    pending = [r for r in range(size) if r != me]
    start = time.monotonic()
    deadline = start + timeout
    while True:
        still = []
        for r in pending:
            arrived = comm.improbe(source=r, tag=TAG)   # matched once: the message is then received as is
            if arrived is not None:
                got[r] = arrived.recv()
            else:
                still.append(r)
        pending = still
        sent = MPI.Request.Testall(sends)
        if not pending and sent:
            break
        now = time.monotonic()
        if now > deadline:
            _orphans.append((buf, sends))
            peers = [r for r in range(size) if r != me]
            missing = pending or [r for r, req in zip(peers, sends) if not req.Test()] or peers
            st.broken = (f"an earlier call ({name}, #{seq}) timed out waiting for rank(s) {missing}; "
                                   "this world's ranks are out of step")
            raise AgreementTimeoutError(name, getattr(world, "rank", me), missing, timeout)
        if now - start > SPIN_S:
            time.sleep(POLL_S)
    behind = [(r, s, n) for r, (s, n, _) in sorted(got.items()) if (s, n) != (seq, name)]
    if behind:
        detail = "; ".join(f"rank {r} at #{s} ({n})" for r, s, n in behind)
        raise CollectiveMismatchError(f"{name}: ranks are out of step: this rank (rank {me}) is at call #{seq} "
                                      f"({name}), {detail}; every rank must make the same collective calls in "
                                      "the same order")
    return [got[r][2] for r in range(size)]


def barrier(world: World, name: str) -> None:
    """A host barrier over the world bounded by its timeout (``exchange`` of nothing): raises
    AgreementTimeoutError naming the ranks that never arrived instead of blocking in MPI."""
    exchange(world, name, None)


def load_wait_s(world: World) -> float:
    """How long :func:`meet_after_load` waits: FLUXRT_LOAD_WAIT_S (default 300 s), at least the world's timeout."""
    options = getattr(world, "options", None)
    return max(float(getattr(options, "timeout_s", 0.0)), float(os.environ.get("FLUXRT_LOAD_WAIT_S", "300")))


def meet_after_load(world: World, name: str) -> None:
    """Every rank, at the first call that launches kernels it loaded (and perhaps compiled) during that call:
    meet on the host before launching. A rank that compiled on a cold cache can be behind its peers by more
    than the device waits' bound; a peer's kernel launched meanwhile would wait on it and time out. Bounded by
    :func:`load_wait_s` (AgreementTimeoutError naming the ranks that never arrived)."""
    if getattr(world, "size", 1) > 1:
        exchange(world, name, None, timeout_s=load_wait_s(world))


def _signature_text(sig: tuple) -> str:
    return " ".join(f"{k}={v}" for k, v in sig)


def local(fn):
    """Run local validation; return (result, None) or (None, the error) so that every rank reaches agree."""
    try:
        return fn(), None
    except (CollectiveArgumentError, TypeError, ValueError) as e:
        return None, e if isinstance(e, FluxrtError) else CollectiveArgumentError(str(e))


def _tagged(error: Exception, name: str, rank) -> Exception:
    """The error with the op and this rank in front of its message (once)."""
    text = str(error)
    if rank is None or text.startswith(f"{name} on rank"):
        return error
    tagged = type(error)(f"{name} on rank {rank}: {text.removeprefix(name + ': ')}")
    tagged.__cause__ = error
    return tagged


def agree(world: World, name: str, sig: tuple, error: Exception | None, extra=None, *,
          rejected=CollectiveArgumentError, by_rank: bool = False, timeout_s: float | None = None) -> list:
    """Compare the call across ranks (when the world checks collective arguments) and make every rank
    raise the same way on a local error or a mismatch. Returns every rank's `extra` (gathered only when
    extra is not None or checks are on).

    rejected: the error type raised on the ranks whose own checks passed while another rank's failed.
    by_rank: list a mismatch rank by rank (else ranks with the same signature are grouped).
    timeout_s: the exchange's bound (default the world's timeout; :func:`load_wait_s` where a peer's checks
    may load and compile kernels)."""
    rank = getattr(world, "rank", None)
    if error is not None:
        error = _tagged(error, name, rank)
    if not world.options.check_collective_args and extra is None or world.size == 1:
        if error is not None:
            raise error
        return [extra]
    local_text = None if error is None else f"{type(error).__name__}: {error}"
    every = exchange(world, name, (sig, local_text, extra), timeout_s=timeout_s)
    failed = [(r, e) for r, (_, e, _) in enumerate(every) if e]
    if failed:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise rejected(f"{name}: other ranks rejected the call ({detail})")
    if world.options.check_collective_args and any(s != sig for s, _, _ in every):
        if by_rank:
            detail = "; ".join(f"rank {r}: {_signature_text(s)}" for r, (s, _, _) in enumerate(every))
        else:
            groups: dict = {}
            for r, (s, _, _) in enumerate(every):
                groups.setdefault(s, []).append(r)
            detail = "; ".join(f"ranks {rs}: {_signature_text(s)}" for s, rs in groups.items())
        raise CollectiveMismatchError(f"{name}: ranks called with different arguments ({detail}); every rank "
                                      "must call with the same counts, shapes, dtype, op and root, in the same "
                                      "order")
    return [e for _, _, e in every]
