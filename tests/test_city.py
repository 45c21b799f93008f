"""The street-level city generator and the exchange-volume accounting of `tools.bench.mpi`."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import tools.bench.mpi as mpi
from octree import build_octree
from tools.scenes import CAR, FACADE, GROUND, ROOF, TREE, CityConfig, CityError, generate_city
from train.render.semantics import ALPHA_MIN, EPS2D, FAR_PLANE, NEAR_PLANE, RADIUS_SIGMAS
from train.schedule import step_cameras

# One city block with a few buildings, trees and cars: about 1000 Gaussians.
TINY = CityConfig(blocks=1, block_size=30.0, street_width=10.0, max_parcels=2, setback=(1.0, 3.0),
                  density=0.15, cameras=12, width=320, height=180, seed=3)
SMALL = CityConfig(blocks=2, block_size=40.0, density=0.3, cameras=24, width=320, height=180, seed=1)


@pytest.fixture(scope="module")
def small():
    return generate_city(SMALL)


@pytest.fixture(scope="module")
def tiny():
    return generate_city(TINY)


def _arrays(city) -> dict[str, np.ndarray]:
    out = {k: getattr(city, k) for k in ("means", "scales", "quats", "opacities", "colors", "kind", "part",
                                         "buildings", "trees", "cars")}
    out["viewmats"] = np.stack([c.viewmat for c in city.cameras])
    out["Ks"] = np.stack([c.K for c in city.cameras])
    return out


def test_generator_is_deterministic(small):
    again = _arrays(generate_city(SMALL))
    for name, value in _arrays(small).items():
        np.testing.assert_array_equal(value, again[name], err_msg=name)
    other = generate_city(CityConfig(**{**SMALL.__dict__, "seed": SMALL.seed + 1}))
    assert not np.array_equal(other.buildings, small.buildings)


def test_cameras_stand_on_streets_at_eye_height_looking_along_them(small):
    cfg = small.config
    centres = np.stack([c.center for c in small.cameras])
    np.testing.assert_allclose(centres[:, 2], cfg.eye_height, atol=1e-9)
    assert cfg.on_street(centres[:, :2]).all()
    for x0, y0, _, x1, y1, _ in small.buildings:
        inside = (centres[:, 0] > x0) & (centres[:, 0] < x1) & (centres[:, 1] > y0) & (centres[:, 1] < y1)
        assert not inside.any()
    rot = np.stack([c.viewmat[:3, :3] for c in small.cameras])
    forward, down = rot[:, 2], rot[:, 1]
    pitch = np.degrees(np.arcsin(forward[:, 2]))
    assert ((pitch >= cfg.pitch[0] - 1e-9) & (pitch <= cfg.pitch[1] + 1e-9)).all()
    assert (down[:, 2] < -0.9).all()  # upright: image rows run down the world's z
    # The heading lies within the jitter of a street direction (an axis).
    yaw = np.degrees(np.arctan2(forward[:, 1], forward[:, 0]))
    off_axis = np.abs((yaw + 45.0) % 90.0 - 45.0)
    assert (off_axis <= cfg.yaw_jitter + 1e-9).all()
    # The camera sees along its street: the centre line is within a half street width of it.
    across = np.where(np.abs(np.cos(np.radians(yaw))) > np.abs(np.sin(np.radians(yaw))), centres[:, 1], centres[:, 0])
    assert (np.abs(np.mod(across, cfg.grid_step) - cfg.street_width / 2) <= 0.3 * cfg.street_width + 1e-9).all()


# ---- the survey capture ----

def _in_image(camera, points: np.ndarray) -> np.ndarray:  # [M, 3] -> [M] bool
    """Points in front of the camera whose pinhole projection lands inside its image."""
    p = points @ camera.viewmat[:3, :3].T + camera.viewmat[:3, 3]
    ahead = p[:, 2] > NEAR_PLANE
    uv = p[:, :2] / np.where(ahead, p[:, 2], 1.0)[:, None] * np.diag(camera.K)[:2] + camera.K[:2, 2]
    return ahead & (uv >= 0).all(axis=1) & (uv < [camera.width, camera.height]).all(axis=1)


@pytest.fixture(scope="module")
def surveys():
    return {b: generate_city(CityConfig(blocks=b, density=0.05, width=160, height=90, capture="survey", seed=4))
            for b in (3, 8)}


def test_a_survey_view_sees_a_bounded_patch_however_large_the_city(surveys):
    small, large = surveys[3], surveys[8]
    assert len(large) > 5 * len(small)
    largest = {b: max(int(_in_image(c, city.means.astype(np.float64)).sum()) for c in city.cameras)
               for b, city in surveys.items()}
    # The camera count grows with the city's area, the Gaussians of its fullest view do not.
    assert len(large.cameras) > 5 * len(small.cameras)
    assert largest[8] < 1.25 * largest[3], largest
    assert largest[8] < 0.1 * len(large), (largest, len(large))


def test_a_survey_flies_over_the_whole_city_at_its_altitude_with_the_horizon_out_of_view(surveys):
    city = surveys[8]
    cfg = city.config
    centres = np.stack([c.center for c in city.cameras])
    np.testing.assert_allclose(centres[:, 2], cfg.survey_altitude)
    for cam in city.cameras:  # the rays through the image's top corners point down by the margin at least
        rays = np.linalg.inv(cam.K) @ np.array([[0.0, cam.width], [0.0, 0.0], [1.0, 1.0]])
        world = cam.viewmat[:3, :3].T @ rays
        assert (world[2] / np.linalg.norm(world, axis=0) < -np.sin(np.radians(5.0))).all()
    # Every ground point of the city lies in images of both passes (lines along x and along y), in
    # two at least (the footprint is a trapezoid, narrow near the camera: overlap 0.6 between line
    # centres leaves a few points in one image of a pass).
    g = np.arange(0.5, cfg.extent, 4.0)
    ground = np.stack(np.meshgrid(g, g, [0.0], indexing="ij"), -1).reshape(-1, 3)
    seen = np.stack([_in_image(c, ground) for c in city.cameras])  # [C, M]
    forward = np.stack([c.viewmat[2, :3] for c in city.cameras])
    along_x = np.abs(forward[:, 0]) > np.abs(forward[:, 1])
    assert seen[along_x].sum(0).min() >= 1 and seen[~along_x].sum(0).min() >= 1 and seen.sum(0).min() >= 2
    assert np.median(seen.sum(0)) >= 2 / (1 - cfg.survey_overlap) ** 2  # both passes' overlap, in the middle
    # Neighbours in the flight order stand near each other (what naming for hold-out relies on):
    # a step is a shot's spacing, or a turn onto the next line.
    steps = np.linalg.norm(np.diff(centres, axis=0), axis=1)
    assert np.median(steps) < 0.5 * cfg.extent / 3


def _box_surface_distance(p: np.ndarray, box: np.ndarray) -> np.ndarray:  # [M, 3], [6] -> [M]
    """Distance from points to the surface of an axis-aligned box, bottom face excluded."""
    lo, hi = box[:3], box[3:]
    outside = np.linalg.norm(np.maximum(np.maximum(lo - p, p - hi), 0.0), axis=1)
    to_face = np.minimum(np.abs(p - lo)[:, :2].min(1), np.abs(p - hi).min(1))
    return np.where(outside > 0, outside, to_face)


def test_gaussians_lie_on_building_surfaces_ground_and_clutter(small):
    m = small.means.astype(np.float64)
    from gsplat.cuda._torch_impl import _quat_to_rotmat

    normal_axis = _quat_to_rotmat(torch.from_numpy(small.quats)).numpy()[:, :, 2]  # the thin axis
    for kind, boxes in ((FACADE, small.buildings), (ROOF, small.buildings), (CAR, small.cars)):
        rows = np.flatnonzero(small.kind == kind)
        assert len(rows) > 0
        for b in np.unique(small.part[rows]):
            sel = rows[small.part[rows] == b]
            assert _box_surface_distance(m[sel], boxes[b]).max() < 1e-4
    roof = small.kind == ROOF
    np.testing.assert_allclose(m[roof, 2], small.buildings[small.part[roof], 5], atol=1e-4)
    facade = small.kind == FACADE
    # A facade Gaussian is flat in its wall: its thin axis is horizontal, along x or y.
    np.testing.assert_allclose(np.abs(normal_axis[facade, 2]), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.abs(normal_axis[facade, :2]).max(1), 1.0, atol=1e-5)
    flat = (small.kind == ROOF) | (small.kind == GROUND)
    np.testing.assert_allclose(np.abs(normal_axis[flat, 2]), 1.0, atol=1e-5)

    ground = small.kind == GROUND
    assert ground.sum() > 0 and (m[ground, 2] == 0).all()
    for x0, y0, _, x1, y1, _ in small.buildings:
        g = m[ground]
        assert not ((g[:, 0] > x0) & (g[:, 0] < x1) & (g[:, 1] > y0) & (g[:, 1] < y1)).any()
    tree = small.kind == TREE
    crowns = small.trees[small.part[tree]]
    np.testing.assert_allclose(np.linalg.norm(m[tree] - crowns[:, :3], axis=1), crowns[:, 3], atol=1e-4)
    radial = (m[tree] - crowns[:, :3]) / crowns[:, 3:]
    np.testing.assert_allclose(np.abs((radial * normal_axis[tree]).sum(1)), 1.0, atol=1e-4)
    assert np.isfinite(small.scales).all() and ((small.colors >= 0) & (small.colors <= 1)).all()


@pytest.mark.parametrize("change, field", [
    ({"blocks": 0}, "blocks"),
    ({"density": -1.0}, "density"),
    ({"setback": (2.0, 15.0)}, "setback"),
    ({"building_height": (30.0, 10.0)}, "building_height"),
    ({"pitch": (-5.0, 95.0)}, "pitch"),
    ({"fov_x": 180.0}, "fov_x"),
    ({"capture": "drone"}, "capture"),
    ({"capture": "survey", "survey_altitude": 40.0}, "survey_altitude"),  # below the 45 m towers
    ({"capture": "survey", "survey_overlap": 1.0}, "survey_overlap"),
    ({"capture": "survey", "survey_pitch": -25.0}, "survey_pitch"),  # the image's top would see the horizon
    ({"capture": "survey", "survey_pitch": 10.0}, "survey_pitch"),
])
def test_bad_config_names_the_field(change, field):
    with pytest.raises(CityError, match=field):
        CityConfig(**change)


# ---- exchange volume ----

def _reference_splats(city, camera) -> set[int]:
    """Input rows with a splat in `camera`, one Gaussian at a time, with gsplat's pure-torch
    projection of means and covariances (in float64) and the CUDA kernel's opacity-aware radius."""
    from gsplat.cuda._torch_impl import _persp_proj, _quat_scale_to_covar_preci, _world_to_cam

    f64 = {"dtype": torch.float64}
    quats, scales, means = (torch.as_tensor(a, **f64) for a in (city.quats, city.scales, city.means))
    covars, _ = _quat_scale_to_covar_preci(quats, torch.exp(scales), compute_preci=False)
    viewmat, K = torch.as_tensor(camera.viewmat, **f64)[None], torch.as_tensor(camera.K, **f64)[None]
    means_c, covars_c = _world_to_cam(means, covars, viewmat)
    means2d, cov2d = _persp_proj(means_c, covars_c, K, camera.width, camera.height)
    out = set()
    for g in range(len(city)):
        z = float(means_c[0, g, 2])
        if not NEAR_PLANE <= z <= FAR_PLANE:
            continue
        a, b, c = float(cov2d[0, g, 0, 0]) + EPS2D, float(cov2d[0, g, 0, 1]), float(cov2d[0, g, 1, 1]) + EPS2D
        opacity = 1.0 / (1.0 + math.exp(-float(city.opacities[g])))
        if a * c - b * b <= 0 or opacity < ALPHA_MIN:
            continue
        extend = min(RADIUS_SIGMAS, math.sqrt(2.0 * math.log(max(opacity / ALPHA_MIN, 1.0))))
        rx, ry = math.ceil(extend * math.sqrt(a)), math.ceil(extend * math.sqrt(c))
        u, v = float(means2d[0, g, 0]), float(means2d[0, g, 1])
        if (rx > 0 or ry > 0) and u + rx > 0 and u - rx < camera.width and v + ry > 0 and v - ry < camera.height:
            out.add(g)
    return out


def _reference_owners(city, ranks: int, max_per_block: int) -> list[int]:
    """The rank owning each input row: the leaf cell that holds it, the region that holds the leaf."""
    tree = build_octree(city.means, max_per_block)
    cells = tree.cells
    bounds = mpi.partition(tree.counts, ranks)
    owners = []
    for p in city.means.astype(np.float64):
        leaf = [i for i, box in enumerate(cells) if (box[:3] <= p).all() and (p < box[3:]).all()]
        assert len(leaf) == 1
        owners.append(next(r for r in range(ranks) if bounds[r] <= leaf[0] < bounds[r + 1]))
    return owners


@pytest.fixture(scope="module")
def tiny_counts(tiny):
    layout = mpi.build_layout(tiny.splats(), ranks=3, max_per_block=40)
    return layout, *mpi.count_splats(layout, tiny.cameras)


def test_splats_found_after_culling_equal_brute_force(tiny, monkeypatch):
    monkeypatch.setattr(mpi, "_PROJECT_ROWS", 37)  # several projection calls per run of blocks
    layout = mpi.build_layout(tiny.splats(), ranks=3, max_per_block=40)
    seen = 0
    for camera in tiny.cameras:
        rows = mpi.splat_rows(layout, camera)
        found = layout.ids[rows]
        assert len(np.unique(found)) == len(found)
        assert set(found.tolist()) == _reference_splats(tiny, camera)
        seen += len(found)
    assert seen > 0.2 * len(tiny) * len(tiny.cameras)  # the cameras do see the city


def test_byte_accounting_matches_per_gaussian_loops(tiny, tiny_counts):
    layout, ours, round_robin = tiny_counts
    ranks, per_rank, steps, seed = 3, 2, 4, 7
    owners = _reference_owners(tiny, ranks, max_per_block=40)
    visible = [_reference_splats(tiny, c) for c in tiny.cameras]
    for policy in mpi.POLICIES:
        affinity = mpi.block_affinity(layout, tiny.cameras) if policy == "balanced-blocks" else ours
        plan = mpi.plan_steps(affinity, per_rank, steps, seed, policy)
        got = mpi.exchange_volume(ours, round_robin, plan)
        pairs = crossing = crossing_rr = 0
        for s, step in enumerate(plan):
            np.testing.assert_array_equal(step.cameras, step_cameras(seed, len(tiny.cameras), ranks * per_rank, s))
            for cam, rank in zip(step.cameras, step.ranks):
                for g in range(len(tiny)):
                    if g in visible[cam]:
                        pairs += 1
                        crossing += owners[g] != rank
                        crossing_rr += g % ranks != rank
        assert (got.splats, got.ours, got.gsplat) == (pairs, crossing, crossing_rr), policy
        b = got.per_step_bytes()
        assert b["ours fp32 fwd"] == crossing * 48 / steps and b["ours fp16 fwd"] == crossing * 24 / steps
        assert b["ours fp32 fwd+bwd"] == crossing * (48 + 37) / steps  # at most 37 B back a splat
        assert b["gsplat fwd"] == crossing_rr * 56 / steps and b["gsplat fwd+bwd"] == crossing_rr * 96 / steps
        assert got.ratios()["fp32 fwd"] == pytest.approx(48 * crossing / (56 * crossing_rr))


def test_balanced_assignment_gives_each_rank_its_share_and_keeps_most_local(tiny, tiny_counts):
    layout, ours, round_robin = tiny_counts
    ranks, per_rank = layout.ranks, 2
    balanced = mpi.plan_steps(ours, per_rank, 4, 0, "balanced-splats")
    in_order = mpi.plan_steps(ours, per_rank, 4, 0, "in-order")
    for b, o in zip(balanced, in_order):
        assert np.bincount(b.ranks, minlength=ranks).tolist() == [per_rank] * ranks
        np.testing.assert_array_equal(b.cameras, o.cameras)
        # The optimum over every balanced assignment of the step's cameras, by enumeration.
        best = max(sum(ours[c, r] for c, r in zip(b.cameras, perm))
                   for perm in set(itertools.permutations(np.repeat(np.arange(ranks), per_rank))))
        assert ours[b.cameras, b.ranks].sum() == best >= ours[o.cameras, o.ranks].sum()
    for step in mpi.plan_steps(mpi.block_affinity(layout, tiny.cameras), per_rank, 4, 0, "balanced-blocks"):
        assert np.bincount(step.ranks, minlength=ranks).tolist() == [per_rank] * ranks


def test_block_affinity_bounds_the_splats_it_predicts(tiny, tiny_counts):
    layout, ours, _ = tiny_counts
    affinity = mpi.block_affinity(layout, tiny.cameras)
    assert (affinity >= ours).all()  # culling is conservative: no visible Gaussian is missed
    assert affinity.sum(1).max() <= len(tiny)
    np.testing.assert_array_equal(layout.rank_gaussians(), np.bincount(layout.owner, minlength=layout.ranks))


def test_cli(capsys):
    assert mpi.main(["no-such-bench"]) == 2
    assert mpi.main([]) == 2
    assert mpi.main(["volume", "--blocks", "0"]) == 2
    assert "error: city config: blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mpi.main(["volume", "--ranks", "0"])
    args = ["volume", "--blocks", "1", "--density", "0.1", "--cameras", "8", "--ranks", "2", "--per-rank", "2",
            "--width", "160", "--height", "90", "--max-per-block", "64"]
    assert mpi.main(args) == 0
    out = capsys.readouterr().out
    assert "balanced-splats" in out and "ratio fp32" in out
