"""Signal pads: symmetric uint64 flags that are never reset.

Each use of a pad takes a new epoch (``pad.next_epoch()``); signallers write the epoch (or add to it),
waiters wait until the flag reaches it. Because the epoch only grows, no memset separates two calls and
a late signal from an old call can never satisfy a newer wait.
"""
from __future__ import annotations

import numpy as np


class SignalPad:
    """`slots` flags on every rank. ``flags`` is the symmetric uint64 array; slot i of rank r is
    ``flags.peer(r)[i]``."""

    def __init__(self, world, slots: int):
        if int(slots) < 1:
            raise ValueError(f"a signal pad needs at least one slot, got {slots}")
        self.world = world
        self.slots = int(slots)
        self.flags = world.zeros((self.slots,), np.uint64)
        self.epoch = 0

    def next_epoch(self, step: int = 1) -> int:
        """Advance and return the epoch every rank uses for its next call on this pad. Ranks must
        advance in lockstep (same number of calls)."""
        self.epoch += step
        return self.epoch

    def local_ptr(self, slot: int) -> int:
        self._check(slot)
        return self.flags.data.ptr + 8 * slot

    def peer_ptr(self, peer: int, slot: int) -> int:
        self._check(slot)
        ptr = self.flags.peer_ptr(peer)
        if ptr == 0:
            raise ValueError(f"rank {peer} is not reachable through NVLink pointers from rank {self.world.rank}")
        return ptr + 8 * slot

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"signal slot {slot} outside pad of {self.slots} slots")

    def signal(self, peer: int, slot: int, value: int, *, add: bool = False, stream=None) -> None:
        """Stream-ordered: after prior work on `stream`, set (or add to) slot `slot` of `peer`'s pad."""
        from . import p2p

        p2p.signal(self.world, self.peer_ptr(peer, slot), value, add=add, stream=stream)

    def wait(self, slot: int, value: int, *, peer: int | None = None, op: str = "signal_pad.wait",
             stream=None) -> None:
        """Stream-ordered bounded wait until this rank's slot reaches `value`. `peer` names who is
        expected to signal, for the timeout message."""
        from . import p2p

        p2p.wait(self.world, self.local_ptr(slot), value, peer=peer, op=op, stream=stream)

    def free(self) -> None:
        self.world.free(self.flags)
