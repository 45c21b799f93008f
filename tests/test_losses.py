"""The training loss's fused SSIM against pytorch_msssim (the library evaluation uses), the MCMC
regularisers against gsplat simple_trainer's expression, and the cheap finiteness check the
renderer and trainer use on every step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from pytorch_msssim import ssim as msssim

from train.losses import Regularizers, composite_photometric_loss, photometric_loss, psnr, training_loss
from train.render.errors import all_finite
from train.ssim import fused_ssim_applies, ssim_cpu


def _reference(x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """pytorch_msssim's SSIM of [H, W, C] images and its autograd gradient w.r.t. x."""
    leaf = x.detach().clone().requires_grad_(True)
    value = msssim(leaf.permute(2, 0, 1)[None], y.permute(2, 0, 1)[None], data_range=1.0, size_average=True)
    value.backward()
    return float(value), leaf.grad


def _fused(x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    leaf = x.detach().clone().requires_grad_(True)
    value = ssim_cpu(leaf, y)
    value.backward()
    return float(value.detach()), leaf.grad


@pytest.fixture(scope="module")
def photo(shared_data) -> torch.Tensor:  # [H, W, 3] a real photo at 120x180
    path = sorted((shared_data / "lund_door" / "images").iterdir())[0]
    image = Image.open(path).convert("RGB").resize((120, 180), Image.BILINEAR)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)


def test_fused_ssim_matches_pytorch_msssim_on_a_real_photo(photo):
    # A rendering-like estimate: the photo blurred, shifted in colour and noisy.
    rng = torch.Generator().manual_seed(0)
    blurred = torch.nn.functional.avg_pool2d(photo.permute(2, 0, 1)[None], 5, 1, 2)[0].permute(1, 2, 0)
    estimate = (0.9 * blurred + 0.05 + 0.03 * torch.randn(photo.shape, generator=rng)).clamp(0, 1)
    value, grad = _fused(estimate, photo)
    ref_value, ref_grad = _reference(estimate, photo)
    assert 0.3 < ref_value < 0.95  # a case where structure differs, not a trivial one
    assert value == pytest.approx(ref_value, abs=2e-6)
    scale = float(ref_grad.abs().max())
    assert float((grad - ref_grad).abs().max()) <= 1e-4 * scale
    # Identical images: SSIM 1 and a zero gradient.
    value, grad = _fused(photo, photo)
    assert value == pytest.approx(1.0, abs=1e-6)
    assert float(grad.abs().max()) < 1e-4 * scale


# The kernels filter each row with its channels side by side (a tap is C values along): other
# channel counts than 3 check that stride.
@pytest.mark.parametrize("shape", [(11, 11, 3), (12, 37, 3), (64, 11, 3), (40, 29, 3), (40, 29, 1), (12, 37, 4)])
def test_fused_ssim_matches_on_small_and_odd_sizes(shape):
    rng = torch.Generator().manual_seed(sum(shape))
    y = torch.rand(*shape, generator=rng)
    x = (y + 0.2 * torch.randn(*shape, generator=rng)).clamp(0, 1)
    value, grad = _fused(x, y)
    ref_value, ref_grad = _reference(x, y)
    assert value == pytest.approx(ref_value, abs=2e-6)
    assert float((grad - ref_grad).abs().max()) <= 1e-4 * float(ref_grad.abs().max())


def test_fused_ssim_gradient_against_finite_differences():
    rng = torch.Generator().manual_seed(3)
    y = torch.rand(14, 13, 3, generator=rng)
    x = torch.rand(14, 13, 3, generator=rng)
    _, grad = _fused(x, y)
    h = 1e-3
    for (i, j, c) in [(0, 0, 0), (7, 6, 1), (13, 12, 2), (3, 10, 0)]:
        plus, minus = x.clone(), x.clone()
        plus[i, j, c] += h
        minus[i, j, c] -= h
        numeric = (float(ssim_cpu(plus, y)) - float(ssim_cpu(minus, y))) / (2 * h)
        assert float(grad[i, j, c]) == pytest.approx(numeric, rel=2e-2, abs=2e-5)


def test_fused_ssim_does_not_depend_on_the_thread_count():
    import numba

    rng = torch.Generator().manual_seed(5)
    y = torch.rand(50, 70, 3, generator=rng)
    x = torch.rand(50, 70, 3, generator=rng)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _fused(x, y)
        numba.set_num_threads(before)
        many = _fused(x, y)
    finally:
        numba.set_num_threads(before)
    assert one[0] == many[0]
    assert torch.equal(one[1], many[1])


def test_photometric_loss_takes_the_fused_path_only_where_it_applies():
    x = torch.rand(20, 30, 3)
    assert fused_ssim_applies(x, x)
    assert not fused_ssim_applies(x[:10], x[:10])  # smaller than the window: L1 only
    assert not fused_ssim_applies(x.double(), x.double())
    assert not fused_ssim_applies(x, x.clone().requires_grad_(True))
    # The loss is the same function either way: compare with pytorch_msssim's.
    y = torch.rand(20, 30, 3)
    fused = photometric_loss(x, y)
    ref = 0.8 * (x - y).abs().mean() + 0.2 * (1 - msssim(x.permute(2, 0, 1)[None], y.permute(2, 0, 1)[None],
                                                          data_range=1.0))
    assert float(fused) == pytest.approx(float(ref), abs=1e-6)


@pytest.mark.parametrize("ssim_lambda, cameras", [(0.2, 1), (0.2, 3), (0.5, 7), (0.9, 2)])
def test_the_fused_training_loss_has_autograds_gradient_bit_for_bit(photo, ssim_lambda, cameras):
    """`training_loss` (one fused node on the CPU) against autograd through the loss written in
    torch operations: the same gradient to the last bit, on a real photo against a noisy copy
    with values past [0, 1] and pixels equal to the target (L1's sign 0), the loss divided by the
    step's cameras as the trainer does; the loss and the PSNR as their torch expressions give."""
    g = torch.Generator().manual_seed(cameras)
    x = photo + 0.15 * torch.randn(photo.shape, generator=g)
    x[:12] = photo[:12]
    grads, values = [], []
    for loss_of in (lambda a: (composite_photometric_loss(a, photo, ssim_lambda), psnr(a, photo)),
                    lambda a: training_loss(a, photo, ssim_lambda)):
        leaf = x.clone().requires_grad_(True)
        loss, p = loss_of(leaf)
        (loss / cameras).backward()
        grads.append(leaf.grad)
        values.append((float(loss), p))
    assert torch.equal(grads[0], grads[1])
    assert values[1][0] == pytest.approx(values[0][0], abs=1e-6)
    assert values[1][1] == pytest.approx(values[0][1], abs=1e-4)


def test_all_finite_finds_nan_and_inf_and_tolerates_overflowing_sums():
    t = torch.zeros(1000)
    assert all_finite(t) and all_finite(torch.zeros(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = t.clone()
        u[537] = bad
        assert not all_finite(u)
    big = torch.full((10,), 3e38)  # finite values whose sum overflows
    assert all_finite(big)
    big[3] = float("nan")
    assert not all_finite(big)


def _simple_trainer_reg_grads(opacities, scales, opacity_reg, scale_reg):
    """gsplat simple_trainer's terms over the whole scene, differentiated by autograd."""
    o, s = opacities.clone().requires_grad_(True), scales.clone().requires_grad_(True)
    loss = opacity_reg * torch.abs(torch.sigmoid(o)).mean() + scale_reg * torch.abs(torch.exp(s)).mean()
    loss.backward()
    return o.grad, s.grad


@pytest.mark.parametrize("opacity_reg,scale_reg", [(0.01, 0.01), (0.03, 0.0), (0.0, 0.2)])
def test_regularizer_gradients_are_simple_trainers_on_the_stepped_rows_only(opacity_reg, scale_reg):
    """A batch of 300 of the scene's 1,000 Gaussians, 200 of them stepped: those get the scene-wide
    terms' gradient added to what backward left, the others keep theirs untouched."""
    g = torch.Generator().manual_seed(0)
    opacities = torch.randn(1000, generator=g) * 3  # logits
    scales = torch.randn(1000, 3, generator=g) - 4  # log scales
    ref_o, ref_s = _simple_trainer_reg_grads(opacities, scales, opacity_reg, scale_reg)
    batch = torch.arange(200, 500)
    params = {"opacities": opacities[batch].clone().requires_grad_(True),
              "scales": scales[batch].clone().requires_grad_(True)}
    # backward's gradients, of the terms' size, so that a wrong term shows above float32 rounding
    before = {"opacities": torch.randn(300, generator=g) * 1e-6, "scales": torch.randn(300, 3, generator=g) * 1e-6}
    for name, p in params.items():
        p.grad = before[name].clone()
    stepped = torch.zeros(300, dtype=torch.bool)
    stepped[torch.randperm(300, generator=g)[:200]] = True
    Regularizers(opacity_reg, scale_reg, total=1000).add_grads(params, stepped)
    for name, ref in (("opacities", ref_o), ("scales", ref_s)):
        expected = before[name][stepped] + ref[batch][stepped]
        torch.testing.assert_close(params[name].grad[stepped], expected, rtol=1e-6, atol=1e-13)
        assert torch.equal(params[name].grad[~stepped], before[name][~stepped]), name
    if opacity_reg == 0.0:
        assert torch.equal(params["opacities"].grad, before["opacities"])


def test_regularizers_make_a_gradient_where_backward_left_none():
    params = {"opacities": torch.zeros(4, requires_grad=True), "scales": torch.zeros(4, 3, requires_grad=True)}
    Regularizers(0.01, 0.01, total=8).add_grads(params, torch.tensor([True, False, True, False]))
    assert params["opacities"].grad.tolist() == pytest.approx([0.01 / 8 * 0.25, 0, 0.01 / 8 * 0.25, 0])
    assert params["scales"].grad[1].tolist() == [0, 0, 0]
    assert params["scales"].grad[0].tolist() == pytest.approx([0.01 / 24] * 3)
    empty = {"opacities": torch.zeros(0, requires_grad=True), "scales": torch.zeros(0, 3, requires_grad=True)}
    Regularizers(0.01, 0.01, total=8).add_grads(empty, torch.zeros(0, dtype=torch.bool))  # a rank that sees nothing
    assert empty["opacities"].grad.shape == (0,) and empty["scales"].grad.shape == (0, 3)


def test_a_rows_regulariser_gradient_does_not_depend_on_its_place_in_the_batch():
    """Ranks gather different batches, so the same Gaussian sits at other rows (torch.sigmoid
    rounds a tensor's vector body and its scalar tail differently: this failed with it)."""
    g = torch.Generator().manual_seed(1)
    opacities, scales = torch.randn(4096, generator=g) * 3, torch.randn(4096, 3, generator=g) - 4

    def grads(lo: int, hi: int) -> dict[str, torch.Tensor]:
        params = {"opacities": opacities[lo:hi].clone().requires_grad_(True),
                  "scales": scales[lo:hi].clone().requires_grad_(True)}
        Regularizers(0.01, 0.01, total=4096).add_grads(params, torch.ones(hi - lo, dtype=torch.bool))
        return {name: p.grad for name, p in params.items()}

    whole = grads(0, 4096)
    for lo, hi in ((0, 7), (5, 100), (1000, 1013), (3, 4096), (4090, 4096)):
        part = grads(lo, hi)
        for name in part:
            assert torch.equal(part[name], whole[name][lo:hi]), (name, lo, hi)
