"""The kernels' thread pools (`train.pools`): the settings, the layer a trainer process gets, and
results that do not depend on the layer."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train.pools import POOL_ENVIRONMENT, configure_pools

REPO = Path(__file__).resolve().parents[1]

# A projection, rasterization and loss of random Gaussians, forward and backward, on two threads:
# the image and every parameter's gradient go to the .npz named on the command line.
_RENDER = """
import sys
from train.pools import configure_pools
configure_pools()
import numba, numpy as np, torch
from train.camera import Camera
from train.losses import training_loss
from train.render import render
gen = torch.Generator().manual_seed(7)
n = 6000
splats = {"means": torch.randn(n, 3, generator=gen) * torch.tensor([2.0, 1.2, 1.0]) + torch.tensor([0, 0, 6.0]),
          "quats": torch.randn(n, 4, generator=gen), "scales": torch.randn(n, 3, generator=gen) * 0.3 - 3.0,
          "opacities": torch.randn(n, generator=gen), "sh0": torch.randn(n, 1, 3, generator=gen) * 0.5,
          "shN": torch.randn(n, 15, 3, generator=gen) * 0.1}
for t in splats.values():
    t.requires_grad_(True)
camera = Camera(np.eye(4), np.array([[180.0, 0, 120], [0, 180.0, 80], [0, 0, 1]]), 240, 160)
target = torch.rand(160, 240, 3, generator=gen)
rgb, alpha, meta = render(splats, camera, sh_degree=3, background=[0.1, 0.2, 0.3])
loss, _ = training_loss(rgb, target)
loss.backward()
np.savez(sys.argv[1], layer=numba.threading_layer(), rgb=rgb.detach().numpy(), alpha=alpha.detach().numpy(),
         **{name: t.grad.numpy() for name, t in splats.items()})
"""


def _render_in(layer: str | None, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in POOL_ENVIRONMENT and k != "NUMBA_THREADING_LAYER"}
    env.update(NUMBA_NUM_THREADS="2", PYTHONPATH=str(REPO))
    if layer is not None:
        env["NUMBA_THREADING_LAYER"] = layer
    return subprocess.run([sys.executable, "-c", _RENDER, str(out)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_configure_pools_sets_what_the_caller_left_unset(monkeypatch):
    for name in POOL_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    configure_pools()
    assert os.environ["GOMP_SPINCOUNT"] == "123"  # a run's own setting wins
    assert os.environ["NUMBA_THREADING_LAYER_PRIORITY"].split() == ["omp", "tbb", "workqueue"]
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_renders_are_the_same_bits_under_every_threading_layer(tmp_path):
    """The default (OpenMP where libgomp is installed) against numba's own work queue and, where
    libtbb is installed, TBB: their schedules hand the tiles, rows and bands to the threads in
    different orders, and no value may depend on that."""
    runs = {}
    for layer in (None, "workqueue", "tbb"):
        out = tmp_path / f"{layer}.npz"
        done = _render_in(layer, out)
        if done.returncode != 0:
            assert layer == "tbb" and "No threading layer could be loaded" in done.stderr, done.stderr[-3000:]
            continue  # TBB is not installed here
        runs[layer] = dict(np.load(out))
    default = runs.pop(None)
    if str(default["layer"]) != "omp":
        pytest.fail(f"a trainer process should run numba's OpenMP layer, got {default['layer']}")
    assert runs, "no other layer to compare with"
    for layer, got in runs.items():
        assert str(got["layer"]) == layer
        for name, value in default.items():
            if name != "layer":
                assert np.array_equal(value, got[name]), f"{name} differs between omp and {layer}"
        assert np.abs(default["means"]).sum() > 0  # gradients reached the parameters
