"""`render = rasterize . project`, its meta, and the split across ranks through the wire formats."""
from __future__ import annotations

import pytest
import torch

from train.render import RenderError, Splats2D, pack_grads, project, project_batch, rasterize, render, unpack_grads
from train.render.scenes import load_garden
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS

PARAMS = ("means", "scales", "quats", "opacities", "sh0", "shN")


@pytest.fixture(scope="module")
def scene(shared_data):
    """A 20k-splat slice of the garden and one camera at half resolution (fast, still dense)."""
    splats, cameras = load_garden(shared_data / "test_garden.npz")
    rows = torch.randperm(len(splats["means"]), generator=torch.Generator().manual_seed(0))[:20000]
    return {k: v[rows].contiguous() for k, v in splats.items()}, cameras[0].scaled(2.0)


def fresh(splats: dict) -> dict:
    return {k: v.detach().clone().requires_grad_(True) for k, v in splats.items()}


def image_loss(rgb: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return (rgb * torch.rand(rgb.shape, generator=gen)).sum() + (alpha * torch.rand(alpha.shape, generator=gen)).sum()


def test_render_is_rasterize_after_project(scene):
    splats, cam = scene
    rgb, alpha, meta = render(fresh(splats), cam, 3, background=[0.1, 0.2, 0.3])
    with torch.no_grad():
        out = rasterize(project(splats, cam, 3), cam, torch.tensor([0.1, 0.2, 0.3]))
    assert torch.equal(rgb.detach(), out.rgb) and torch.equal(alpha.detach(), out.alpha)
    assert torch.equal(meta["contributed"], out.contributed) and torch.equal(meta["sat_depth"], out.sat_depth)
    assert set(meta) >= {"means2d", "radii", "ids", "contributed", "sat_depth"}
    m = len(meta["ids"])
    assert meta["means2d"].shape == (m, 2) and meta["radii"].shape == (m, 2) and meta["contributed"].shape == (m,)
    assert 0 < int(meta["contributed"].sum()) < m  # some splats in the frustum are hidden or too faint
    assert rgb.shape == (cam.height, cam.width, 3) and alpha.shape == (cam.height, cam.width, 1)


def test_only_contributing_splats_get_gradients(scene):
    splats, cam = scene
    params = fresh(splats)
    rgb, alpha, meta = render(params, cam, 3)
    image_loss(rgb, alpha).backward()
    grad2d = meta["means2d"].grad
    assert grad2d is not None and grad2d.shape == meta["means2d"].shape
    touched = params["opacities"].grad != 0  # (a colour clamped at 0 would hide sh0's gradient)
    contributed = torch.zeros(len(touched), dtype=torch.bool)
    contributed[meta["ids"][meta["contributed"]]] = True
    assert torch.equal(touched, contributed)
    assert (grad2d[~meta["contributed"]] == 0).all()


def test_split_across_ranks_gives_the_single_process_gradients(scene):
    """Two owners project their halves; the renderer receives one half through the wire format,
    rasterizes the union, returns 9-float gradients; both owners finish backward through their
    own projection. Parameters' gradients equal one process rendering everything."""
    splats, cam = scene
    single = fresh(splats)
    image_loss(*render(single, cam, 3)[:2]).backward()

    halves = [fresh({k: v[i::2] for k, v in splats.items()}) for i in range(2)]
    owners = [project_batch(h, [(0, cam, None)], 3) for h in halves]
    buf = owners[1].splats[0].pack()
    assert buf.shape == (len(owners[1].splats[0]), WIRE_FLOATS) and buf.dtype == torch.float32
    parts = [Splats2D.unpack(owners[0].splats[0].pack(), ids=owners[0].splats[0].ids), Splats2D.unpack(buf)]
    out = rasterize(Splats2D.cat(parts), cam)
    image_loss(out.rgb, out.alpha).backward()
    grads = [pack_grads(p) for p in parts]
    assert grads[1].shape == (len(parts[1]), GRAD_FLOATS)
    for owner, g in zip(owners, grads):
        owner.backward({0: g})

    for name in PARAMS:
        merged = torch.empty_like(single[name].grad)
        merged[0::2], merged[1::2] = halves[0][name].grad, halves[1][name].grad
        scale = single[name].grad.abs().max()
        assert (merged - single[name].grad).abs().max() <= 1e-5 * scale, name


def test_packed_gradients_are_the_leaves_gradients_packed(scene):
    """`packed_grads=True` (what the trainer asks for) hands over exactly what autograd would
    accumulate on the leaves and `pack_grads` would gather, for a union of two parts split by
    rows afterwards; the leaves are left without gradients."""
    splats, cam = scene
    owner = project_batch(splats, [(0, cam, None)], 3).splats[0]
    half = len(owner) // 2
    results = []
    for packed in (False, True):
        parts = [owner.select(torch.arange(half)).as_leaves(), owner.select(torch.arange(half, len(owner))).as_leaves()]
        out = rasterize(Splats2D.cat(parts), cam, absgrad=True, packed_grads=packed)
        image_loss(out.rgb, out.alpha).backward()
        if packed:
            assert all(t.grad is None for p in parts for t in p.differentiable())
            results.append(list(torch.split(out.packed_grads(), [half, len(owner) - half])))
        else:
            assert out.packed_grads is None
            results.append([pack_grads(p) for p in parts])
        results[-1].append(out.absgrad())
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert (results[1][0] != 0).any() and (results[1][1] != 0).any()


def test_batch_projection_matches_a_projection_per_camera(shared_data):
    """An owner's fused projection into several cameras, each seeing some rows of the batch,
    against `project` of those rows camera by camera through autograd: the same splats, and the
    same parameter gradients summed over the cameras."""
    splats, cameras = load_garden(shared_data / "test_garden.npz")
    gen = torch.Generator().manual_seed(1)
    rows = torch.randperm(len(splats["means"]), generator=gen)[:6000]
    splats = {k: v[rows].contiguous() for k, v in splats.items()}
    n = len(splats["means"])
    views = [(0, cameras[0].scaled(4.0), None),
             (2, cameras[1].scaled(4.0), torch.randperm(n, generator=gen)[: n // 2].sort().values.numpy()),
             (5, cameras[2].scaled(4.0), torch.arange(n // 3, n).numpy())]
    ours, ref = fresh(splats), fresh(splats)
    batch = project_batch(ours, views, 3)
    assert sorted(batch.splats) == [0, 2, 5]
    weights = {i: torch.rand(len(batch.splats[i]), GRAD_FLOATS, generator=gen) - 0.5 for i in batch.splats}
    batch.backward(weights)
    for i, cam, r in views:
        r = torch.arange(n) if r is None else torch.from_numpy(r)
        expected = project({k: v[r] for k, v in ref.items()}, cam, 3)
        got = batch.splats[i]
        assert torch.equal(got.ids, r[expected.ids]) and len(got) > 100
        for field in ("means2d", "conics", "depths", "opacities", "colors", "radii"):
            assert torch.equal(getattr(got, field), getattr(expected, field).detach()), (i, field)
        outs = expected.differentiable()
        torch.autograd.backward(list(outs), [g.reshape(t.shape) for t, g in zip(outs, unpack_grads(weights[i]))])
    for name in PARAMS:
        torch.testing.assert_close(ours[name].grad, ref[name].grad, rtol=1e-5, atol=1e-6 * ref[name].grad.abs().max())
    with pytest.raises(RenderError, match=r"camera 2: gradients of shape"):
        batch.backward({2: torch.zeros(3, GRAD_FLOATS)})


def test_kept_splats_as_leaves_are_the_wire_round_trip(scene):
    """A rank keeps its own splats as leaves without packing them (`as_leaves`); rasterized, they
    give the same image and the same gradients to send back, bit for bit, as `unpack(pack())`."""
    splats, cam = scene
    s = project_batch(fresh(splats), [(0, cam, None)], 3).splats[0]
    wire, kept = Splats2D.unpack(s.pack(), ids=s.ids), s.as_leaves()
    outs = []
    for leaves in (wire, kept):
        out = rasterize(leaves, cam)
        image_loss(out.rgb, out.alpha).backward()
        outs.append((out.rgb.detach(), pack_grads(leaves)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[1][1].abs().sum() > 0 and torch.equal(kept.ids, s.ids) and torch.equal(kept.radii, s.radii)
    assert all(t.is_leaf and t.requires_grad for t in kept.differentiable())


def test_wire_format_round_trip(scene):
    splats, cam = scene
    s = project(splats, cam, 3)
    back = Splats2D.unpack(s.pack(), ids=s.ids, requires_grad=False)
    for a, b in zip((s.means2d, s.conics, s.depths, s.opacities, s.colors, s.radii, s.ids),
                    (back.means2d, back.conics, back.depths, back.opacities, back.colors, back.radii, back.ids)):
        assert torch.equal(a.detach(), b)
    with pytest.raises(RenderError, match=r"splat buffer: shape \(4, 11\), expected \[M, 12\]"):
        Splats2D.unpack(torch.zeros(4, 11))
    with pytest.raises(RenderError, match=r"gradient buffer: shape \(4, 12\), expected \[M, 9\]"):
        unpack_grads(torch.zeros(4, 12))


def test_select_keeps_the_graph(scene):
    splats, cam = scene
    params = fresh(splats)
    s = project(params, cam, 3)
    first = s.select(torch.arange(len(s)) < 10)
    first.colors.sum().backward()
    assert int((params["sh0"].grad.abs().sum((1, 2)) > 0).sum()) == 10


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backend_matches_cpu(shared_data):
    from tools.gpu_check import compare_backends

    report = compare_backends(shared_data / "test_garden.npz")
    assert report["image_max_abs"] < 1e-3, report
    assert report["alpha_max_abs"] < 1e-3, report
    assert report["contributed_mismatch"] < 1e-3, report
    for name in PARAMS:
        assert report[f"grad_{name}_rel"] < 1e-2, report
