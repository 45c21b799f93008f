"""The commit at planning scale: a table of many blocks is stored as compact columns, read back
exactly, checked like the list it replaces, and mixed freely with older list-form commits."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import zarr

import storage.table as table_mod
from octree.keys import BlockKey
from storage import Store
from storage.errors import StoreCorruptError, StoreKeyError
from storage.table import BlockInfo, Commit, decode_columns, encode_columns
from tests.helpers.store_data import random_block


def _table(n: int, seed: int = 0) -> dict[str, BlockInfo]:
    rng = np.random.default_rng(seed)
    depths = rng.integers(1, 22, n)
    out = {}
    for d in depths:
        key = BlockKey(int(d), int(rng.integers(0, 8 ** int(d)))).name
        lo = rng.normal(0, 100, 3)
        boxes = [tuple(float(v) for v in (*lo, *(lo + rng.uniform(0, 9, 3)))) for _ in range(3)]
        out[key] = BlockInfo(key, int(rng.integers(0, 50)), int(rng.integers(1, 2**31 - 1)), *boxes)
    return out


def test_columns_round_trip_bit_for_bit_in_morton_order():
    table = _table(500)
    back = decode_columns(json.loads(json.dumps(encode_columns(table))), 50, "s")
    assert back == table  # every float exactly: binary float64, not decimal text
    assert list(back) == sorted(table, key=lambda k: BlockKey(int(k.split("-")[0]), int(k.split("-")[1], 16)).morton_rank())
    assert decode_columns(encode_columns({}), 0, "s") == {}


def _damaged(table, **cols):
    doc = encode_columns(table)
    for name, fn in cols.items():
        a = np.frombuffer(base64.b64decode(doc[name]), dtype=table_mod._COLUMNS[name][0]).copy()
        fn(a)
        doc[name] = base64.b64encode(a.tobytes()).decode()
    return doc


@pytest.mark.parametrize("damage, error, words", [
    (lambda d: d.update(n=-1), StoreCorruptError, "no block count"),
    (lambda d: d.update(count="!!not base64"), StoreCorruptError, "column 'count'"),
    (lambda d: d.update(boxes=d["boxes"][:-8]), StoreCorruptError, "column 'boxes'"),
    (lambda d: d.pop("version"), StoreCorruptError, "column 'version'"),
])
def test_a_malformed_column_is_named(damage, error, words):
    doc = encode_columns(_table(20))
    damage(doc)
    with pytest.raises(error, match=words):
        decode_columns(doc, 50, "store s, commit 50")


@pytest.mark.parametrize("cols, error, words", [
    ({"depth": lambda a: a.__setitem__(3, 22)}, StoreKeyError, "outside its depth"),
    ({"code": lambda a: a.__setitem__(3, 2**63)}, StoreKeyError, "outside its depth"),
    ({"version": lambda a: a.__setitem__(3, 51)}, StoreCorruptError, "version is not in"),
    ({"count": lambda a: a.__setitem__(3, 0)}, StoreCorruptError, "count is not in"),
    ({"boxes": lambda a: a.__setitem__(3 * 18 + 7, np.nan)}, StoreCorruptError, "non-finite"),
    ({"boxes": lambda a: a.__setitem__(3 * 18 + 12, 1e9)}, StoreCorruptError, "lo > hi"),
    ({"depth": lambda a: a.__setitem__(4, a[3]), "code": lambda a: a.__setitem__(4, a[3])}, StoreCorruptError,
     "listed twice"),
])
def test_a_bad_entry_is_refused_and_named(cols, error, words):
    table = _table(20)
    with pytest.raises(error, match=words) as e:
        decode_columns(_damaged(table, **cols), 50, "store s, commit 50")
    assert "store s, commit 50, block " in str(e.value)


def test_a_store_mixes_list_and_column_commits(tmp_path: Path, monkeypatch):
    rng = np.random.default_rng(1)
    root = tmp_path / "s.zarr"
    store = Store.create(root, {"sh_degree": 0})
    keys = [BlockKey(2, c).name for c in range(6)]
    cell = (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)
    g0 = store.commit({k: store.write_block(k, random_block(rng, 5, 0), cell) for k in keys[:3]})  # a list
    monkeypatch.setattr(table_mod, "COMPACT_ABOVE", 2)
    other = Store.open(root, mode="r")
    g1 = store.commit({k: store.write_block(k, random_block(rng, 5, 0), cell) for k in keys[2:]}, state={"step": 1})
    plain = zarr.open_group(root, mode="r")
    assert "blocks" in plain[f"commits/{g0}"].attrs and plain[f"commits/{g1}"].attrs["columns"]["n"] == 6
    other.refresh()  # a reader re-reads the compact commit
    assert other.table == store.table and list(other.table) == keys and other.state == {"step": 1}
    reopened = Store.open(root)  # GC reads both kept commits, one of each form
    assert reopened.table == store.table
    for k in keys:
        assert np.array_equal(reopened.read_block(k)["means"], store.read_block(k)["means"])
    # A crash after the next commit document landed but before the root named it: the store
    # opens at g1, and a writable open removes the orphan document.
    orphan = Commit(g1 + 1, dict(store.table), {"step": 2}).to_doc()
    (root / f"commits/{g1 + 1}").mkdir()
    (root / f"commits/{g1 + 1}/zarr.json").write_text(json.dumps(orphan))
    assert Store.open(root, mode="r").head == g1
    Store.open(root)
    assert not (root / f"commits/{g1 + 1}").exists()
    monkeypatch.setattr(table_mod, "COMPACT_ABOVE", 1024)
    g2 = reopened.commit({}, removed=[keys[0]])  # back to a list below the threshold
    assert "blocks" in zarr.open_group(root, mode="r")[f"commits/{g2}"].attrs
    assert list(Store.open(root, mode="r").table) == keys[1:]


def test_after_a_commit_gc_leaves_another_writers_stray_version_to_the_next_open(tmp_path: Path):
    rng = np.random.default_rng(2)
    root = tmp_path / "s.zarr"
    committer = Store.create(root, {"sh_degree": 0})
    cell = (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)
    committer.commit({"1-0": committer.write_block("1-0", random_block(rng, 5, 0), cell)})
    other = Store.open(root, gc=False)  # another rank: writes, but its block is never committed
    other.write_block("1-1", random_block(rng, 5, 0), cell)
    committer.commit({"1-0": committer.write_block("1-0", random_block(rng, 5, 0), cell)})
    committer.commit({"1-0": committer.write_block("1-0", random_block(rng, 5, 0), cell)})
    versions = {(k.name, v.name) for k in (root / "blocks").iterdir() if k.is_dir() for v in k.iterdir() if v.is_dir()}
    assert versions == {("1-0", "1"), ("1-0", "2"), ("1-1", "1")}  # 1-0 version 0 left the kept window
    Store.open(root)
    assert not (root / "blocks" / "1-1").exists() and (root / "blocks" / "1-0" / "2").is_dir()


def test_the_commit_measurement_runs(tmp_path: Path, capsys):
    from tools.plan.commit import main

    assert main(["--blocks", "40", "--work", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "columns" in out and "list" in out and not (tmp_path / "w" / "store.zarr").exists()
    assert main(["--blocks", "0", "--work", str(tmp_path / "w")]) == 2
    assert "error: --blocks 0" in capsys.readouterr().err
