#!/usr/bin/env python3
"""Print a GEMM shape suite (fluxrt.perf.shapes): ``python perf/shapes.py --suite core``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fluxrt.perf.shapes import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
