"""One of several writer processes sharing a store, as an MPI rank would between two commits.

    python -m tests.helpers.store_concurrent STORE RANK ROUND GO OUT

Opens STORE without collecting garbage (other writers are active), prints "ready", waits until
the file GO exists so that all writers write at the same time, writes its own blocks
(`rank_blocks`) for ROUND, and leaves the table entries and removals for the committing process
in OUT (JSON, renamed into place).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from storage import Store
from tests.helpers.store_data import random_block

BLOCKS_PER_RANK = 3
CELL = (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)


def rank_blocks(rank: int, round_: int, sh_degree: int) -> tuple[dict[str, dict[str, np.ndarray]], list[str]]:
    """What a rank writes and removes in a round: round 0 creates its blocks, later rounds
    rewrite the first and remove the last."""
    keys = [f"3-{rank * 8 + i:x}" for i in range(BLOCKS_PER_RANK)]
    chosen = keys if round_ == 0 else keys[:1]
    written = {}
    for key in chosen:
        rng = np.random.default_rng([rank, round_, int(key.split("-")[1], 16)])
        written[key] = random_block(rng, int(rng.integers(100, 1000)), sh_degree)
    return written, ([] if round_ == 0 else keys[-1:])


def main(path: str, rank: int, round_: int, go: Path, out: Path) -> None:
    store = Store.open(path, gc=False, verify="table")
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    written, removed = rank_blocks(rank, round_, store.sh_degree)
    infos = [store.write_block(key, arrays, CELL).to_json() for key, arrays in written.items()]
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"updated": infos, "removed": removed}))
    os.replace(tmp, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
