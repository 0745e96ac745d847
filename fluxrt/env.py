"""Boolean switches from the environment, read one way everywhere."""
from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False, env=None) -> bool:
    """`name` as a switch: unset or empty gives `default`; 0 / false / no / off (any case) is off; any other
    value is on."""
    value = (os.environ if env is None else env).get(name, "").strip().lower()
    if not value:
        return default
    return value not in _OFF
