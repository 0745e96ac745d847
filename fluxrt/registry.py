"""Per-world state of the layers above the world, kept on the world without the world knowing them.

A layer (signals, p2p, collectives, fused ops) asks ``world.registry.get_or_create(key, factory,
teardown)`` for its state: the factory runs once per world, and the teardown, if given, runs when the
world is finalized, in reverse order of creation (later state may use earlier state, never the other
way round). The world itself imports none of those layers.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from .errors import FluxrtError

log = logging.getLogger(__name__)


class RegistryClosedError(FluxrtError):
    """New state was asked of a world that has been finalized."""


class Registry:
    """Keyed state of one world, with teardown hooks run once, newest first, by :meth:`close`."""

    def __init__(self) -> None:
        self._values: dict[Any, Any] = {}          # insertion order = creation order
        self._teardowns: dict[Any, Callable[[Any], None]] = {}
        self._closed = False

    def get(self, key, default=None):
        return self._values.get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def get_or_create(self, key, factory: Callable[[], Any], teardown: Callable[[Any], None] | None = None):
        """The state under `key`, made by ``factory()`` on first use; ``teardown(state)`` runs at close."""
        if key in self._values:
            return self._values[key]
        if self._closed:
            raise RegistryClosedError(f"{key}: this world has been finalized; call fluxrt.init() again")
        value = factory()
        if key in self._values:   # the factory registered it itself (a constructor that publishes itself)
            return self._values[key]
        self.put(key, value, teardown)
        return value

    def put(self, key, value, teardown: Callable[[Any], None] | None = None) -> None:
        """Register `value` under a key that is not taken yet."""
        if self._closed:
            raise RegistryClosedError(f"{key}: this world has been finalized; call fluxrt.init() again")
        if key in self._values:
            raise KeyError(f"world state {key!r} exists already")
        self._values[key] = value
        if teardown is not None:
            self._teardowns[key] = teardown

    def pop(self, key, default=None):
        """Forget the state under `key` without tearing it down (its owner released it)."""
        self._teardowns.pop(key, None)
        return self._values.pop(key, default)

    def close(self) -> None:
        """Tear every state down, newest first; a failing teardown is logged and the others still run."""
        self._closed = True
        while self._values:
            key, value = self._values.popitem()
            teardown = self._teardowns.pop(key, None)
            if teardown is None:
                continue
            try:
                teardown(value)
            except Exception as e:  # the world is going away regardless: release what else there is
                log.warning("teardown of world state %r failed: %s", key, e)

    @property
    def closed(self) -> bool:
        return self._closed
