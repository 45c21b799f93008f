"""3DGS PLY reading and writing against gsplat's exporter, plyfile, and the quantisation bounds."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gsplat import export_splats
from gsplat.exporter import sort_centers
from plyfile import PlyData, PlyElement

from tools.ply import (
    CompressedPly,
    CompressedPlyWriter,
    GaussianPly,
    GaussianPlyWriter,
    PlyError,
    PointPly,
    open_ply,
    write_ply,
)
from tools.ply.standard import property_names
from tools.scenes import random_splats


def gsplat_bytes(splats: dict, fmt: str) -> bytes:
    return export_splats(**{k: torch.from_numpy(v) for k, v in splats.items()}, format=fmt)


def read_all(path):
    reader = open_ply(path)
    return reader, reader.read(0, reader.count)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name


@pytest.mark.parametrize("sh_degree", [0, 1, 3])
def test_standard_writer_matches_gsplat_and_reads_back_bit_for_bit(tmp_path, sh_degree):
    splats = random_splats(700, sh_degree, seed=sh_degree)
    path = tmp_path / "a.ply"
    write_ply(path, splats)
    assert path.read_bytes() == gsplat_bytes(splats, "ply")
    reader, back = read_all(path)
    assert isinstance(reader, GaussianPly) and reader.sh_degree == sh_degree and reader.count == 700
    assert_bitwise_equal(back, splats)
    # Ranges read the same rows.
    part = reader.read(123, 456)
    assert_bitwise_equal(part, {k: v[123:456] for k, v in splats.items()})


def test_streamed_writes_equal_one_write(tmp_path):
    splats = random_splats(1000, 2, seed=1)
    write_ply(tmp_path / "one.ply", splats)
    write_ply(tmp_path / "one_c.ply", splats, compressed=True)
    for writer, name in ((GaussianPlyWriter, "many.ply"), (CompressedPlyWriter, "many_c.ply")):
        with writer(tmp_path / name, 1000, 2) as out:
            for a, b in ((0, 1), (1, 300), (300, 301), (301, 1000)):  # pieces not aligned to chunks
                out.write({k: v[a:b] for k, v in splats.items()})
    assert (tmp_path / "many.ply").read_bytes() == (tmp_path / "one.ply").read_bytes()
    assert (tmp_path / "many_c.ply").read_bytes() == (tmp_path / "one_c.ply").read_bytes()


def test_writer_leaves_no_file_on_error(tmp_path):
    splats = random_splats(10, 0, seed=2)
    with pytest.raises(ValueError, match="5 rows written, the header announced 10"):
        with GaussianPlyWriter(tmp_path / "x.ply", 10, 0) as out:
            out.write({k: v[:5] for k, v in splats.items()})
    bad = {k: v.copy() for k, v in splats.items()}
    bad["means"][3, 1] = np.nan
    with pytest.raises(ValueError, match="1 Gaussians have NaN"):
        write_ply(tmp_path / "y.ply", bad)
    assert list(tmp_path.iterdir()) == []


def test_ascii_and_big_endian_files_read_like_binary(tmp_path):
    splats = random_splats(50, 1, seed=3)
    write_ply(tmp_path / "le.ply", splats)
    data = PlyData.read(str(tmp_path / "le.ply"))
    for name, kwargs in (("ascii.ply", {"text": True}), ("be.ply", {"byte_order": ">"})):
        PlyData(data.elements, **kwargs).write(str(tmp_path / name))
        _, back = read_all(tmp_path / name)
        if name == "be.ply":
            assert_bitwise_equal(back, splats)
        else:  # decimal text: equal to float32 precision
            for k in splats:
                np.testing.assert_allclose(back[k], splats[k], rtol=1e-6, atol=1e-7)


def max_errors(decoded: dict, original: dict) -> dict[str, float]:
    sig = lambda x: 1 / (1 + np.exp(-x.astype(np.float64)))  # noqa: E731
    unit = lambda q: q / np.linalg.norm(q, axis=1, keepdims=True)  # noqa: E731
    return {
        "means": float(np.abs(decoded["means"] - original["means"]).max()),
        "scales": float(np.abs(decoded["scales"] - original["scales"]).max()),
        "quats": float((1 - np.abs((unit(decoded["quats"]) * unit(original["quats"])).sum(axis=1))).max()),
        "opacity": float(np.abs(sig(decoded["opacities"]) - sig(original["opacities"])).max()),
        "sh0": float(np.abs(decoded["sh0"] - original["sh0"]).max()),
        "shN": float(np.abs(decoded["shN"] - np.clip(original["shN"], -4, 4)).max()),
    }


def check_quantisation(decoded: dict, original: dict, span: dict) -> None:
    """Errors within half a quantisation step (plus float slack) of each packed field."""
    err = max_errors(decoded, original)
    assert err["means"] <= span["means"] / 1023 / 2 * 1.01 + 1e-6
    assert err["scales"] <= span["scales"] / 1023 / 2 * 1.01 + 1e-6
    assert err["quats"] <= 2e-5  # 10 bits per small component
    assert err["opacity"] <= 0.5 / 255 + 1e-6
    assert err["sh0"] <= span["sh0"] / 255 / 2 * 1.01 + 1e-5
    assert err["shN"] <= 8 / 256 / 2 + 1e-6


def test_compressed_round_trip_and_gsplat_files(tmp_path):
    splats = random_splats(1500, 3, seed=4)
    splats["means"] = np.random.default_rng(4).uniform(-1, 1, (1500, 3)).astype(np.float32)
    splats["opacities"] = np.abs(splats["opacities"])  # gsplat drops near-transparent splats
    span = {
        "means": 2.0,
        "scales": float(np.ptp(splats["scales"])),
        "sh0": float(np.ptp(splats["sh0"])),
    }
    # Ours: rows stay in order.
    write_ply(tmp_path / "ours.ply", splats, compressed=True)
    reader, ours = read_all(tmp_path / "ours.ply")
    assert isinstance(reader, CompressedPly) and reader.sh_degree == 3
    check_quantisation(ours, splats, span)
    part = reader.read(200, 700)  # ranges cross chunk boundaries
    for k in ours:
        assert np.array_equal(part[k], ours[k][200:700])
    # gsplat's: rows in its Morton order.
    (tmp_path / "gsplat.ply").write_bytes(gsplat_bytes(splats, "ply_compressed"))
    _, theirs = read_all(tmp_path / "gsplat.ply")
    order = sort_centers(torch.from_numpy(splats["means"]), torch.arange(1500)).numpy()
    check_quantisation(theirs, {k: v[order] for k, v in splats.items()}, span)


def test_compressed_degree_zero(tmp_path):
    splats = random_splats(300, 0, seed=5)
    (tmp_path / "g.ply").write_bytes(gsplat_bytes(splats, "ply_compressed"))
    reader, back = read_all(tmp_path / "g.ply")
    assert reader.sh_degree == 0 and back["shN"].shape == (reader.count, 0, 3)


def write_vertices(path, **columns):
    rows = np.zeros(len(next(iter(columns.values()))), dtype=[(k, v.dtype) for k, v in columns.items()])
    for k, v in columns.items():
        rows[k] = v
    PlyData([PlyElement.describe(rows, "vertex")]).write(str(path))


def test_point_clouds_with_and_without_colours(tmp_path):
    rng = np.random.default_rng(6)
    xyz = rng.normal(size=(100, 3))
    rgb = rng.integers(0, 256, (100, 3)).astype(np.uint8)
    write_vertices(tmp_path / "u8.ply", x=xyz[:, 0], y=xyz[:, 1], z=xyz[:, 2], red=rgb[:, 0], green=rgb[:, 1], blue=rgb[:, 2])
    write_vertices(tmp_path / "f.ply", x=xyz[:, 0].astype(np.float32), y=xyz[:, 1].astype(np.float32),
                   z=xyz[:, 2].astype(np.float32), r=rgb[:, 0] / 255.0, g=rgb[:, 1] / 255.0, b=rgb[:, 2] / 255.0)  # fmt: skip
    write_vertices(tmp_path / "none.ply", x=xyz[:, 0], y=xyz[:, 1], z=xyz[:, 2])
    for name in ("u8.ply", "f.ply"):
        reader = open_ply(tmp_path / name)
        assert isinstance(reader, PointPly)
        points, colors = reader.read(0, 100)
        np.testing.assert_allclose(points, xyz, rtol=1e-6)
        assert np.array_equal(colors, rgb)
    _, colors = open_ply(tmp_path / "none.ply").read(0, 100)
    assert (colors == 128).all()


def test_bad_files_name_the_file_and_problem(tmp_path):
    splats = random_splats(20, 1, seed=7)
    good = tmp_path / "good.ply"
    write_ply(good, splats)
    raw = good.read_bytes()
    (tmp_path / "cut.ply").write_bytes(raw[:-10])
    message = r"cut\.ply: truncated: element 'vertex' needs 1840 bytes of data, the file ends 10 bytes early"
    with pytest.raises(PlyError, match=message):
        open_ply(tmp_path / "cut.ply")
    (tmp_path / "noopacity.ply").write_bytes(raw.replace(b"property float opacity\n", b""))
    with pytest.raises(PlyError, match=r"noopacity\.ply: 3DGS PLY lacks properties opacity"):
        open_ply(tmp_path / "noopacity.ply")
    (tmp_path / "rest.ply").write_bytes(raw.replace(b"property float f_rest_8\n", b""))
    with pytest.raises(PlyError, match="8 f_rest properties"):
        open_ply(tmp_path / "rest.ply")
    (tmp_path / "junk.ply").write_bytes(b"hello world")
    with pytest.raises(PlyError, match="does not start with 'ply'"):
        open_ply(tmp_path / "junk.ply")
    (tmp_path / "hdr.ply").write_bytes(b"ply\nformat binary_little_endian 1.0\nelement vertex 3\nproperty float x\n")
    with pytest.raises(PlyError, match="no 'end_header'"):
        open_ply(tmp_path / "hdr.ply")
    (tmp_path / "type.ply").write_bytes(b"ply\nformat ascii 1.0\nelement vertex 1\nproperty quux x\nend_header\n1\n")
    with pytest.raises(PlyError, match="header line 4 'property quux x': unknown property type 'quux'"):
        open_ply(tmp_path / "type.ply")
    (tmp_path / "short.ply").write_bytes(b"ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\n"
                                         b"property float z\nend_header\n1 2 3\n4 5 6\n")  # fmt: skip
    with pytest.raises(PlyError, match="truncated: element 'vertex' has 2 of 3 rows"):
        open_ply(tmp_path / "short.ply").read(0, 3)
    with pytest.raises(PlyError, match="missing.ply: cannot read"):
        open_ply(tmp_path / "missing.ply")


def test_property_order_is_gsplats():
    assert property_names(1)[:7] == ["x", "y", "z", "f_dc_0", "f_dc_1", "f_dc_2", "f_rest_0"]
    assert property_names(1)[-8:] == ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
