"""Real mpirun runs: R ranks own regions and give what one process gives; failures never hang."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from storage import Store
from tests.helpers.layout import assert_same_blocks, check_layout, rank_free_state
from tools.tile.__main__ import main as tile_main
from tools.view.scene import load_blocks
from train.logs import PLOT_DATA_KEY

pytestmark = pytest.mark.mpi
REPO = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
if MPIRUN is None:
    pytest.skip("mpirun not found (pip install mpich)", allow_module_level=True)


def _mpirun(n: int, args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([MPIRUN, "-n", str(n), sys.executable, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _train(n: int, data: Path, store: Path, out: Path, *options: str, global_batch: int = 4, steps: int = 6):
    proc = _mpirun(n, ["-m", "train", "--data", str(data / "lund_door"), "--store", str(store), "--out", str(out),
                       "--steps", str(steps), "--batch-size", str(global_batch // n), "--data-factor", "16",
                       "--commit-every", "3", "--no-progress", "--deterministic", *options])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_one_two_and_four_ranks_train_the_same_parameters(shared_data, lund_store, tmp_path):
    stores = {}
    for n in (1, 2, 4):
        stores[n] = tmp_path / f"r{n}.zarr"
        shutil.copytree(lund_store, stores[n])
        _train(n, shared_data, stores[n], tmp_path / f"out{n}")
    # Resumed under another number of ranks (ownership recomputed): 2 ranks to step 3, 4 from there.
    stores["2+4"] = tmp_path / "r2+4.zarr"
    shutil.copytree(lund_store, stores["2+4"])
    _train(2, shared_data, stores["2+4"], tmp_path / "out2+4a", "--stop-at", "3")
    assert Store.open(stores["2+4"], mode="r").state["step"] == 3
    _train(4, shared_data, stores["2+4"], tmp_path / "out2+4b", "--resume")
    ref = Store.open(stores[1], mode="r")
    assert ref.state["step"] == 6
    stepped = 0
    for n in (2, 4, "2+4"):
        other = Store.open(stores[n], mode="r")
        assert rank_free_state(other.state) == rank_free_state(ref.state) and other.table.keys() == ref.table.keys()
        assert other.state["regions"]["ranks"] == (4 if n == "2+4" else n)
        for k in ref.table:
            a, b = ref.read_block(k), other.read_block(k)
            for name in a:
                # Owners backpropagate cameras in one order and rasterize splats in Morton order
                # for any R, so even float summation order agrees: the results are bit for bit equal
                # (every process runs numba's cached kernels: see train/render/cpu/compiled.py).
                np.testing.assert_array_equal(b[name], a[name], err_msg=f"{n} ranks {k}/{name}")
            stepped += int((a["adam_step"] > 0).sum())
    assert stepped > 1000
    psnr = [float(next(l for l in (tmp_path / f"out{n}" / "summary.json").read_text().splitlines()
                       if "test_psnr" in l).split(":")[1].strip(" ,")) for n in (1, 2, 4)]
    assert psnr[1] == pytest.approx(psnr[0], abs=1e-4) and psnr[2] == pytest.approx(psnr[0], abs=1e-4)
    # ranks own disjoint regions and rank 1+ received splats: the exchange really ran
    rank_logs = list((tmp_path / "out4").glob("metrics.rank*.jsonl"))
    assert len(rank_logs) == 4
    phases = {"t_io", "t_project", "t_exchange", "t_render", "t_backprop", "t_adam"}
    for path in rank_logs:
        lines = [json.loads(l) for l in path.read_text().splitlines() if '"train"' in l]
        assert lines
        for line in lines:
            # every phase of the step is timed, and the phases add up to no more than the step
            assert phases <= line.keys() and all(line[p] >= 0 for p in phases)
            assert sum(line[p] for p in phases) <= line["seconds"] + 1e-3
            # the CPU seconds of a phase are the rank's own work in it: never more than its wall
            # time (one compute thread a rank), never negative
            assert all(0 <= line["cpu" + p[1:]] <= line[p] + 2e-3 for p in phases)
            assert line["bytes_sent"] > 0 and line["received"] + line["local"] > 0
    # rank 0's `imbalance` is max/mean over the ranks of each step's compute CPU seconds
    steps = [[json.loads(l) for l in (tmp_path / "out4" / f"metrics.rank{r}.jsonl").read_text().splitlines()
              if '"train"' in l] for r in range(4)]
    for lines in zip(*steps):
        work = np.array([sum(line[f"cpu_{p}"] for p in ("project", "render", "backprop", "adam")) for line in lines])
        assert lines[0]["imbalance"] == pytest.approx(work.max() / work.mean(), rel=2e-3, abs=2e-3)
        assert lines[0]["imbalance_seconds"] >= 1.0
    # rank 0 plots every rank's lines: what the PNG carries as drawn is what the JSON lines say
    with Image.open(tmp_path / "out4" / "metrics.png") as png:
        plotted = json.loads(png.text[PLOT_DATA_KEY])
        assert png.size[0] > 4 * png.size[1]  # five panels side by side
    assert plotted["loss"] == {"x": [l["step"] for l in steps[0]], "y": [l["loss"] for l in steps[0]]}
    assert plotted["imbalance (work)"]["y"] == [l["imbalance"] for l in steps[0]]
    for r in range(4):
        assert plotted[f"rank {r} bytes sent"]["y"] == [l["bytes_sent"] for l in steps[r]]
    assert any(y > 0 for y in plotted["rank 3 bytes sent"]["y"])
    # the regions hold every Gaussian of the store once
    owned = [json.loads(next(l for l in p.read_text().splitlines() if '"train"' in l))["owned"] for p in rank_logs]
    assert sum(owned) == sum(i.count for i in Store.open(lund_store, mode="r").table.values())


def test_each_camera_rasterizes_exactly_the_single_process_splats(shared_data, lund_store, tmp_path):
    results = {}
    for n in (1, 4):
        out = tmp_path / f"render{n}.npz"
        proc = _mpirun(n, [str(REPO / "tests" / "helpers" / "mpi_render_check.py"), str(shared_data / "lund_door"),
                           str(lund_store), str(out)], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[n] = np.load(out)
    one, four = results[1], results[4]
    np.testing.assert_array_equal(four["splats"], one["splats"])  # none missing, none twice
    # the same pixels, up to the last float32 bit: forward-only projection of a block subset may
    # vectorise differently from the whole batch (training's projection agrees bit for bit)
    np.testing.assert_allclose(four["images"], one["images"], rtol=0, atol=1e-6)
    assert sorted(four["ranks"].tolist()) == [0, 1, 2, 3]
    assert four["received"].sum() > 0 and one["received"].sum() == 0


def test_the_exchange_sends_what_is_not_held_and_gradients_that_are_not_zero():
    """`send_splats` leaves off the wire the rows the receiver holds (`Held`) and hands over
    whole parts; `return_grads` sends a bit a splat and the rows that are not all zero, and
    gives back every row bit for bit (negative zeros, flags without gradients and gradients
    without flags included), with and without absgrad; the bytes counted are the format's."""
    proc = _mpirun(3, [str(REPO / "tests" / "helpers" / "mpi_exchange_check.py")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_a_killed_rank_ends_the_job_within_seconds(shared_data, lund_store, tmp_path):
    store = tmp_path / "kill.zarr"
    shutil.copytree(lund_store, store)
    out = tmp_path / "kill"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([MPIRUN, "-n", "2", sys.executable, "-m", "train", "--data", str(shared_data / "lund_door"),
                            "--store", str(store), "--out", str(out), "--steps", "100000", "--data-factor", "16",
                            "--commit-every", "2", "--log-every", "1", "--no-progress"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        log = out / "metrics.rank1.jsonl"
        while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 3):
            assert job.poll() is None, job.stderr.read()
            time.sleep(0.5)
        victim = _rank_pid(str(store), rank=1)
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        job.wait(timeout=60)
        assert job.returncode != 0
        assert time.time() - t0 < 30
    finally:
        if job.poll() is None:
            job.kill()
    # the store still opens at a complete commit
    s = Store.open(store, mode="r", verify="data")
    assert s.state["step"] % 2 == 0 and s.state["step"] >= 2


def _rank_pid(needle: str, rank: int) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle.encode() in cmd and b"train" in cmd and f"PMI_RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no process of rank {rank} found")


DENSIFY = ["--refine-start-iter", "10", "--refine-every", "10", "--reset-every", "30", "--rebalance-above", "1.0"]


@pytest.mark.parametrize("tiled,cap,ranks,strategy", [
    (600, 600, (1, 2, 4), ["--strategy", "default"]),
    (100, 2000, (1, 4), ["--strategy", "default"]),
    (600, 600, (1, 2), ["--strategy", "mcmc", "--cap-max", "14000"]),
    (600, 600, (1, 2), ["--strategy", "default", "--adam", "dense", "--absgrad", "--grow-grad2d", "0.0008"]),
], ids=["split", "merge", "mcmc", "dense-absgrad"])
def test_densification_is_the_same_on_one_two_and_four_ranks(shared_data, tmp_path, tiled, cap, ranks, strategy):
    """Refinements with Gaussians moving between blocks of different ranks, blocks splitting (or,
    with a high cap over small blocks, siblings merging) and a rebalance after every refinement
    (--rebalance-above 1): every rank count gives the same blocks, bit for bit; so do dense Adam
    (steps of unseen blocks put off to their next use) and absgrad (summed on the rendering rank,
    returned with the gradients). The run ends with
    the refinement of step 40, after which every Gaussian lies in its block's cell."""
    base = tmp_path / "lund.zarr"
    assert tile_main([str(shared_data / "lund_door"), "--out", str(base), "--max-per-block", str(tiled)]) == 0
    stores, logs = {}, {}
    for n in ranks:
        stores[n] = tmp_path / f"r{n}.zarr"
        shutil.copytree(base, stores[n])
        out = tmp_path / f"out{n}"
        _train(n, shared_data, stores[n], out, *DENSIFY, *strategy, "--max-per-block", str(cap), steps=41)
        logs[n] = [json.loads(l) for p in sorted(out.glob("metrics*.jsonl")) for l in p.read_text().splitlines()
                   if '"refine"' in l]
    ref = Store.open(stores[1], mode="r")
    for n in ranks[1:]:
        other = Store.open(stores[n], mode="r")
        assert rank_free_state(other.state) == rank_free_state(ref.state)
        assert_same_blocks(ref, other, f"{n} ranks")
        # The commit holds the regions the ranks ended on, rebalanced after the last refinement:
        # the viewer's owners add up to the Gaussians each rank logged as its own.
        files = [tmp_path / f"out{n}" / f"metrics.rank{r}.jsonl" for r in range(n)]
        owned = [[json.loads(l) for l in f.read_text().splitlines() if '"refine"' in l][-1]["owned"] for f in files]
        scene = load_blocks(other, str(stores[n]), n, [])
        assert [sum(b.info.count for b in scene.rows if b.owner == r) for r in range(n)] == owned
    total = sum(i.count for i in ref.table.values())
    refines = logs[1]
    assert total == check_layout(ref, cap) == 11384 + sum(r["cloned"] + r["split"] + r["added"] - r["pruned"] - r["relocated"]
                                                          for r in refines)
    if "mcmc" in strategy:  # grows by 5% a refinement up to the cap
        before = [11384] + [r["gaussians"] for r in refines[:-1]]
        assert [r["gaussians"] for r in refines] == [min(14000, int(1.05 * n)) for n in before]
    else:
        assert total > 1.5 * 11384
    many = logs[ranks[-1]]
    assert sum(r["bytes_sent"] for r in many) > 0  # Gaussians moved between ranks
    if "mcmc" not in strategy:  # (5% growth on 2 ranks left the balanced regions where they were)
        assert sum(r["rebalanced_blocks"] for r in many) > 0  # the regions were recomputed, blocks changed owner
    for step in {r["step"] for r in many}:  # ranks' shares add up to the single rank's refinement
        mine = [r for r in many if r["step"] == step]
        one = next(r for r in logs[1] if r["step"] == step)
        for field in ("cloned", "split", "pruned", "relocated", "added", "blocks_split", "blocks_merged"):
            assert sum(r[field] for r in mine) == one[field], (step, field)
        assert sum(r["migrated_out"] for r in mine) == sum(r["migrated_in"] for r in mine) == one["migrated_out"]
    changed = "added" if "mcmc" in strategy else "blocks_split" if tiled == cap else "blocks_merged"
    assert sum(r[changed] for r in logs[1]) > 0
