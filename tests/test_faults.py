"""Faults a run of days on many machines meets (issue 19): SIGKILLs of `python -m train` at random
moments, a rank of `mpirun -n 4` killed in a step and in a commit, a full disk at the commit's
fsync and at its document. Each time the store opens at a commit, `--resume` finishes with every
array of every block equal, bit for bit, to an uninterrupted run's (`--deterministic`), and the
next run leaves no temp files.

Stores live on /dev/shm where there is one: a kill tears a process, not the page cache, so fsync's
cost (seconds a commit on this shared disk) buys nothing here; the fsyncs still run.
"""
from __future__ import annotations

import errno
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

from storage import Store, StoreError
from tests.helpers.layout import assert_same_blocks
from tests.helpers.store_data import random_block

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
FAULT_TRAIN = REPO / "tests" / "helpers" / "fault_train.py"
KILLS = 8  # with the 12 of tests/test_reliability.py's tile and export runs: 20
KILL_STEPS = 24  # each killed run trains a few steps at most: the chain never reaches the end
MPI_STEPS = 6  # commits at steps 2, 4 and 6


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder on /dev/shm where there is one (else under pytest's tmp), removed at the end."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path_factory.mktemp("faults")
        return
    folder = shm / f"octosplat-faults-{os.getpid()}"
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fault_dir(scratch: Path, tmp_path: Path) -> Path:
    folder = scratch / tmp_path.name
    folder.mkdir()
    return folder


def train_args(data: Path, store: Path, out: Path, steps: int, commit_every: int, *flags: str,
               batch: int = 4) -> list[str]:
    """lund_door at 1/16 size, four cameras a step: `batch` 4 on one process, 1 on each of 4 ranks
    (the same global batch, so the same result bit for bit)."""
    return ["--data", str(data / "lund_door"), "--store", str(store), "--out", str(out), "--steps", str(steps),
            "--batch-size", str(batch), "--data-factor", "16", "--commit-every", str(commit_every),
            "--log-every", "1", "--max-eval-images", "1", "--no-progress", "--deterministic", *flags]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **extra}


def run_train(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_same_training(ref: Path, got: Path, what: str) -> None:
    with Store.open(ref, mode="r") as a, Store.open(got, mode="r") as b:
        assert b.state == a.state, what
        assert_same_blocks(a, b, what)


def leftovers(store: Path) -> list[str]:
    """What no commit of the store names: temp files of interrupted writes, block versions and
    commit documents newer than HEAD."""
    with Store.open(store, mode="r", verify="table") as s:
        head = s.head
    temp = [str(p.relative_to(store)) for p in store.rglob("*.partial")]
    versions = [str(p.relative_to(store)) for p in store.glob("blocks/*/*") if p.name.isdigit() and int(p.name) > head]
    commits = [str(p.relative_to(store)) for p in store.glob("commits/*") if p.name.isdigit() and int(p.name) > head]
    return temp + versions + commits


def committed_step(store: Path) -> int:
    """The store opens at a commit and every chunk of it decodes and passes its checksum."""
    with Store.open(store, mode="r", verify="data") as s:
        return int(s.state.get("step", 0))


def logged_steps(out: Path) -> int:
    log = out / "metrics.jsonl"
    return log.read_text().count('"kind": "train"') if log.exists() else 0


@pytest.fixture(scope="module")
def reference(shared_data: Path, lund_store: Path, scratch: Path) -> dict[int, Path]:
    """Uninterrupted runs of KILL_STEPS and MPI_STEPS steps: steps -> their store."""
    root = scratch / "reference"
    out = {}
    for steps, every in ((KILL_STEPS, 1), (MPI_STEPS, 2)):
        store = root / f"ref{steps}.zarr"
        shutil.copytree(lund_store, store)
        run_train(train_args(shared_data, store, root / f"run{steps}", steps, every))
        assert committed_step(store) == steps
        out[steps] = store
    return out


def step_period(out: Path) -> float:
    """Median seconds from one logged step to the next (its commit included) of a finished run."""
    times = [json.loads(line)["time"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line]
    return float(np.median(np.diff(times)))


def test_train_killed_at_random_moments_resumes_to_the_uninterrupted_result(shared_data, lund_store, reference,
                                                                            scratch: Path, fault_dir: Path) -> None:
    """KILLS runs, each SIGKILLed at a seeded random moment up to 1.5 step periods (a step and its
    commit, timed on the reference run) after it logged its first step, so kills land in steps, in
    commits, in garbage collection, each resuming what the one before left; then one that finishes."""
    store = fault_dir / "s.zarr"
    shutil.copytree(lund_store, store)
    rng = np.random.default_rng(1919)
    period = step_period(scratch / "reference" / f"run{KILL_STEPS}")
    kills, runs, report, partial = 0, 0, [], []
    while kills < KILLS:
        out = fault_dir / f"run{runs}"
        runs += 1
        proc = subprocess.Popen([sys.executable, "-m", "train", *train_args(shared_data, store, out, KILL_STEPS, 1,
                                                                            "--resume")],
                                cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and logged_steps(out) == 0:
            assert time.monotonic() < deadline, "the run logged no step in 300 s"
            time.sleep(0.05)
        # this run opened the store writable before its first step: what the last kill left is gone
        assert not [p for p in partial if (store / p).exists()], "temp files of the killed run are left"
        time.sleep(rng.uniform(0.0, 1.5) * period)
        if proc.poll() is None:
            proc.kill()
            kills += 1
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGKILL), stderr[-3000:]
        step, logged = committed_step(store), logged_steps(out)
        # nothing committed is lost: at most the step logged last, whose commit the kill cut short
        before = report[-1][1] if report else 0
        assert before + logged - 1 <= step <= before + logged, (before, logged, step)
        left = leftovers(store)
        partial = [p for p in left if p.endswith(".partial")]
        report.append((kills, step, len(left)))
        assert step < KILL_STEPS, f"the chain reached step {step} after {kills} kills: raise KILL_STEPS"
    run_train(train_args(shared_data, store, fault_dir / "final", KILL_STEPS, 1, "--resume"))
    assert committed_step(store) == KILL_STEPS
    assert leftovers(store) == [], "the finishing run left temp files or uncommitted versions"
    assert_same_training(reference[KILL_STEPS], store, f"after {kills} kills")
    print(f"\n{kills} kills in {runs} runs; (kills, committed step, leftovers the next run removed): {report}")


# ---------------------------------------------------------------- a killed rank under mpirun -n 4


def _processes_of(needle: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if needle.encode() in cmd and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install mpich)")
@pytest.mark.parametrize("fault,rank,at", [("kill_in_step", 1, 4), ("kill_in_commit", 0, 4)],
                         ids=["rank 1 in step 4", "rank 0 in the commit of step 4"])
def test_a_rank_killed_under_mpirun_ends_the_job_and_resume_equals_an_uninterrupted_run(
        shared_data, lund_store, reference, fault_dir: Path, fault: str, rank: int, at: int) -> None:
    store, mark = fault_dir / "s.zarr", fault_dir / "killed_at"
    shutil.copytree(lund_store, store)
    args = train_args(shared_data, store, fault_dir / "killed", MPI_STEPS, 2, batch=1)
    job = subprocess.run([MPIRUN, "-n", "4", sys.executable, str(FAULT_TRAIN), *args], cwd=REPO,
                         env=env(FAULT=fault, FAULT_RANK=str(rank), FAULT_AT=str(at), FAULT_MARK=str(mark)),
                         capture_output=True, text=True, timeout=400, check=False)
    ended = time.time()
    assert mark.exists(), f"the fault never fired: {job.stderr[-3000:]}"
    assert job.returncode != 0
    gone = ended - float(mark.read_text())
    assert gone < 30, "the job outlived its killed rank by 30 s"
    assert _processes_of(str(store)) == [], "processes of the job are left"
    assert committed_step(store) == 2  # the commit of step 4 never happened, or never took effect
    if fault == "kill_in_commit":  # killed between the commit document and the commit point
        assert (store / "commits" / "2" / "zarr.json").exists() and leftovers(store)
    run_train(train_args(shared_data, store, fault_dir / "resumed", MPI_STEPS, 2, "--resume"))
    assert committed_step(store) == MPI_STEPS and leftovers(store) == []
    assert_same_training(reference[MPI_STEPS], store, f"{fault} then --resume")
    print(f"\n{fault}: mpirun exited {job.returncode} {gone:.2f} s after the kill; the store at step 2; "
          f"--resume equal to the uninterrupted run")


# ---------------------------------------------------------------- a full disk during a commit


@pytest.mark.parametrize("fault,what", [("enospc_fsync", "the blocks of commit 3"), ("enospc_commit", "commit 3")])
def test_a_full_disk_at_the_commits_fsync_or_document_is_one_error_and_the_last_commit_stays(
        shared_data, lund_store, fault_dir: Path, monkeypatch, capsys, fault: str, what: str) -> None:
    """`train`'s main in this process (the fault is patched in, and undone after)."""
    from tests.helpers.fault_train import install
    from train.__main__ import main

    store = fault_dir / "s.zarr"
    shutil.copytree(lund_store, store)
    install(fault, 2, monkeypatch.setattr)  # from the commit after step 2 on
    code = main(train_args(shared_data, store, fault_dir / "run", 6, 1))
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 1 and err.strip().splitlines()[-1] == (f"error: store {store}: no space left on device while "
                                                          f"writing {what} (the last commit, step 2, is intact)"), err
    assert "Traceback" not in err
    assert committed_step(store) == 2
    with Store.open(store) as s:  # writable: removes what the failed commit left
        assert s.state["step"] == 2
    assert leftovers(store) == []


@pytest.mark.parametrize("key", ["commits/1/zarr.json", "zarr.json"])
def test_a_full_disk_renaming_a_commit_document_keeps_the_last_commit(tmp_path: Path, monkeypatch, key: str) -> None:
    """The rename that puts the commit document, or the root naming it (the commit point), in place."""
    from storage import backend

    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 1})
    rng = np.random.default_rng(0)
    block = random_block(rng, 30, 1)
    store.commit({"1-0": store.write_block("1-0", block, (0, 0, 0, 1, 1, 1))}, state={"step": 1})
    info = store.write_block("1-0", random_block(rng, 30, 1), (0, 0, 0, 1, 1, 1))
    real = os.replace

    def replace(src, dst):  # type: ignore[no-untyped-def]
        if Path(dst) == Path(store.name) / key:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(backend.os, "replace", replace)
    with pytest.raises(StoreError, match=rf"^store {store.name}: no space left on device while writing commit 1 "
                                         r"\(the last commit, step 1, is intact\)$"):
        store.commit({"1-0": info}, state={"step": 2})
    monkeypatch.undo()
    with Store.open(tmp_path / "s.zarr", verify="data") as s:  # writable: the failed commit's leftovers go
        assert s.state == {"step": 1}
        np.testing.assert_array_equal(s.read_block("1-0")["means"], block["means"])
    assert leftovers(tmp_path / "s.zarr") == []
