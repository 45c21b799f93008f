"""Write blocks and commit, forever, until killed: the victim of the SIGKILL test.

    python -m tests.helpers.store_writer STORE SEED

Opens STORE (which collects what an earlier killed run left), prints "ready", then loops: rewrite
a few random blocks, drop one now and then, and commit with the sha256 of every block of the new
table in the commit's state. Content and choices derive from (SEED, generation), so they differ
between runs. Prints "committing G" before each commit (so a test can aim a kill at it) and
"committed G" after.
"""
from __future__ import annotations

import sys

import numpy as np

from storage import Store
from tests.helpers.store_data import block_digest, random_block

KEYS = [f"2-{i:x}" for i in range(12)]
CELL = (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)


def main(path: str, seed: int) -> None:
    store = Store.open(path)
    print("ready", flush=True)
    while True:
        generation = store.next_version
        rng = np.random.default_rng([seed, generation])
        digests = dict(store.state.get("digests", {}))
        updated = {}
        for key in map(str, rng.choice(KEYS, size=int(rng.integers(1, 4)), replace=False)):
            arrays = random_block(rng, int(rng.integers(1, 400)), store.sh_degree)
            updated[key] = store.write_block(key, arrays, CELL)
            digests[key] = block_digest(arrays, store.sh_degree)
        removed = [k for k in store.table if k not in updated][:1] if rng.random() < 0.3 else []
        for key in removed:
            del digests[key]
        print(f"committing {generation}", flush=True)
        store.commit(updated, removed, state={"digests": digests, "seed": seed})
        print(f"committed {generation}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
