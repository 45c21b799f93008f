"""Adaptive density control: the default strategy's rules against gsplat's own DefaultStrategy,
row operations over the block schema, and the schedule of refinements and resets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gsplat.strategy import DefaultStrategy
from gsplat.strategy.ops import reset_opa

from storage.rows import cat_rows, pack_rows, spawn_rows, take_rows, unpack_rows
from storage.schema import PARAM_NAMES, STAT_NAMES, block_schema, empty_state, moment_names, param_shapes
from train.densify.config import ConfigError, DensifyConfig
from train.densify.default import grow_masks, prune_mask, refine_block, refines_at, reset_opacities, resets_at
from train.densify.keyed import SPLIT, keyed_generator

SH = 2
SCENE_SCALE = 3.0


class FixedDefaultStrategy(DefaultStrategy):
    """gsplat's DefaultStrategy with the opacity reset of gsplat 1.5.3 repaired: its test
    `step % self.reset_every == 0 & step > 0` parses as `step % reset_every == (0 & step) > 0`."""

    def step_post_backward(self, params, optimizers, state, step, info, packed=False):
        super().step_post_backward(params, optimizers, state, step, info, packed=packed)
        if step < self.refine_stop_iter and step % self.reset_every == 0 and step > 0:
            reset_opa(params=params, optimizers=optimizers, state=state, value=self.prune_opa * 2.0)


def _block(n: int, seed: int) -> dict[str, torch.Tensor]:
    """A block whose rows span every rule's two sides: high and low gradients, small and large
    scales, transparent and opaque, small and large screen radii; Adam moments non-zero."""
    g = torch.Generator().manual_seed(seed)
    b = {name: torch.randn((n, *shape), generator=g) for name, shape in param_shapes(SH).items()}
    b["scales"] = torch.log(SCENE_SCALE * 10 ** (torch.rand(n, 3, generator=g) * 3 - 3.2))
    b["opacities"] = torch.logit(torch.rand(n, generator=g) * 0.04).clamp(-12, 12)
    b.update({k: torch.from_numpy(v) for k, v in empty_state(n, SH).items()})
    for name in moment_names():
        b[name] = torch.rand(b[name].shape, generator=g)
    b["adam_step"] = torch.randint(1, 50, (n,), generator=g, dtype=torch.int32)
    b["count"] = torch.randint(0, 6, (n,), generator=g, dtype=torch.int32)
    b["grad2d"] = torch.rand(n, generator=g) * 8e-4 * b["count"]
    b["max_radii"] = torch.rand(n, generator=g) * 0.3
    return b


def _gsplat_side(block: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    params = {n: torch.nn.Parameter(block[n].clone()) for n in PARAM_NAMES}
    optimizers = {n: torch.optim.Adam([params[n]], lr=1e-3) for n in PARAM_NAMES}
    for n, opt in optimizers.items():  # Adam state as a trained run has it
        opt.state[params[n]] = {"step": torch.tensor(7.0), "exp_avg": block[f"exp_avg_{n}"].clone(),
                                "exp_avg_sq": block[f"exp_avg_sq_{n}"].clone()}
    state = {"grad2d": block["grad2d"].clone(), "count": block["count"].to(torch.float32),
             "radii": block["max_radii"].clone(), "scene_scale": SCENE_SCALE}
    return params, optimizers, state


@pytest.mark.parametrize("step,scale2d_stop,revised", [(600, 0, False), (3100, 0, False), (3100, 5000, True)])
def test_a_refinement_equals_gsplat_default_strategy(step, scale2d_stop, revised):
    """Clone, split and prune masks, the resulting rows in order, their Adam moments and the
    running statistics: ours from the block's arrays, gsplat's from its own DefaultStrategy on
    the same parameters, optimizer state and statistics, with the same split samples."""
    block = _block(3000, seed=step)
    cfg = DensifyConfig(refine_scale2d_stop_iter=scale2d_stop, revised_opacity=revised)
    ref = DefaultStrategy(refine_scale2d_stop_iter=scale2d_stop, revised_opacity=revised)
    params, optimizers, state = _gsplat_side(block)

    is_dupli, is_split = grow_masks(block, step, cfg, SCENE_SCALE)
    assert 100 < int(is_dupli.sum()) and 100 < int(is_split.sum())  # both rules have work
    torch.manual_seed(11)
    n_dupli, n_split = ref._grow_gs(params, optimizers, state, step)
    assert (n_dupli, n_split) == (int(is_dupli.sum()), int(is_split.sum()))
    n_prune = ref._prune_gs(params, optimizers, state, step)
    ours = refine_block(block, step, cfg, SCENE_SCALE, torch.Generator().manual_seed(11))
    assert (ours.cloned, ours.split, ours.pruned) == (n_dupli, n_split, n_prune) and n_prune > 0
    assert len(ours.block["means"]) == len(params["means"]) == 3000 + n_dupli + n_split - n_prune
    for n in PARAM_NAMES:
        torch.testing.assert_close(ours.block[n], params[n].detach(), rtol=0, atol=0, msg=n)
        moments = optimizers[n].state[params[n]]
        torch.testing.assert_close(ours.block[f"exp_avg_{n}"], moments["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(ours.block[f"exp_avg_sq_{n}"], moments["exp_avg_sq"], rtol=0, atol=0)
    for name in STAT_NAMES:  # gsplat zeroes its statistics after a refinement, as we do
        assert not ours.block[name].any()
    # the prune rule alone on the original rows, as gsplat decides it
    params, optimizers, state = _gsplat_side(block)
    alone = ref._prune_gs(params, optimizers, state, step)
    assert int(prune_mask(block, step, cfg, SCENE_SCALE).sum()) == alone == 3000 - len(params["means"])


def test_new_rows_keep_their_sources_step_count_and_no_moments():
    block = _block(50, seed=1)
    new = spawn_rows(block, torch.tensor([3, 3, 7]), {"means": torch.zeros(3, 3)})
    assert new["adam_step"].tolist() == block["adam_step"][[3, 3, 7]].tolist()
    assert all(not new[m].any() for m in moment_names())
    assert not new["means"].any() and torch.equal(new["quats"], block["quats"][[3, 3, 7]])
    both = cat_rows([take_rows(block, torch.arange(50) % 2 == 0), new])
    assert len(both["means"]) == 28 and all(len(t) == 28 for t in both.values())


def test_rows_travel_as_bytes_unchanged():
    schema = block_schema(SH)
    block = {n: t.numpy() for n, t in _block(33, seed=2).items()}
    back = unpack_rows(pack_rows(block, schema), schema)
    assert back.keys() == block.keys()
    for n in block:
        assert back[n].dtype == block[n].dtype and back[n].shape == block[n].shape
        np.testing.assert_array_equal(back[n], block[n])
    with pytest.raises(ValueError, match="expected"):
        unpack_rows(np.zeros((2, 5), np.uint8), schema)


def test_opacity_reset_equals_gsplat_reset_opa():
    block = _block(200, seed=3)
    params, optimizers, state = _gsplat_side(block)
    reset_opa(params, optimizers, state, value=0.005 * 2.0)
    reset_opacities(block, prune_opa=0.005)
    torch.testing.assert_close(block["opacities"], params["opacities"].detach(), rtol=0, atol=0)
    assert not block["exp_avg_opacities"].any() and not block["exp_avg_sq_opacities"].any()
    assert float(torch.sigmoid(block["opacities"]).max()) <= 0.01 + 1e-7


def test_refinements_and_resets_fall_on_gsplat_schedule():
    """Which steps refine and which reset, against the fixed DefaultStrategy driven step by step
    (its refinements observed through `_grow_gs`, its resets through the opacities)."""
    cfg = DensifyConfig(refine_start_iter=20, refine_every=10, reset_every=70, pause_refine_after_reset=15,
                        refine_stop_iter=200)
    ref = FixedDefaultStrategy(refine_start_iter=20, refine_every=10, reset_every=70, pause_refine_after_reset=15,
                               refine_stop_iter=200)
    params, optimizers, state = _gsplat_side(_block(20, seed=4))
    state = ref.initialize_state(SCENE_SCALE)
    refined, reset = [], []
    ref._grow_gs = lambda *a, step=None, **k: (refined.append(a[-1]), (0, 0))[1]
    ref._prune_gs = lambda *a, **k: 0
    for step in range(260):
        means2d = torch.zeros(1, 20, 2, requires_grad=True)
        means2d.sum().backward()
        params["opacities"].data.fill_(5.0)
        info = {"width": 8, "height": 8, "n_cameras": 1, "radii": torch.ones(1, 20, 2), "gaussian_ids": None,
                "means2d": means2d}
        ref.step_post_backward(params, optimizers, state, step, info)
        if float(params["opacities"].max()) < 5.0:
            reset.append(step)
    assert [s for s in range(260) if refines_at(s, cfg)] == refined == [30, 40, 50, 60, 90, 100, 110, 120, 130, 160,
                                                                         170, 180, 190]
    assert [s for s in range(260) if resets_at(s, cfg)] == reset == [70, 140]
    assert not any(refines_at(s, DensifyConfig(strategy="none")) or resets_at(s, DensifyConfig(strategy="none"))
                   for s in range(5000))


def test_split_samples_are_keyed_by_seed_step_and_block():
    a = torch.randn(5, generator=keyed_generator(0, 600, "3-1f", SPLIT))
    assert torch.equal(a, torch.randn(5, generator=keyed_generator(0, 600, "3-1f", SPLIT)))
    for other in ((1, 600, "3-1f"), (0, 700, "3-1f"), (0, 600, "3-1e"), (0, 600, "4-1f")):
        assert not torch.equal(a, torch.randn(5, generator=keyed_generator(*other, SPLIT)))


@pytest.mark.parametrize("bad,match", [
    ({"strategy": "adc"}, "--strategy"), ({"grow_grad2d": float("nan")}, "--grow-grad2d"),
    ({"prune_opa": -1.0}, "--prune-opa"), ({"refine_every": 0}, "--refine-every"),
    ({"cap_max": 0}, "--cap-max"), ({"rebalance_above": 0.5}, "--rebalance-above"),
])
def test_bad_settings_are_refused_by_name(bad, match):
    with pytest.raises(ConfigError, match=match):
        DensifyConfig(**bad)


@pytest.mark.parametrize("absgrad", [False, True])
def test_statistics_are_gsplat_densification_state(shared_data, absgrad):
    """One step's statistics from a real render (garden, two cameras of a batch): the sums of
    normalised 2D gradient norms (with absgrad: of the summed absolute per-pixel gradients), the
    visible counts and the largest radii equal what gsplat's DefaultStrategy gathers from the same
    projection in packed mode."""
    from train.camera import Camera
    from train.losses import photometric_loss
    from train.render import pack_grads, project, rasterize
    from train.render.splats2d import Splats2D
    from train.stats import accumulate_stats, empty_stats

    garden = np.load(shared_data / "test_garden.npz")
    n = 20000
    pts = torch.from_numpy(garden["means3d"][:n].astype(np.float32))
    g = torch.Generator().manual_seed(0)
    splats = {"means": pts, "scales": torch.full((n, 3), -3.5) + 0.3 * torch.randn(n, 3, generator=g),
              "quats": torch.randn(n, 4, generator=g), "opacities": torch.randn(n, generator=g),
              "sh0": torch.randn(n, 1, 3, generator=g) * 0.5, "shN": torch.zeros(n, 0, 3)}
    ref = DefaultStrategy(refine_scale2d_stop_iter=1, absgrad=absgrad)
    state = ref.initialize_state(SCENE_SCALE)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in splats.items()}
    ours = empty_stats(n)
    for c in range(2):
        width, height = 648 // 2, 420 // 2
        camera = Camera(garden["viewmats"][c], garden["Ks"][c] / 2 * np.array([1, 1, 2])[:, None], width, height)
        s = project(splats, camera, 0)
        leaf = Splats2D.unpack(s.pack(), ids=s.ids)
        out = rasterize(leaf, camera, absgrad=absgrad)
        (photometric_loss(out.rgb, torch.full_like(out.rgb, 0.3)) / 2).backward()
        grads = out.absgrad() if absgrad else pack_grads(leaf)
        accumulate_stats(ours, s.ids, s.radii, grads, camera, 2)
        means2d = grads[:, :2].clone()
        info = {"means2d": torch.zeros(len(s), 2, requires_grad=True), "radii": s.radii, "gaussian_ids": s.ids,
                "width": width, "height": height, "n_cameras": 2}
        if absgrad:  # what gsplat's rasterize_to_pixels(absgrad=True) leaves on means2d
            info["means2d"].absgrad = means2d
        else:
            info["means2d"].grad = means2d
        ref._update_state(params, state, info, packed=True)
    assert (ours["count"] > 0).sum() > 5000 and (ours["count"] == 2).sum() > 1000
    np.testing.assert_array_equal(ours["count"], state["count"].numpy())
    np.testing.assert_allclose(ours["grad2d"], state["grad2d"].numpy(), rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(ours["max_radii"], state["radii"].numpy(), rtol=1e-6)


# ---- MCMC ----

def _relocation_kernel(o: float, s: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """gsplat's `relocation_kernel` (RelocationCUDA.cu) written out loop by loop, in float64."""
    from math import comb, sqrt

    new_o = 1.0 - (1.0 - o) ** (1.0 / n)
    denom = sum(comb(i - 1, k) * (-1.0) ** k / sqrt(k + 1) * new_o ** (k + 1) for i in range(1, n + 1) for k in range(i))
    return new_o, o / denom * s


def test_relocation_is_equation_9_as_gsplat_computes_it():
    from train.densify.mcmc import relocation

    g = torch.Generator().manual_seed(5)
    o = torch.rand(300, generator=g, dtype=torch.float64) * 0.98 + 0.01
    s = torch.rand(300, 3, generator=g, dtype=torch.float64) + 0.1
    n = torch.randint(1, 52, (300,), generator=g)
    new_o, new_s = relocation(o, s, n)
    for i in range(300):
        ref_o, ref_s = _relocation_kernel(float(o[i]), s[i].numpy(), int(n[i]))
        assert float(new_o[i]) == pytest.approx(ref_o, rel=1e-12)
        np.testing.assert_allclose(new_s[i].numpy(), ref_s, rtol=1e-9)
    # one copy changes nothing; n copies of opacity o' composite back to o
    same_o, same_s = relocation(o, s, torch.ones(300, dtype=torch.int64))
    torch.testing.assert_close(same_o, o)
    torch.testing.assert_close(same_s, s)
    torch.testing.assert_close(1 - (1 - new_o) ** n.clamp(max=51), o)


def test_mcmc_draws_are_the_global_distribution_made_blockwise():
    """Allocating draws to blocks by live opacity mass, then drawing inside each block by opacity,
    is a draw over all live Gaussians by opacity: over many keyed draws, every Gaussian's share
    of the draws approaches its opacity over the total."""
    from train.densify.mcmc import allocate, relocate_block, summarize

    cfg = DensifyConfig(strategy="mcmc")
    blocks = [_block(n, seed=20 + i) for i, n in enumerate((40, 7, 90))]
    for b in blocks:
        b["opacities"] = torch.logit(torch.rand(len(b["opacities"]), generator=torch.Generator().manual_seed(len(b["opacities"]))) * 0.9 + 0.001)
    summaries = [summarize(b, cfg) for b in blocks]
    masses = np.array([m for m, _ in summaries])
    counts = np.zeros(sum(len(b["means"]) for b in blocks))
    live = np.concatenate([torch.sigmoid(b["opacities"]).double().numpy() * (torch.sigmoid(b["opacities"]) > 0.005).numpy()
                           for b in blocks])
    offsets = np.cumsum([0] + [len(b["means"]) for b in blocks])
    trials = 300
    for t in range(trials):
        draws = allocate(masses, 200, seed=t, step=600)
        assert draws.sum() == 200
        for i, (b, n) in enumerate(zip(blocks, draws)):
            out = relocate_block(b, int(n), cfg, keyed_generator(t, 600, f"3-{i}", 3))
            dead = int((torch.sigmoid(b["opacities"]) <= 0.005).sum())
            assert out.relocated == summaries[i][1] == dead and out.added == n
            assert len(out.block["means"]) == len(b["means"]) - dead + n
            # the copies are their sources after the split of opacity and scale: the source rows
            # of each copy are found by identical means
            src = out.block["means"][: len(b["means"]) - dead]
            copies = out.block["means"][len(b["means"]) - dead :]
            alive = torch.where(torch.sigmoid(b["opacities"]) > 0.005)[0]
            for c in range(len(copies)):
                row = int(torch.where((src == copies[c]).all(1))[0][0])
                counts[offsets[i] + int(alive[row])] += 1
                assert not out.block["exp_avg_means"][row].any()
    expected = live / live.sum() * 200 * trials
    assert np.abs(counts - expected).max() < 6 * np.sqrt(expected.max())
    assert np.corrcoef(counts, expected)[0, 1] > 0.99


def test_mcmc_noise_is_gsplat_inject_noise_to_position():
    from gsplat.cuda._torch_impl import _quat_scale_to_covar_preci

    from train.densify.mcmc import perturb_means

    block = _block(64, seed=6)
    block["opacities"] = torch.linspace(-8, 8, 64)
    rows = torch.arange(0, 64, 3)
    means = block["means"].clone()
    perturb_means(block, rows, 0.37, keyed_generator(0, 7, "2-5", 2))
    noise = torch.randn(64, 3, generator=keyed_generator(0, 7, "2-5", 2))
    covars, _ = _quat_scale_to_covar_preci(block["quats"], torch.exp(block["scales"]), compute_preci=False)
    gate = 1 / (1 + torch.exp(-100 * ((1 - torch.sigmoid(block["opacities"])) - 0.995)))
    expected = means + torch.einsum("bij,bj->bi", covars, noise * gate[:, None] * 0.37)
    torch.testing.assert_close(block["means"][rows], expected[rows], rtol=1e-5, atol=1e-7)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(block["means"][untouched], means[untouched])
    assert (block["means"][rows] != means[rows]).any()


def test_mcmc_refines_on_gsplat_schedule():
    from gsplat.strategy import MCMCStrategy

    from train.densify import mcmc

    cfg = DensifyConfig(strategy="mcmc", refine_start_iter=20, refine_every=10, refine_stop_iter=90)
    ref = MCMCStrategy(refine_start_iter=20, refine_every=10, refine_stop_iter=90)
    ours = [s for s in range(200) if mcmc.refines_at(s, cfg)]
    assert ours == [s for s in range(200) if ref.refine_start_iter < s < ref.refine_stop_iter
                    and s % ref.refine_every == 0] == [30, 40, 50, 60, 70, 80]
    assert DensifyConfig(strategy="mcmc").stop_iter == MCMCStrategy().refine_stop_iter == 25_000
    assert DensifyConfig().stop_iter == DefaultStrategy().refine_stop_iter == 15_000
