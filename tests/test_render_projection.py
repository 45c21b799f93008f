"""Projection and SH colour against gsplat's pure-torch helpers on the real garden cameras and points."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci, _spherical_harmonics

from train.camera import Camera
from train.render import RenderError, project
from train.render.scenes import load_garden
from train.render.semantics import ALPHA_MIN, RADIUS_SIGMAS

PARAMS = ("means", "scales", "quats", "opacities", "sh0", "shN")


@pytest.fixture(scope="module")
def garden(shared_data):
    return load_garden(shared_data / "test_garden.npz")


def subset(splats: dict, n: int, seed: int = 0) -> dict:
    rows = torch.randperm(len(splats["means"]), generator=torch.Generator().manual_seed(seed))[:n]
    return {k: v[rows].clone().requires_grad_(True) for k, v in splats.items()}


def gsplat_reference(splats: dict, cam: Camera, sh_degree: int) -> dict:
    """gsplat's pure-torch projection and SH, with the cuda backend's opacity-aware culling on top."""
    covars, _ = _quat_scale_to_covar_preci(splats["quats"], torch.exp(splats["scales"]), compute_preci=False)
    viewmat = torch.from_numpy(cam.viewmat).float()[None]
    K = torch.from_numpy(cam.K).float()[None]
    radii, means2d, depths, conics, _ = _fully_fused_projection(splats["means"], covars, viewmat, K,
                                                                cam.width, cam.height)
    means2d, depths, conics, radii = means2d[0], depths[0], conics[0], radii[0]
    opacities = torch.sigmoid(splats["opacities"])
    with torch.no_grad():
        det = conics[:, 0] * conics[:, 2] - conics[:, 1] ** 2  # the conic is the inverse 2D covariance
        var = torch.stack([conics[:, 2] / det, conics[:, 0] / det], -1)
        extend = torch.sqrt(2 * torch.log(torch.clamp_min(opacities / ALPHA_MIN, 1.0))).clamp_max(RADIUS_SIGMAS)
        tight = torch.ceil(extend[:, None] * torch.sqrt(var))
        inside = ((means2d + tight > 0) & (means2d - tight < torch.tensor([cam.width, cam.height]))).all(-1)
        keep = (radii > 0).all(-1) & (opacities >= ALPHA_MIN) & inside
    center = torch.from_numpy(cam.center).float()
    coeffs = torch.cat([splats["sh0"], splats["shN"]], 1)
    colors = torch.clamp_min(_spherical_harmonics(sh_degree, splats["means"] - center, coeffs) + 0.5, 0.0)
    return {"keep": keep, "means2d": means2d, "conics": conics, "depths": depths, "opacities": opacities,
            "colors": colors, "radii": tight.to(torch.int32)}


@pytest.mark.parametrize("cam_index", [0, 1, 2])
def test_projection_matches_gsplat(garden, cam_index):
    splats, cameras = garden
    cam = cameras[cam_index]
    with torch.no_grad():
        ours = project(splats, cam, 3)
        ref = gsplat_reference(splats, cam, 3)
    expected_ids = torch.nonzero(ref["keep"])[:, 0]
    # Float32 (gsplat) and float64 (ours) may round a radius differently at an integer boundary,
    # which decides the few splats whose box just touches the image edge.
    assert len(set(expected_ids.tolist()) ^ set(ours.ids.tolist())) <= 1e-4 * len(splats["means"])
    ids = torch.from_numpy(np.intersect1d(ours.ids.numpy(), expected_ids.numpy()))
    mine = torch.searchsorted(ours.ids, ids)
    assert len(ids) > 0.5 * len(ours)
    torch.testing.assert_close(ours.means2d[mine], ref["means2d"][ids], atol=2e-3, rtol=1e-5)
    torch.testing.assert_close(ours.depths[mine], ref["depths"][ids])
    conic_scale = ref["conics"][ids].abs().amax(-1, keepdim=True)
    torch.testing.assert_close(ours.conics[mine] / conic_scale, ref["conics"][ids] / conic_scale, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.opacities[mine], ref["opacities"][ids])
    torch.testing.assert_close(ours.colors[mine], ref["colors"][ids], atol=1e-5, rtol=1e-5)
    assert (ours.radii[mine] - ref["radii"][ids]).abs().max() <= 1


@pytest.mark.parametrize("sh_degree", [0, 1, 2, 3])
def test_sh_colors_match_gsplat_at_every_degree(garden, sh_degree):
    """shN holds degree 3; a smaller degree uses its first (d + 1)^2 - 1 coefficients, as gsplat does."""
    splats, cameras = garden
    sub = subset(splats, 4000, seed=sh_degree)
    with torch.no_grad():
        ours = project(sub, cameras[1], sh_degree)
        ref = gsplat_reference(sub, cameras[1], sh_degree)
    torch.testing.assert_close(ours.colors, ref["colors"][ours.ids], atol=1e-5, rtol=1e-5)


def test_gradients_match_autograd_through_gsplat(garden):
    splats, cameras = garden
    ours_in, ref_in = subset(splats, 6000), subset(splats, 6000)
    ours = project(ours_in, cameras[2], 3)
    ref = gsplat_reference(ref_in, cameras[2], 3)
    gen = torch.Generator().manual_seed(0)
    fields = ("means2d", "conics", "opacities", "colors")
    weights = {f: torch.randn(getattr(ours, f).shape, generator=gen) for f in fields}
    sum(((getattr(ours, f) * weights[f]).sum() for f in fields)).backward()
    sum(((ref[f][ours.ids] * weights[f]).sum() for f in fields)).backward()
    for name in PARAMS:
        expected = ref_in[name].grad
        err = (ours_in[name].grad - expected).abs().max() / expected.abs().max()
        assert err < 1e-4, f"d/d{name}: off by {err:.2e} of its largest entry"


def test_means2d_gradient_is_kept_for_densification(garden):
    splats, cameras = garden
    ours = project(subset(splats, 2000), cameras[0], 3)
    (ours.means2d ** 2).sum().backward()
    torch.testing.assert_close(ours.means2d.grad, 2 * ours.means2d.detach())


def test_culling_rules():
    """Behind the camera or the near plane, too faint for alpha 1/255, or with a radius box off the
    image: dropped. Everything else is kept, with `ids` naming the input rows."""
    cam = Camera(np.eye(4), np.array([[100.0, 0, 32], [0, 100.0, 24], [0, 0, 1]]), 64, 48)
    means = torch.tensor([[0.0, 0, 2], [0, 0, -2], [0, 0, 0.005], [0, 0, 3], [5, 0, 1], [0.3, 0.2, 4], [0, 0, 1e11]])
    n = len(means)
    opacities = torch.full((n,), 2.0)
    opacities[3] = torch.logit(torch.tensor(0.5 / 255))
    splats = {"means": means, "scales": torch.full((n, 3), -3.0), "quats": torch.tensor([[1.0, 0, 0, 0]] * n),
              "opacities": opacities, "sh0": torch.zeros(n, 1, 3), "shN": torch.zeros(n, 0, 3)}
    out = project(splats, cam, 0)
    assert out.ids.tolist() == [0, 5]
    torch.testing.assert_close(out.means2d, torch.tensor([[32.0, 24.0], [39.5, 29.0]]))
    torch.testing.assert_close(out.colors, torch.full((2, 3), 0.5))


def test_degenerate_scales_give_the_eps2d_footprint():
    """A zero-size Gaussian still covers eps2d = 0.3 px^2, and its gradients stay finite."""
    cam = Camera(np.eye(4), np.array([[100.0, 0, 32], [0, 100.0, 24], [0, 0, 1]]), 64, 48)
    splats = {"means": torch.tensor([[0.0, 0, 2]]), "scales": torch.full((1, 3), -40.0),
              "quats": torch.tensor([[0.3, 0.1, 0.9, 0.2]]), "opacities": torch.tensor([3.0]),
              "sh0": torch.ones(1, 1, 3), "shN": torch.zeros(1, 3, 3)}
    for v in splats.values():
        v.requires_grad_(True)
    out = project(splats, cam, 1)
    torch.testing.assert_close(out.conics, torch.tensor([[1 / 0.3, 0.0, 1 / 0.3]]))
    assert out.radii.tolist() == [[2, 2]]  # ceil(3.33 * sqrt(0.3))
    (out.means2d.sum() + out.conics.sum() + out.colors.sum()).backward()
    assert all(torch.isfinite(v.grad).all() for v in splats.values())


def test_zero_visible_splats(garden):
    splats, cameras = garden
    behind = {k: v[:100].clone() for k, v in splats.items()}
    cam = cameras[0]
    R, t = cam.viewmat[:3, :3], cam.viewmat[:3, 3]
    behind["means"] = torch.from_numpy((cam.center - 5.0 * R[2]).astype(np.float32)).expand(100, 3).contiguous()
    out = project(behind, cam, 3)
    assert len(out) == 0 and out.means2d.shape == (0, 2) and out.ids.dtype == torch.int64


@pytest.mark.parametrize("change,message", [
    (lambda s: s.pop("quats"), "missing quats"),
    (lambda s: s.update(scales=s["scales"][:, :2]), r"splats\['scales'\]: shape \(10, 2\), expected \(10, 3\)"),
    (lambda s: s.update(opacities=s["opacities"].double()), r"splats\['opacities'\]: dtype torch.float64"),
    (lambda s: s["means"].__setitem__((3, 1), float("nan")), r"splats\['means'\]: contains NaN or inf"),
    (lambda s: s.update(shN=s["shN"][:, :8]), "sh_degree 3 needs 15 shN coefficients, splats\\['shN'\\] has 8"),
])
def test_bad_splats_are_named(garden, change, message):
    splats, cameras = garden
    bad = {k: v[:10].clone() for k, v in splats.items()}
    change(bad)
    with pytest.raises(RenderError, match=message):
        project(bad, cameras[0], 3)


@pytest.mark.parametrize("name,where", [("opacities", (2,)), ("scales", (2, 0)), ("sh0", (2, 0, 1)), ("quats", (2, 3))])
def test_a_non_finite_value_is_named_even_in_a_splat_the_view_culls(garden, name, where):
    """The CPU projection tests every row it reads before culling it (no separate pass over the
    batch): a NaN or inf in a Gaussian behind the camera still stops the projection, named, with
    or without the caller's own check."""
    splats, cameras = garden
    cam = cameras[0]
    bad = {k: v[:10].clone() for k, v in splats.items()}
    bad["means"][2] = torch.from_numpy((cam.center - 5.0 * cam.viewmat[2, :3]).astype(np.float32))  # behind it
    assert 2 not in project(bad, cam, 3).ids.tolist()
    bad[name][where] = float("inf") if name == "scales" else float("nan")
    for check in (True, False):
        with pytest.raises(RenderError, match=rf"splats\['{name}'\]: contains NaN or inf"):
            project(bad, cam, 3, check=check)


def test_nan_in_sh_coefficients_counts_only_where_the_degree_reads_them(garden):
    splats, cameras = garden
    small = {k: v[:10].clone() for k, v in splats.items()}
    small["shN"][5, 3, 1] = float("nan")  # the first coefficient of degree 2
    clean = {**small, "shN": small["shN"].nan_to_num(0.0)}
    for degree in (0, 1):  # NaN unread: the same projection as without it
        got, ref = project(small, cameras[0], degree), project(clean, cameras[0], degree)
        assert 5 in got.ids.tolist()
        torch.testing.assert_close(got.colors, ref.colors, rtol=0, atol=0)
    for degree in (2, 3):
        with pytest.raises(RenderError, match=r"splats\['shN'\]: contains NaN or inf"):
            project(small, cameras[0], degree)


def test_bad_sh_degree_and_backend(garden):
    splats, cameras = garden
    small = {k: v[:10] for k, v in splats.items()}
    with pytest.raises(RenderError, match="sh_degree 4: must be in 0..3"):
        project(small, cameras[0], 4)
    with pytest.raises(RenderError, match="backend 'cuda' needs the splats on a CUDA device"):
        project(small, cameras[0], 3, backend="cuda")
