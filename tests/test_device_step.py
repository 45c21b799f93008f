"""The step's device path (issue 18): Adam over a whole batch, the densification statistics and the
blocks' extent boxes computed with torch ops, so on a GPU nothing but one small copy a step leaves
the device. Run here on CPU tensors, against torch's own Adam, the compiled host path and numpy."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from octree.bounds import extent_boxes
from storage.schema import PARAM_NAMES, empty_state, param_shapes
from train.camera import Camera
from train.optim import AdamConfig, LazyDense, SparseAdam, adam_batch, learning_rates, numpy_arrays
from train.stats import DeviceStats, accumulate_stats, empty_stats
from train.step import (Back, Backprop, Gathered, Paged, Projected, StepStats, _extent_boxes_device, adam_update,
                        backprop_owned, gather)

SH_DEGREE = 1


def _block(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {name: torch.randn((n, *shape), generator=g) for name, shape in param_shapes(SH_DEGREE).items()}
    t.update({k: torch.from_numpy(v) for k, v in empty_state(n, SH_DEGREE).items()})
    return t


def _copy(blocks: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in blocks]


def _batched_step(blocks, grads, mask, lrs, cfg, global_step=0) -> None:
    """The trainer's use: the batch's parameters are the blocks' rows joined (a lone block's own)."""
    params = {n: blocks[0][n] if len(blocks) == 1 else torch.cat([b[n] for b in blocks]) for n in PARAM_NAMES}
    adam_batch(blocks, params, grads, mask, lrs, cfg, global_step)


@pytest.mark.parametrize("sizes", [(7,), (3, 1, 3)])
def test_every_row_every_step_is_torch_adam(sizes):
    cfg = AdamConfig()
    lrs = learning_rates(cfg, 0, 100, scene_scale=2.0)
    blocks = [_block(n, seed=i) for i, n in enumerate(sizes)]
    joined = {n: torch.cat([b[n] for b in blocks]) for n in PARAM_NAMES}
    ref = {n: joined[n].clone().requires_grad_(True) for n in PARAM_NAMES}
    opt = torch.optim.Adam([{"params": [ref[n]], "lr": lrs[n]} for n in PARAM_NAMES], betas=cfg.betas, eps=cfg.eps)
    g = torch.Generator().manual_seed(1)
    m = sum(sizes)
    for _ in range(5):
        grads = {n: torch.randn(joined[n].shape, generator=g) for n in PARAM_NAMES}
        _batched_step(blocks, grads, torch.ones(m, dtype=torch.bool), lrs, cfg)
        for n in PARAM_NAMES:
            ref[n].grad = grads[n].clone()
        opt.step()
    for n in PARAM_NAMES:
        torch.testing.assert_close(torch.cat([b[n] for b in blocks]), ref[n].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.cat([b[f"exp_avg_sq_{n}"] for b in blocks]), opt.state[ref[n]]["exp_avg_sq"])
    assert torch.cat([b["adam_step"] for b in blocks]).tolist() == [5] * m


@pytest.mark.parametrize("global_step", [0, 1])
def test_a_masked_batch_equals_the_compiled_host_path(global_step):
    """Rows masked on some steps only (some never), SH coefficients above the degree in use with a
    zero gradient, three blocks: the batch against `SparseAdam`'s compiled per-block step."""
    cfg = AdamConfig()
    lrs = learning_rates(cfg, 0, 100, scene_scale=1.0)
    sizes, m = (5, 9, 2), 16
    blocks = [_block(n, seed=10 + i) for i, n in enumerate(sizes)]
    host = _copy(blocks)
    g = torch.Generator().manual_seed(4)
    for step in range(1, 7):
        grads = {n: torch.randn((m, *blocks[0][n].shape[1:]), generator=g) for n in PARAM_NAMES}
        grads["shN"][:, 1:] = 0.0  # above the degree in use: zero columns the host path skips
        mask = torch.rand(m, generator=g) < 0.6
        mask[3] = False  # never stepped: its bias correction would divide by zero
        before = _copy(blocks)
        _batched_step(blocks, grads, mask, lrs, cfg, global_step * step)
        opt = SparseAdam(grads, mask, lrs, cfg, global_step * step, grad_columns={"shN": 3})
        for b, lo in zip(host, np.cumsum((0,) + sizes[:-1])):
            opt.step(b, int(lo), numpy_arrays(b))
        rows = 0
        for b, old in zip(blocks, before):  # unmasked rows keep every bit
            keep = ~mask[rows:rows + len(b["means"])]
            for k in b:
                assert torch.equal(b[k][keep], old[k][keep]), k
            rows += len(b["means"])
    for b, ref in zip(blocks, host):
        assert torch.equal(b["adam_step"], ref["adam_step"])
        for k in b:
            torch.testing.assert_close(b[k], ref[k], rtol=2e-6, atol=1e-7, msg=k)
    assert blocks[0]["adam_step"][3] == 0
    assert not torch.equal(blocks[0]["means"], _block(5, seed=10)["means"])


def _camera(w: int, h: int) -> Camera:
    return Camera(np.eye(4), np.array([[w, 0, w / 2], [0, w, h / 2], [0, 0, 1.0]]), w, h)


def test_device_statistics_equal_the_compiled_ones():
    n, g = 50, torch.Generator().manual_seed(2)
    cameras = [_camera(64, 48), _camera(30, 90), _camera(16, 16)]
    host, dev = empty_stats(n), DeviceStats(n, torch.device("cpu"))
    for cam in cameras:
        ids = torch.randperm(n, generator=g)[:30]
        radii = torch.randint(0, 40, (30, 2), generator=g, dtype=torch.int32)
        grads = torch.randn(30, 9, generator=g) * 1e-3
        accumulate_stats(host, ids, radii, grads, cam, len(cameras))
        dev.add(ids, radii, grads, cam, len(cameras))
    assert np.array_equal(dev.count.numpy(), host["count"])
    assert np.array_equal(dev.max_radii.numpy(), host["max_radii"])
    np.testing.assert_allclose(dev.grad2d.numpy(), host["grad2d"], rtol=1e-6)
    assert (host["count"] > 1).any() and (host["grad2d"] > 0).all() == (host["count"] > 0).all()


def test_device_extent_boxes_equal_numpy():
    blocks = {f"b{i}": _block(n, seed=i) for i, n in enumerate((4, 1, 9))}
    blocks["b1"]["scales"][0, 2] = 800.0  # exp overflows: the box is clipped to the largest float
    boxes = _extent_boxes_device(blocks).numpy()
    means, scales = (torch.cat([b[k] for b in blocks.values()]).numpy() for k in ("means", "scales"))
    ref = extent_boxes(means, scales, np.array([0, 4, 5]))
    np.testing.assert_allclose(boxes, ref, rtol=1e-14)
    assert np.isfinite(boxes).all() and boxes[1, 5] == np.finfo(np.float64).max


class _Cache:
    def __init__(self) -> None:
        self.dirty: list[str] = []

    def mark_dirty(self, key: str) -> None:
        self.dirty.append(key)


def _update(blocks: dict[str, dict[str, torch.Tensor]], batched: bool | None, mode_visible: bool,
            device: str = "cpu"):
    """One `adam_update` of a batch seen by two cameras; block b2 is seen by neither."""
    keys = list(blocks)
    cached = {k: SimpleNamespace(arrays=lambda make, t=blocks[k]: make(t)) for k in keys}
    paged = Paged(keys, [keys, keys], cached, blocks)
    gathered = gather(blocks, keys, requires_grad=True)
    g = torch.Generator().manual_seed(7)
    for p in gathered.params.values():
        p.grad = torch.randn(p.shape, generator=g).to(device)
    owned = {0: SimpleNamespace(ids=torch.tensor([0, 2, 5, 6], device=device),
                                radii=torch.tensor([[3, 4], [1, 1], [9, 2], [5, 5]], device=device)),
             1: SimpleNamespace(ids=torch.tensor([5, 1], device=device), radii=torch.tensor([[7, 7], [2, 3]], device=device))}
    back = {i: Back(torch.randn(len(o.ids), 9, generator=g).to(device),
                    (torch.rand(len(o.ids), generator=g) < 0.7).to(device), None)
            for i, o in owned.items()}
    contributed = torch.zeros(gathered.offsets[-1], dtype=torch.bool, device=device)
    for i, b in back.items():
        contributed[owned[i].ids] |= torch.ones_like(b.contributed) if mode_visible else b.contributed
    projected = Projected(gathered, None, owned, SH_DEGREE)
    stats, cache = StepStats(), _Cache()
    cfg = AdamConfig()
    adam_update(paged, projected, Backprop(back, contributed), [_camera(32, 24), _camera(20, 20)], cache,
                learning_rates(cfg, 3, 100, 1.0), cfg, stats, global_step=3 if mode_visible else 0, batched=batched)
    return stats, cache.dirty


@pytest.mark.parametrize("mode_visible", [False, True])
def test_a_training_steps_update_on_the_device_path_equals_the_host_path(mode_visible):
    """`adam_update` with `batched` (the GPU's path) against the host path on the same batch: the
    same blocks changed and marked dirty (the unseen one neither), the same rows stepped and
    statistics, and the same extents within float rounding."""
    sizes = {"b0": 3, "b1": 4, "b2": 5}
    host = {k: _block(n, seed=20 + i) for i, (k, n) in enumerate(sizes.items())}
    dev = {k: {n: v.clone() for n, v in b.items()} for k, b in host.items()}
    s_host, dirty_host = _update(host, batched=False, mode_visible=mode_visible)
    s_dev, dirty_dev = _update(dev, batched=True, mode_visible=mode_visible)
    assert dirty_dev == dirty_host == ["b0", "b1"]
    assert s_dev.contributed == s_host.contributed > 0
    assert list(s_dev.extents) == list(s_host.extents) == ["b0", "b1"]
    np.testing.assert_allclose(np.array(list(s_dev.extents.values())), np.array(list(s_host.extents.values())),
                               rtol=1e-6)
    for k in sizes:
        for name in host[k]:
            torch.testing.assert_close(dev[k][name], host[k][name], rtol=2e-6, atol=1e-7, msg=f"{k} {name}")
    assert torch.equal(dev["b2"]["means"], _block(5, seed=22)["means"])
    assert dev["b1"]["count"].tolist() == [0, 0, 2, 1] and dev["b0"]["max_radii"][0] == 4 / 32


@pytest.mark.parametrize("mode", ["contributed", "visible", "dense"])
def test_rows_stepped_are_the_union_over_cameras(mode):
    """A Gaussian two cameras see is stepped when either makes it reach a pixel (the mask is built
    without boolean indexing, which would wait for a GPU)."""
    gathered = Gathered(["b"], [0, 6], {"means": torch.zeros(6, 3)})
    owned = {0: SimpleNamespace(ids=torch.tensor([4, 1, 2])), 1: SimpleNamespace(ids=torch.tensor([2, 4, 0]))}
    back = {0: Back(torch.zeros(3, 9), torch.tensor([True, False, True]), None),
            1: Back(torch.zeros(3, 9), torch.tensor([False, False, True]), None)}
    projected = Projected(gathered, SimpleNamespace(backward=lambda grads: None), owned, SH_DEGREE)
    stepped = backprop_owned(projected, back, mode).contributed
    want = {"contributed": [1, 0, 1, 0, 1, 0], "visible": [1, 1, 1, 0, 1, 0], "dense": [1] * 6}[mode]
    assert stepped.tolist() == [bool(x) for x in want]


@pytest.mark.parametrize("sizes", [(6,), (4, 2, 5)])
def test_dense_catch_up_of_a_batch_equals_the_compiled_one(sizes):
    """Dense Adam's put-off zero-gradient steps, taken for all blocks at once (the GPU's way),
    against the compiled per-row loop: rows behind by different counts, one up to date, one whose
    moments are zero."""
    cfg, steps = AdamConfig(), 30
    lazy = LazyDense(cfg, steps, scene_scale=1.5)
    g = torch.Generator().manual_seed(9)
    blocks = [_block(n, seed=30 + i) for i, n in enumerate(sizes)]
    for b in blocks:
        for name in PARAM_NAMES:
            b[f"exp_avg_{name}"].copy_(torch.randn(b[name].shape, generator=g) * 1e-2)
            b[f"exp_avg_sq_{name}"].copy_(torch.rand(b[name].shape, generator=g) * 1e-3)
        b["adam_step"].copy_(torch.randint(0, 20, b["adam_step"].shape, generator=g, dtype=torch.int32))
    blocks[0]["adam_step"][0] = 20  # up to date
    for name in PARAM_NAMES:  # no moments: stays as it is
        blocks[-1][f"exp_avg_{name}"][-1] = 0.0
        blocks[-1][f"exp_avg_sq_{name}"][-1] = 0.0
    host, before = _copy(blocks), _copy(blocks)
    want = [lazy.catch_up(b, 20, numpy_arrays(b)) for b in host]
    assert lazy.catch_up_batch(blocks, 20) == want and sum(want) > 0
    for b, ref, old in zip(blocks, host, before):
        assert torch.equal(b["adam_step"], ref["adam_step"])
        for k in b:
            torch.testing.assert_close(b[k], ref[k], rtol=2e-6, atol=1e-7, msg=k)
    assert torch.equal(blocks[0]["means"][0], before[0]["means"][0])
    assert torch.equal(blocks[-1]["means"][-1], before[-1]["means"][-1])
    assert not torch.equal(blocks[0]["means"], before[0]["means"])
    assert lazy.catch_up_batch(blocks, 20) == [0] * len(sizes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode_visible", [False, True])
def test_the_update_on_a_gpu_equals_the_host_path(mode_visible):
    """The trainer's choice on a GPU (`batched` left to the device) against the host path."""
    sizes = {"b0": 3, "b1": 4, "b2": 5}
    host = {k: _block(n, seed=20 + i) for i, (k, n) in enumerate(sizes.items())}
    dev = {k: {n: v.cuda() for n, v in b.items()} for k, b in host.items()}
    s_host, dirty_host = _update(host, batched=False, mode_visible=mode_visible)
    s_dev, dirty_dev = _update(dev, batched=None, mode_visible=mode_visible, device="cuda")
    assert dirty_dev == dirty_host and s_dev.contributed == s_host.contributed
    np.testing.assert_allclose(np.array(list(s_dev.extents.values())), np.array(list(s_host.extents.values())),
                               rtol=1e-6)
    for k in sizes:
        for name in host[k]:
            torch.testing.assert_close(dev[k][name].cpu(), host[k][name], rtol=2e-6, atol=1e-7, msg=f"{k} {name}")


def _update_many(blocks: dict[str, dict[str, torch.Tensor]], mode_visible: bool, seed: int = 9):
    """One host `adam_update` of many blocks seen by two cameras, each at a random tenth of the rows."""
    keys = list(blocks)
    cached = {k: SimpleNamespace(arrays=lambda make, t=blocks[k]: make(t)) for k in keys}
    paged = Paged(keys, [keys, keys], cached, blocks)
    gathered = gather(blocks, keys, requires_grad=True)
    g = torch.Generator().manual_seed(seed)
    for p in gathered.params.values():
        p.grad = torch.randn(p.shape, generator=g)
    m = gathered.offsets[-1]
    owned = {i: SimpleNamespace(ids=torch.randperm(m, generator=g)[: m // 10],
                                radii=torch.randint(0, 9, (m // 10, 2), generator=g, dtype=torch.int32)) for i in (0, 1)}
    back = {i: Back(torch.randn(len(o.ids), 9, generator=g), torch.rand(len(o.ids), generator=g) < 0.6, None)
            for i, o in owned.items()}
    contributed = torch.zeros(m, dtype=torch.bool)
    for i, b in back.items():
        contributed[owned[i].ids] |= torch.ones_like(b.contributed) if mode_visible else b.contributed
    stats, cache = StepStats(), _Cache()
    cfg = AdamConfig()
    adam_update(paged, Projected(gathered, None, owned, SH_DEGREE), Backprop(back, contributed),
                [_camera(32, 24), _camera(20, 20)], cache, learning_rates(cfg, 3, 100, 1.0), cfg, stats,
                global_step=3 if mode_visible else 0, batched=False)
    return stats, cache.dirty


@pytest.mark.parametrize("mode_visible", [False, True])
def test_many_blocks_stepped_at_once_are_the_blocks_stepped_one_by_one(mode_visible, monkeypatch):
    """Adam and the statistics of many small blocks in one compiled call over their address table
    (`step._step_at_once`) against the call a block from the interpreter: every array of every
    block bit for bit (empty blocks, unseen ones, ones seen but not stepped among them), the same
    blocks dirty, the same rows stepped and the same extents; over two steps, so the moment
    columns each block keeps are read back as they were left."""
    import train.step as step_module

    sizes = [0, 5, 130, 1, 0, 77, 300, 2, 40, 9] * 4
    at_once = {f"b{i}": _block(n, seed=100 + i) for i, n in enumerate(sizes)}
    one_by_one = {k: {n: v.clone() for n, v in b.items()} for k, b in at_once.items()}
    called = []
    real = step_module._step_at_once
    monkeypatch.setattr(step_module, "_step_at_once", lambda *a: called.append(1) or real(*a))
    runs = [[_update_many(at_once, mode_visible, seed=s) for s in (9, 10)]]
    assert len(called) == 2
    monkeypatch.setattr(step_module, "_at_once", lambda *a: False)
    runs.append([_update_many(one_by_one, mode_visible, seed=s) for s in (9, 10)])
    for (s_a, dirty_a), (s_b, dirty_b) in zip(*runs):
        assert dirty_a == dirty_b and 0 < len(dirty_a) < len(sizes) - 8
        assert s_a.contributed == s_b.contributed > 0
        assert s_a.extents == s_b.extents
    for k in at_once:
        for name in at_once[k]:
            assert torch.equal(at_once[k][name], one_by_one[k][name]), f"{k} {name}"
