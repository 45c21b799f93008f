"""`python -m tools.plan.commit --blocks 34847 --work DIR`: what a commit costs at a block count.

A real store directory whose last commit names `--blocks` blocks, each with its version folder
(empty: a commit, a refresh and GC only read the table and list the folders), then one commit of
one changed block, a reader's `refresh` (what every rank does after every commit), a
`Store.open(verify="table")` and a full GC sweep (what a writable open does), with the table
stored as a list of entries and as columns (`storage.table.COMPACT_ABOVE`).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import storage.table as table_mod
from octree.keys import BlockKey
from storage import Store
from storage.table import BlockInfo, Commit
from train.cli import HelpFormatter

_DEPTH = 7  # 8**7 cells: room for a million blocks


def synthetic_table(blocks: int, seed: int = 0) -> dict[str, BlockInfo]:
    rng = np.random.default_rng(seed)
    table = {}
    for c in np.sort(rng.choice(8**_DEPTH, blocks, replace=False)):
        key = BlockKey(_DEPTH, int(c)).name
        lo = rng.uniform(0, 1000, 3)
        box = tuple(float(v) for v in np.concatenate([lo, lo + rng.uniform(1, 50, 3)]))
        table[key] = BlockInfo(key, 0, int(rng.integers(1, 65536)), box, box, box)
    return table


def measure(root: Path, table: dict[str, BlockInfo]) -> dict[str, float]:
    shutil.rmtree(root, ignore_errors=True)
    Store.create(root, {"sh_degree": 3})
    for key in table:
        (root / "blocks" / key / "0").mkdir(parents=True)
    (root / "commits/0").mkdir()
    (root / "commits/0/zarr.json").write_text(json.dumps(Commit(0, table, {"step": 0}).to_doc()))
    doc = json.loads((root / "zarr.json").read_text())
    doc["attributes"]["head"] = 0
    (root / "zarr.json").write_text(json.dumps(doc))
    out = {}
    t = time.perf_counter()
    writer = Store.open(root, verify="table", gc=False)
    out["open"] = time.perf_counter() - t
    reader = Store.open(root, mode="r", verify="table")
    key = next(iter(table))
    t = time.perf_counter()
    g = writer.commit({key: table[key]}, state={"step": 1})
    out["commit"] = time.perf_counter() - t
    out["mb"] = (root / f"commits/{g}/zarr.json").stat().st_size / 1e6
    t = time.perf_counter()
    reader.refresh()
    out["refresh"] = time.perf_counter() - t
    assert reader.table == writer.table and reader.head == g
    t = time.perf_counter()
    writer.collect_garbage(upto=g)
    out["full_gc"] = time.perf_counter() - t
    shutil.rmtree(root)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.plan.commit", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--blocks", type=int, default=34847, help="blocks in the table (10^9 Gaussians at 65536 a block)")
    p.add_argument("--work", type=Path, required=True, help="an empty folder for the store (removed after)")
    a = p.parse_args(argv)
    if not 1 <= a.blocks <= 8**_DEPTH // 2:
        print(f"error: --blocks {a.blocks}: must be in [1, {8**_DEPTH // 2}]", file=sys.stderr)
        return 2
    if a.work.exists() and any(a.work.iterdir()):
        print(f"error: --work {a.work}: not empty", file=sys.stderr)
        return 2
    table = synthetic_table(a.blocks)
    print(f"{'encoding':10s} {'blocks':>8s} {'doc MB':>7s} {'commit s':>9s} {'refresh s':>10s} {'open s':>7s} "
          f"{'full GC s':>10s}")
    for name, above in (("list", a.blocks), ("columns", 0)):
        old = table_mod.COMPACT_ABOVE
        table_mod.COMPACT_ABOVE = above
        try:
            m = measure(a.work / "store.zarr", table)
        finally:
            table_mod.COMPACT_ABOVE = old
        print(f"{name:10s} {a.blocks:8,d} {m['mb']:7.2f} {m['commit']:9.2f} {m['refresh']:10.2f} {m['open']:7.2f} "
              f"{m['full_gc']:10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
