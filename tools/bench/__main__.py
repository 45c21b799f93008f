"""Dispatch `python -m tools.bench NAME ...` to `tools.bench.NAME.main(argv)`."""
from __future__ import annotations

import importlib
import sys

BENCHES = ("render", "store", "tile", "train", "mpi", "densify", "view", "occlusion", "opensplat", "scale", "gpu")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print(f"usage: python -m tools.bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"tools.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
