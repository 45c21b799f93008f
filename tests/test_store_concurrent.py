"""Several real processes write disjoint blocks of one store at once; one process commits."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from storage import BlockInfo, Store
from tests.conftest import REPO
from tests.helpers.store_concurrent import rank_blocks
from tests.helpers.store_data import block_digest

RANKS = 3
SH_DEGREE = 2


def run_round(root: Path, tmp: Path, round_: int) -> tuple[dict[str, BlockInfo], list[str]]:
    go = tmp / f"go-{round_}"
    outs = [tmp / f"out-{round_}-{r}.json" for r in range(RANKS)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.store_concurrent", str(root), str(r), str(round_), str(go), str(outs[r])],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(RANKS)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()  # type: ignore[union-attr]
    go.touch()  # every writer is up: they now write at the same time
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    updated, removed = {}, []
    for out in outs:
        doc = json.loads(out.read_text())
        updated |= {e["key"]: BlockInfo.from_json(e) for e in doc["updated"]}
        removed += doc["removed"]
    return updated, removed


def expected_table(rounds: int) -> dict[str, tuple[int, str]]:
    """key -> (version, digest) after `rounds` rounds, computed without the store."""
    table: dict[str, tuple[int, str]] = {}
    for round_ in range(rounds):
        for rank in range(RANKS):
            written, removed = rank_blocks(rank, round_, SH_DEGREE)
            table |= {k: (round_, block_digest(a, SH_DEGREE)) for k, a in written.items()}
            for k in removed:
                del table[k]
    return table


def test_concurrent_writers_then_one_commit(tmp_path: Path) -> None:
    root = tmp_path / "s.zarr"
    Store.create(root, {"sh_degree": SH_DEGREE})
    committer = Store.open(root)  # rank 0: the only process that collects garbage and commits
    for round_ in range(2):
        updated, removed = run_round(root, tmp_path, round_)
        assert committer.commit(updated, removed, state={"round": round_}) == round_
        expected = expected_table(round_ + 1)
        store = Store.open(root, mode="r", verify="data")
        assert {k: i.version for k, i in store.table.items()} == {k: v for k, (v, _) in expected.items()}
        for key, (_, digest) in expected.items():
            assert block_digest(store.read_block(key), SH_DEGREE) == digest, key
    # Both rounds' commits are kept; the removed blocks' round-0 versions stay for commit 0.
    on_disk = {(k.name, int(v.name)) for k in (root / "blocks").iterdir() if k.is_dir() for v in k.iterdir() if v.is_dir()}
    round0 = {(k, 0) for k in expected_table(1)}
    round1 = {(k, v) for k, (v, _) in expected_table(2).items()}
    assert on_disk == round0 | round1
