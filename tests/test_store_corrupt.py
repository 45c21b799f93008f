"""Damaged and hostile stores give specific errors that name the store, the block and the problem."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr

from octree.keys import BlockKeyError
from storage import CodecConfig, Store, StoreCorruptError, StoreFormatError, StoreKeyError
from tests.helpers.store_data import random_block

CELL = (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)
ROWS = 300


def make_store(root: Path, codec: CodecConfig) -> None:
    rng = np.random.default_rng(0)
    store = Store.create(root, {"sh_degree": 1}, codec=codec, durable=False)
    store.commit({k: store.write_block(k, random_block(rng, ROWS, 1), CELL) for k in ("1-0", "1-1")})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One intact store per codec; each test damages its own copy."""
    base = tmp_path_factory.mktemp("pristine")
    stores = {"raw": CodecConfig(cname="none"), "lz4": CodecConfig(min_saving=0), "lz4-nocrc": CodecConfig(min_saving=0, checksum=False)}
    for name, codec in stores.items():
        make_store(base / name, codec)
    return {name: base / name for name in stores}


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def edit_array_meta(root: Path, block: str, array: str, change: Callable[[dict], None]) -> None:
    """Change an array's metadata, in its own document and in the version group's consolidated copy."""
    edit_json(root / "blocks" / block / "0" / array / "zarr.json", change)
    edit_json(root / "blocks" / block / "0" / "zarr.json", lambda d: change(d["consolidated_metadata"]["metadata"][array]))


def chunk(root: Path, block: str, array: str) -> Path:
    return root / "blocks" / block / "0" / array / "c.0.0"  # a 2-d array's only chunk


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def first_block_entry(doc: dict) -> dict:
    return next(e for e in doc["attributes"]["blocks"] if e["key"] == "1-0")


# name -> (codec store, damage, exception, words the message must hold, where it shows: open | read)
CASES = {
    "truncated chunk, raw": ("raw", lambda r: truncate(chunk(r, "1-0", "params")), StoreCorruptError, ["1-0", "params", "bytes, expected"], "read"),
    "truncated chunk, lz4+crc32c": ("lz4", lambda r: truncate(chunk(r, "1-0", "params")), StoreCorruptError, ["1-0", "params", "checksum"], "read"),
    "truncated chunk, lz4": ("lz4-nocrc", lambda r: truncate(chunk(r, "1-0", "params")), StoreCorruptError, ["1-0", "params", "blosc header"], "read"),
    "flipped byte, raw+crc32c": ("raw", lambda r: flip_byte(chunk(r, "1-0", "params")), StoreCorruptError, ["1-0", "params", "checksum"], "read"),
    "flipped byte, lz4+crc32c": ("lz4", lambda r: flip_byte(chunk(r, "1-0", "params")), StoreCorruptError, ["1-0", "params", "checksum"], "read"),
    "missing chunk": ("raw", lambda r: chunk(r, "1-0", "state").unlink(), StoreCorruptError, ["1-0", "state", "missing"], "read"),
    "wrong shape": (
        "raw",
        lambda r: edit_array_meta(r, "1-0", "params", lambda d: d.update(shape=[8, ROWS])),
        StoreCorruptError,
        ["1-0", "params", "shape"],
        "open",
    ),
    "wrong dtype": (
        "raw",
        lambda r: edit_array_meta(r, "1-0", "counters", lambda d: d.update(data_type="float32")),
        StoreCorruptError,
        ["1-0", "counters", "dtype"],
        "open",
    ),
    "array missing": (
        "raw",
        lambda r: edit_json(r / "blocks/1-0/0/zarr.json", lambda d: d["consolidated_metadata"]["metadata"].pop("state")),
        StoreCorruptError,
        ["1-0", "state", "missing"],
        "open",
    ),
    "missing block": ("raw", lambda r: shutil.rmtree(r / "blocks/1-1"), StoreCorruptError, ["1-1", "missing"], "open"),
    "count disagrees with table": (
        "raw",
        lambda r: edit_json(r / "commits/0/zarr.json", lambda d: first_block_entry(d).update(count=ROWS - 1)),
        StoreCorruptError,
        ["1-0", "rows"],
        "open",
    ),
    "path traversal key": (
        "raw",
        lambda r: edit_json(r / "commits/0/zarr.json", lambda d: first_block_entry(d).update(key="../../etc")),
        StoreKeyError,
        ["../../etc", "malformed block key"],
        "open",
    ),
    "version from the future": (
        "raw",
        lambda r: edit_json(r / "commits/0/zarr.json", lambda d: first_block_entry(d).update(version=7)),
        StoreCorruptError,
        ["1-0", "newer than the commit"],
        "open",
    ),
    "NaN in a box": (
        "raw",
        lambda r: edit_json(r / "commits/0/zarr.json", lambda d: first_block_entry(d).update(cell=[float("nan"), 0, 0, 1, 1, 1])),
        StoreCorruptError,
        ["1-0", "cell box", "non-finite"],
        "open",
    ),
    "commit not JSON": ("raw", lambda r: (r / "commits/0/zarr.json").write_text("{ broken"), StoreCorruptError, ["commits/0", "not valid JSON"], "open"),
    "HEAD names a missing commit": (
        "raw",
        lambda r: edit_json(r / "zarr.json", lambda d: d["attributes"].update(head=5)),
        StoreCorruptError,
        ["commit 5", "missing"],
        "open",
    ),
    "wrong format version": (
        "raw",
        lambda r: edit_json(r / "zarr.json", lambda d: d["attributes"].update(format_version=99)),
        StoreFormatError,
        ["format version 99"],
        "open",
    ),
    "layout not this format's": (
        "raw",
        lambda r: edit_json(r / "zarr.json", lambda d: d["attributes"]["layout"]["params"]["rows"]["means"].reverse()),
        StoreFormatError,
        ["layout", "sh_degree 1"],
        "open",
    ),
    "bad codec attribute": (
        "raw",
        lambda r: edit_json(r / "zarr.json", lambda d: d["attributes"]["codec"].update(cname="rot13")),
        StoreFormatError,
        ["codec", "rot13"],
        "open",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damage_gives_a_specific_error(tmp_path: Path, pristine: dict[str, Path], case: str) -> None:
    codec, damage, error, words, when = CASES[case]
    root = tmp_path / "s.zarr"
    shutil.copytree(pristine[codec], root)
    damage(root)
    if when == "read":
        store = Store.open(root, mode="r")  # metadata is intact: the damage shows when data is read
        with pytest.raises(error) as read_error:
            store.read_block("1-0")
        with pytest.raises(error):
            Store.open(root, mode="r", verify="data")
        message = str(read_error.value)
    else:
        with pytest.raises(error) as open_error:
            Store.open(root, mode="r")
        message = str(open_error.value)
    assert str(root) in message
    for word in words:
        assert word in message, (word, message)


def test_bad_key_error_is_also_a_block_key_error(tmp_path: Path, pristine: dict[str, Path]) -> None:
    root = tmp_path / "s.zarr"
    shutil.copytree(pristine["raw"], root)
    edit_json(root / "commits/0/zarr.json", lambda d: first_block_entry(d).update(key="1-0/../../x"))
    with pytest.raises(BlockKeyError):
        Store.open(root)


def test_a_damaged_store_is_not_collected(tmp_path: Path, pristine: dict[str, Path]) -> None:
    """Validation runs before GC: opening a damaged store for writing deletes nothing."""
    root = tmp_path / "s.zarr"
    shutil.copytree(pristine["raw"], root)
    edit_json(root / "commits/0/zarr.json", lambda d: d["attributes"]["blocks"].pop())
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    edit_array_meta(root, "1-0", "params", lambda d: d.update(shape=[1, 23]))
    with pytest.raises(StoreCorruptError):
        Store.open(root)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_a_plain_zarr_group_is_not_a_store(tmp_path: Path) -> None:
    zarr.open_group(tmp_path / "plain", mode="w").create_array("x", shape=(3,), dtype="f4")
    with pytest.raises(StoreFormatError, match="not an OctoSplat store"):
        Store.open(tmp_path / "plain")
