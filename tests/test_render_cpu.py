"""The CPU tile rasterizer against the dense torch reference, finite differences and edge cases."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from train.camera import Camera
from train.render import RenderError, Splats2D, rasterize
from train.render.cpu.binning import bin_tiles
from train.render.cpu import kernels
from train.render.cpu.ellipse import (
    CA, CB, CC, DEGENERATE, DEPTH, HALF_X, HALF_Y, LEVEL, MX, MY, tile_box,
)
from train.render.reference import rasterize_dense
from train.render.semantics import ALPHA_MIN, RADIUS_SIGMAS
from train.render.visibility import tile_visibility

BACKGROUND = torch.tensor([0.2, 0.5, 0.9])


def camera(width: int, height: int) -> Camera:
    return Camera(np.eye(4), np.array([[50.0, 0, width / 2], [0, 50.0, height / 2], [0, 0, 1]]), width, height)


def support_radii(conics: torch.Tensor, opacities: torch.Tensor) -> torch.Tensor:  # [M, 3], [M] -> [M, 2]
    """gsplat's opacity-aware radii, ceil(min(3.33, sqrt(2 ln(255 o))) * sigma), from the conics."""
    c = conics.double()
    det = c[:, 0] * c[:, 2] - c[:, 1] ** 2
    var = torch.stack([c[:, 2] / det, c[:, 0] / det], -1)
    extend = torch.sqrt(2 * torch.log(torch.clamp_min(opacities.double() / ALPHA_MIN, 1.0))).clamp_max(RADIUS_SIGMAS)
    return torch.ceil(extend[:, None] * torch.sqrt(var)).to(torch.int32)


def random_splats(m: int, width: int, height: int, seed: int, opacity_max: float = 1.0,
                  spread: float = 1.2, size: float = 3.0, min_var: float = 0.3) -> Splats2D:
    """Splats as projection makes them: PD conics from covariances with eps2d, opacity-aware radii."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.tensor([width, height], dtype=torch.float64) / 2
    means2d = centre + (torch.rand(m, 2, generator=gen, dtype=torch.float64) - 0.5) * centre * 2 * spread
    L = torch.randn(m, 2, 2, generator=gen, dtype=torch.float64) * size
    cov = L @ L.transpose(1, 2) + min_var * torch.eye(2, dtype=torch.float64)
    inv = torch.linalg.inv(cov)
    opacities = torch.rand(m, generator=gen, dtype=torch.float64) * opacity_max
    conics = torch.stack([inv[:, 0, 0], inv[:, 0, 1], inv[:, 1, 1]], -1)
    return Splats2D(means2d.float(), conics.float(),
                    (torch.rand(m, generator=gen, dtype=torch.float64) * 10 + 0.1).float(), opacities.float(),
                    torch.rand(m, 3, generator=gen, dtype=torch.float64).float(), support_radii(conics, opacities),
                    torch.arange(m))


def leaves(splats: Splats2D, dtype: torch.dtype) -> Splats2D:
    """A copy whose differentiable fields are leaves of `dtype` requiring grad."""
    diff = [t.detach().to(dtype).clone().requires_grad_(True) for t in splats.differentiable()]
    return Splats2D(diff[0], diff[1], splats.depths.to(dtype), diff[2], diff[3], splats.radii, splats.ids)


def weighted_loss(out, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w_rgb = torch.randn(out.rgb.shape, generator=gen, dtype=torch.float64)
    w_alpha = torch.randn(out.alpha.shape, generator=gen, dtype=torch.float64)
    return (out.rgb.double() * w_rgb).sum() + (out.alpha.double() * w_alpha).sum()


def run_both(splats: Splats2D, width: int, height: int):
    """(kernel output, kernel leaves, float64 reference output, reference leaves), both backpropagated."""
    ours, ref = leaves(splats, torch.float32), leaves(splats, torch.float64)
    out = rasterize(ours, camera(width, height), BACKGROUND)
    expected = rasterize_dense(ref, width, height, BACKGROUND)
    weighted_loss(out).backward()
    weighted_loss(expected).backward()
    return out, ours, expected, ref


def assert_matches_reference(splats: Splats2D, width: int, height: int) -> None:
    out, ours, expected, ref = run_both(splats, width, height)
    assert out.rgb.shape == (height, width, 3) and out.alpha.shape == (height, width, 1)
    torch.testing.assert_close(out.rgb.double(), expected.rgb, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.alpha.double(), expected.alpha, atol=1e-4, rtol=0)
    assert torch.equal(out.contributed, expected.contributed)
    assert torch.equal(torch.isinf(out.sat_depth), torch.isinf(expected.sat_depth))
    finite = torch.isfinite(expected.sat_depth)
    torch.testing.assert_close(out.sat_depth[finite].double(), expected.sat_depth[finite])
    for name, mine, theirs in zip(("means2d", "conics", "opacities", "colors"), ours.differentiable(),
                                  ref.differentiable()):
        scale = theirs.grad.abs().max().clamp_min(1e-6)
        err = (mine.grad.double() - theirs.grad).abs().max() / scale
        assert err < 2e-4, f"{name}: gradient off by {err:.2e} of its largest entry"


@pytest.mark.parametrize("width,height,m", [(45, 37, 300), (64, 48, 200), (17, 33, 60), (1, 1, 20), (16, 1, 30)])
def test_matches_dense_reference(width, height, m):
    assert_matches_reference(random_splats(m, width, height, seed=width * 31 + height), width, height)


def shaped(splats: Splats2D, major: float, minor: float, seed: int) -> Splats2D:
    """The same splats with covariances of the given axis lengths (pixels) at random angles."""
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(len(splats.ids), generator=gen, dtype=torch.float64) * math.pi
    rot = torch.stack([torch.cos(angle), -torch.sin(angle), torch.sin(angle), torch.cos(angle)], -1).view(-1, 2, 2)
    cov = rot @ torch.diag(torch.tensor([major ** 2, minor ** 2], dtype=torch.float64)) @ rot.transpose(1, 2)
    inv = torch.linalg.inv(cov)
    conics = torch.stack([inv[:, 0, 0], inv[:, 0, 1], inv[:, 1, 1]], -1)
    return replace(splats, conics=conics.float(), radii=support_radii(conics, splats.opacities))


def stepped_fraction(splats: Splats2D, width: int, height: int) -> float:
    """The share of (splat, half tile) boxes whose exp(-sigma) the kernels step down the rows."""
    arrays = [t.numpy() for t in (splats.means2d, splats.conics, splats.opacities, splats.colors, splats.depths)]
    bins = bin_tiles(*arrays, splats.radii.numpy(), width, height)
    stepped = total = 0
    for tile in range(len(bins.offsets) - 1):
        x0, y0 = tile % bins.tiles_x * 16, tile // bins.tiles_x * 16
        w, h = min(16, width - x0), min(16, height - y0)
        for g in bins.gids[bins.offsets[tile]:bins.offsets[tile + 1]]:
            r = bins.records[g]
            mx, my = r[MX] - np.float32(x0), r[MY] - np.float32(y0)
            xa, xb, ya, yb = tile_box(r[HALF_X], r[HALF_Y], mx, my, w, h)
            for half in range(xa // 8, (xb + 7) // 8):
                total += 1
                stepped += kernels._steps_safely(r[HALF_Y] < DEGENERATE, r[CA], r[CB], r[CC], mx, my, half, ya, yb)
    return stepped / total


def exact_tiles(bins, width: int, height: int) -> tuple[set, dict]:
    """Brute force in float64: the (record, tile) pairs of gsplat's radius box whose pixel centres
    the support ellipse (sigma <= LEVEL) reaches, and each candidate's least sigma over its centres."""
    reached, least = set(), {}
    for i, r in enumerate(bins.records.astype(np.float64)):
        t = bins.tiles_x
        for tile in range(len(bins.offsets) - 1):
            x0, y0 = tile % t * 16, tile // t * 16
            xs = np.arange(x0, min(x0 + 16, width)) + 0.5
            ys = np.arange(y0, min(y0 + 16, height)) + 0.5
            dx, dy = r[MX] - xs[None, :], r[MY] - ys[:, None]
            sigma = 0.5 * (r[CA] * dx * dx + r[CC] * dy * dy) + r[CB] * dx * dy
            least[i, tile] = sigma.min() if r[HALF_Y] < DEGENERATE else -np.inf
            if least[i, tile] <= r[LEVEL]:
                reached.add((i, tile))
    return reached, least


@pytest.mark.parametrize("shape", ["round", "needles", "large"])
def test_tile_lists_hold_every_tile_the_ellipse_reaches(shape):
    """Binning keeps a candidate tile where the support ellipse reaches one of its pixel centres
    (brute force over every centre), drops the rest but for near misses within its widening, and
    orders each list front to back."""
    width, height = 70, 53
    base = random_splats(80, width, height, seed=5, spread=1.4)
    splats = {"round": shaped(base, 6.0, 5.0, seed=3), "needles": shaped(base, 30.0, 0.4, seed=4),
              "large": shaped(base, 25.0, 9.0, seed=6)}[shape]
    arrays = [t.numpy() for t in (splats.means2d, splats.conics, splats.opacities, splats.colors, splats.depths)]
    bins = bin_tiles(*arrays, splats.radii.numpy(), width, height)
    listed = {(int(g), tile) for tile in range(len(bins.offsets) - 1)
              for g in bins.gids[bins.offsets[tile]:bins.offsets[tile + 1]]}
    reached, least = exact_tiles(bins, width, height)
    assert reached and reached <= listed, f"tiles reached but not listed: {sorted(reached - listed)[:5]}"
    near = [least[pair] - bins.records[pair[0], LEVEL] for pair in listed - reached]
    assert len(near) <= 0.02 * len(listed) and all(d < 0.5 for d in near), near
    for tile in range(len(bins.offsets) - 1):
        assert np.all(np.diff(bins.records[bins.gids[bins.offsets[tile]:bins.offsets[tile + 1]], DEPTH]) >= 0)


def test_stepped_and_evaluated_exponentials_match_the_reference():
    """Wide round splats take the path that steps exp(-sigma) down the rows; thin needles at any
    angle (sigma in their box reaches thousands) evaluate it per pixel. Both, and both mixed in one
    image, match the reference."""
    base = random_splats(120, 48, 40, seed=21, opacity_max=0.6)
    round_, needles = shaped(base, 6.0, 5.0, seed=1), shaped(base, 12.0, 0.4, seed=2)
    assert stepped_fraction(round_, 48, 40) > 0.95
    assert stepped_fraction(needles, 48, 40) < 0.2
    assert_matches_reference(round_, 48, 40)
    assert_matches_reference(needles, 48, 40)
    assert_matches_reference(Splats2D.cat([round_, needles]), 48, 40)


def test_saturated_pixels_stop_like_the_reference():
    """Opaque, overlapping splats: most pixels terminate early, whole tiles exit, alpha hits its clamp."""
    splats = random_splats(400, 40, 40, seed=7, size=6.0)
    splats.opacities = torch.full_like(splats.opacities, 1.0)
    splats.radii = support_radii(splats.conics, splats.opacities)
    out, _, expected, _ = run_both(splats, 40, 40)
    assert torch.isfinite(out.sat_depth).float().mean() > 0.5
    assert_matches_reference(splats, 40, 40)


def test_splats_across_borders_and_off_screen():
    splats = random_splats(150, 33, 20, seed=3, spread=2.5, size=5.0)
    assert (splats.means2d[:, 0] < 0).any() and (splats.means2d[:, 0] > 33).any()
    assert_matches_reference(splats, 33, 20)


def test_degenerate_conic_is_evaluated_per_pixel():
    """A conic that is not positive definite has no bounded support: every pixel of its radius box
    is tested, and the pixels where sigma < 0 are skipped, as in gsplat."""
    splats = random_splats(30, 32, 32, seed=5)
    splats.conics[0] = torch.tensor([0.05, 0.2, 0.05])  # b^2 > a c
    splats.radii[0] = torch.tensor([40, 40], dtype=torch.int32)
    assert_matches_reference(splats, 32, 32)


def test_equal_depths_are_ordered_by_content_not_row():
    """Ties in depth must not depend on row order, or renders split across ranks would differ."""
    splats = random_splats(60, 24, 24, seed=11, spread=0.3)
    splats.depths = torch.ones_like(splats.depths)
    assert_matches_reference(splats, 24, 24)
    shuffled = splats.select(torch.randperm(60, generator=torch.Generator().manual_seed(0)))
    first, second = rasterize(splats, camera(24, 24)), rasterize(shuffled, camera(24, 24))
    assert torch.equal(first.rgb, second.rgb)


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_the_depth_sort_is_a_stable_sort_by_depth_then_content(chunks):
    """`binning._argsort_depth` (radix passes, then the runs of equal depth sorted by content, runs
    split over `chunks` threads) against numpy's stable lexsort on depth, mean x, mean y, opacity,
    conic a, b, c, red, green, blue; rows equal in all of them keep their order. Depths and keys
    are drawn from a few values, so there are long runs, runs across the chunks' bounds, and
    ties in the tie keys themselves."""
    from train.render.cpu.binning import _argsort_depth

    rng = np.random.default_rng(chunks)
    m = 5000
    depths = (rng.integers(0, 40, m) * 0.25 - 2.0).astype(np.float32)  # negatives and zero too
    means2d = rng.integers(0, 3, (m, 2)).astype(np.float32)
    conics = rng.integers(0, 2, (m, 3)).astype(np.float32)
    opacities = rng.integers(0, 2, m).astype(np.float32)
    colors = rng.integers(0, 2, (m, 3)).astype(np.float32)
    order = _argsort_depth(means2d, conics, opacities, colors, depths, chunks)
    keys = [colors[:, 2], colors[:, 1], colors[:, 0], conics[:, 2], conics[:, 1], conics[:, 0], opacities,
            means2d[:, 1], means2d[:, 0], depths]
    np.testing.assert_array_equal(order, np.lexsort(keys))


def test_finite_differences():
    """Directional derivatives of the kernels' own forward pass against their backward pass, on a
    scene where compositing is smooth: every splat reaches every pixel with alpha well above 1/255
    and below the 0.999 clamp, and no pixel terminates (crossing those thresholds is a jump)."""
    splats = random_splats(8, 16, 12, seed=2, spread=0.5, size=3.0, min_var=40.0)
    splats.opacities = 0.2 + 0.4 * splats.opacities
    corners = torch.tensor([[0.5, 0.5], [15.5, 0.5], [0.5, 11.5], [15.5, 11.5]])
    d = splats.means2d[:, None, :] - corners  # sigma is convex: its maximum over the image is at a corner
    c = splats.conics[:, None, :]
    sigma = 0.5 * (c[..., 0] * d[..., 0] ** 2 + c[..., 2] * d[..., 1] ** 2) + c[..., 1] * d[..., 0] * d[..., 1]
    assert (splats.opacities * torch.exp(-sigma.max(1).values) > 2 * ALPHA_MIN).all()
    splats = leaves(splats, torch.float32)
    cam = camera(16, 12)
    out = rasterize(splats, cam, BACKGROUND)
    assert torch.isinf(out.sat_depth).all()
    weighted_loss(out).backward()
    gen = torch.Generator().manual_seed(0)
    for name, step in (("means2d", 2e-2), ("conics", 1e-4), ("opacities", 1e-2), ("colors", 1e-2)):
        base = getattr(splats, name)
        direction = torch.randn(base.shape, generator=gen)

        def loss_at(t: float) -> float:
            with torch.no_grad():
                moved = replace(splats, **{name: base + t * direction})
                return weighted_loss(rasterize(moved, cam, BACKGROUND)).item()

        numeric = (loss_at(step) - loss_at(-step)) / (2 * step)
        analytic = float((base.grad.double() * direction).sum())
        assert math.isclose(numeric, analytic, rel_tol=1e-3, abs_tol=1e-4), (name, numeric, analytic)


def test_empty_scene_is_background():
    out = rasterize(Splats2D.empty(), camera(20, 10), BACKGROUND)
    torch.testing.assert_close(out.rgb, BACKGROUND.expand(10, 20, 3))
    assert float(out.alpha.abs().max()) == 0.0
    assert torch.isinf(out.sat_depth).all() and out.contributed.shape == (0,)


def test_invisible_splats_contribute_nothing():
    """Opacity below 1/255 can never pass the alpha test: the image is the background and no
    splat is marked as contributing (so sparse Adam would step none)."""
    splats = leaves(random_splats(40, 20, 20, seed=4), torch.float32)
    with torch.no_grad():
        splats.opacities.fill_(0.5 / 255)
    out = rasterize(splats, camera(20, 20), BACKGROUND)
    torch.testing.assert_close(out.rgb, BACKGROUND.expand(20, 20, 3))
    assert not out.contributed.any()
    (out.rgb.sum() + out.alpha.sum()).backward()
    assert float(splats.means2d.grad.abs().max()) == 0.0


def test_visibility_scan_matches_the_kernel():
    """The torch replay the cuda backend uses for `contributed` and `sat_depth`, on our own tile lists."""
    splats = random_splats(500, 50, 40, seed=9, size=5.0)
    out = rasterize(splats, camera(50, 40), BACKGROUND)
    arrays = [t.numpy() for t in (splats.means2d, splats.conics, splats.opacities, splats.colors, splats.depths)]
    bins = bin_tiles(*arrays, splats.radii.numpy(), 50, 40)
    contributed, sat_depth = tile_visibility(splats.means2d, splats.conics, splats.opacities, splats.depths,
                                             torch.from_numpy(bins.offsets), torch.from_numpy(bins.rows()), 50, 40)
    assert torch.equal(contributed, out.contributed)
    assert torch.equal(sat_depth, out.sat_depth)


def held_bytes(obj) -> int:
    """Bytes of the numpy arrays in `obj` (a tuple, or an object's attributes), one level down."""
    items = obj if isinstance(obj, tuple) else vars(obj).values()
    return sum(a.nbytes if isinstance(a, np.ndarray) else held_bytes(a) if hasattr(a, "__dict__") else 0
               for a in items)


def test_backward_state_does_not_grow_with_pixels_times_splats():
    """Backward recomputes instead of storing per-(pixel, splat) lists: what the graph holds is a
    record per splat, an entry per tile intersection and a few values per pixel."""
    m, size = 3000, 64
    splats = leaves(random_splats(m, size, size, seed=8, size=8.0), torch.float32)
    out = rasterize(splats, camera(size, size), BACKGROUND)
    state = out.rgb.grad_fn.state
    n_isects = state[0].n_isects
    assert n_isects > m
    tiles = (size // 16) ** 2
    assert held_bytes(state) <= 96 * m + 16 * n_isects + 8 * size * size + 16 * (tiles + 1) + 12


@pytest.mark.parametrize("field,where,value", [
    ("means2d", (2, 0), float("nan")),
    ("conics", (2, 0), float("inf")),
    ("depths", (2,), float("-inf")),
    ("opacities", (2,), float("nan")),
    ("colors", (2, 2), float("nan")),
    ("means2d", (4, 1), float("nan")),  # in a splat with zero radii, which no tile takes
])
def test_rejects_non_finite(field, where, value):
    """Any field, also in a splat that no tile takes, stops the rasterizer with the field named."""
    splats = random_splats(5, 8, 8, seed=0)
    splats.radii[4] = 0
    getattr(splats, field)[where] = value
    with pytest.raises(RenderError, match=rf"splats2d\.{field}: contains NaN or inf"):
        rasterize(splats, camera(8, 8), BACKGROUND)


def test_rejects_mismatched_lengths_and_backgrounds():
    splats = random_splats(5, 8, 8, seed=0)
    splats.colors = splats.colors[:4]
    with pytest.raises(RenderError, match=r"colors: shape \(4, 3\), expected \(5, 3\)"):
        rasterize(splats, camera(8, 8))
    with pytest.raises(RenderError, match="background: shape"):
        rasterize(random_splats(5, 8, 8, seed=0), camera(8, 8), [0.0, 1.0])
    with pytest.raises(RenderError, match="background: contains NaN"):
        rasterize(random_splats(5, 8, 8, seed=0), camera(8, 8), [0.0, float("nan"), 1.0])
    with pytest.raises(RenderError, match="background: "):
        rasterize(random_splats(5, 8, 8, seed=0), camera(8, 8), "red")
    with pytest.raises(RenderError, match="unknown render backend 'opengl'"):
        rasterize(random_splats(5, 8, 8, seed=0), camera(8, 8), backend="opengl")
    with pytest.raises(RenderError, match="backend 'cuda' needs the splats on a CUDA device"):
        rasterize(random_splats(5, 8, 8, seed=0), camera(8, 8), backend="cuda")


def test_absgrad_is_the_sum_of_absolute_per_pixel_gradients():
    """`rasterize(..., absgrad=True)` (gsplat's absgrad, for AbsGS densification): per splat and
    2D mean component, the sum over pixels of the absolute gradient of that pixel's loss, against
    the dense reference differentiated pixel by pixel; the ordinary gradients stay as they were."""
    width, height = 16, 12
    splats = random_splats(40, width, height, seed=7, size=1.5)
    plain, with_abs, ref = (leaves(splats, d) for d in (torch.float32, torch.float32, torch.float64))
    out_plain = rasterize(plain, camera(width, height), BACKGROUND)
    out = rasterize(with_abs, camera(width, height), BACKGROUND, absgrad=True)
    weighted_loss(out_plain).backward()
    weighted_loss(out).backward()
    for a, b in zip(plain.differentiable(), with_abs.differentiable()):
        assert torch.equal(a.grad, b.grad)
    assert out_plain.absgrad is None
    absgrad = out.absgrad()
    expected = rasterize_dense(ref, width, height, BACKGROUND)
    gen = torch.Generator().manual_seed(1)  # weighted_loss's weights, per pixel
    w_rgb = torch.randn(expected.rgb.shape, generator=gen, dtype=torch.float64)
    w_alpha = torch.randn(expected.alpha.shape, generator=gen, dtype=torch.float64)
    per_pixel = (expected.rgb * w_rgb).sum(-1) + (expected.alpha * w_alpha)[..., 0]  # [H, W]
    total = torch.zeros(len(splats), 2, dtype=torch.float64)
    for value in per_pixel.reshape(-1):
        (g,) = torch.autograd.grad(value, ref.means2d, retain_graph=True)
        total += g.abs()
    assert (total > 0).sum() > 30
    torch.testing.assert_close(absgrad.double(), total, rtol=2e-4, atol=2e-4 * float(total.max()))
    # |sum| <= sum |.|, strictly where pixels pull a splat both ways
    assert (with_abs.means2d.grad.abs() <= absgrad + 1e-5).all()
    assert (with_abs.means2d.grad.abs() < 0.9 * absgrad).any()
