"""Cross-rank argument agreement for collective calls (collectives and fused ops).

Every rank runs its own argument checks first (:func:`local`), then all ranks exchange a signature of
the call and the outcome of those checks over MPI (:func:`agree`). A rank whose checks failed thereby
makes every rank raise, instead of the others waiting in the exchange or, later, in a device wait; and
ranks that called with different arguments all raise CollectiveMismatchError before anything launches.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import CollectiveArgumentError, CollectiveMismatchError, FluxrtError

if TYPE_CHECKING:
    from .world import World


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
          rejected=CollectiveArgumentError, by_rank: bool = False) -> list:
    """Compare the call across ranks (when the world checks collective arguments) and make every rank
    raise the same way on a local error or a mismatch. Returns every rank's `extra` (gathered only when
    extra is not None or checks are on).

    rejected: the error type raised on the ranks whose own checks passed while another rank's failed.
    by_rank: list a mismatch rank by rank (else ranks with the same signature are grouped)."""
    rank = getattr(world, "rank", None)
    if error is not None:
        error = _tagged(error, name, rank)
    if not world.options.check_collective_args and extra is None or world.size == 1:
        if error is not None:
            raise error
        return [extra]
    local_text = None if error is None else f"{type(error).__name__}: {error}"
    every = world.comm.allgather((sig, local_text, extra))
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
