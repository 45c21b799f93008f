"""A commit is atomic under SIGKILL: a writer is killed at random moments, again and again, and the
store always opens at its last commit with every block whole and matching the digests in that
commit's state, and a writable open leaves exactly what the kept commits name.

A third of the kills fall at a random moment after the writer is ready (mostly while it writes
blocks), a third just after it announces a commit (so commits are hit), and a third a little after
a commit completed (so the store makes progress between kills and the checks are not vacuous)."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import zarr

from storage import Store
from tests.conftest import REPO
from tests.helpers.store_data import block_digest

KILLS = 21


def check_last_commit(root: Path) -> int:
    store = Store.open(root, mode="r")  # a reader: sees the last commit, deletes nothing
    digests = store.state.get("digests", {})
    assert set(store.table) == set(digests)
    for key in store.table:
        assert block_digest(store.read_block(key), store.sh_degree) == digests[key], key  # decodes every chunk
    return -1 if store.head is None else store.head


def check_collected(root: Path) -> None:
    head = Store.open(root).head  # a writer: removes what no kept commit names
    kept = [] if head is None else list(range(max(0, head - 1), head + 1))
    plain = zarr.open_group(root, mode="r")
    named = {(e["key"], e["version"]) for g in kept for e in plain[f"commits/{g}"].attrs["blocks"]}
    on_disk = {(k.name, int(v.name)) for k in (root / "blocks").iterdir() if k.is_dir() for v in k.iterdir() if v.is_dir()}
    assert on_disk == named
    assert sorted(int(p.name) for p in (root / "commits").iterdir() if p.is_dir()) == kept
    assert not list(root.rglob("*.partial"))


def test_commits_survive_sigkill_at_random_moments(tmp_path: Path) -> None:
    root = tmp_path / "s.zarr"
    Store.create(root, {"sh_degree": 1})
    rng = random.Random(0)
    heads = []
    for i in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.store_writer", str(root), str(i)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = proc.stdout.readline()  # type: ignore[union-attr]
        assert ready.strip() == "ready", proc.stderr.read()  # type: ignore[union-attr]
        if i % 3:
            wanted = "committing" if i % 3 == 1 else "committed"
            while not proc.stdout.readline().startswith(wanted):  # type: ignore[union-attr]
                pass
        time.sleep(rng.uniform(0.0, (0.3, 0.03, 0.1)[i % 3]))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        heads.append(check_last_commit(root))
        check_collected(root)
    assert heads == sorted(heads)  # never goes back
    assert heads[-1] >= KILLS // 3 - 1  # every third run completed a commit before its kill
