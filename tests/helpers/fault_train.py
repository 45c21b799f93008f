"""`python tests/helpers/fault_train.py TRAIN_ARGS...`: `python -m train` with one fault injected.

FAULT (environment) chooses it, FAULT_RANK the rank it hits (PMI_RANK under mpirun; 0 alone),
FAULT_AT the moment, FAULT_MARK a file that gets the time of a kill just before it happens:

    kill_in_step    SIGKILL in the middle of the FAULT_AT-th step this process trains (counting
                    from 1): its splats are projected and exchanged, its images not yet rasterized
    kill_in_commit  SIGKILL in the commit of step FAULT_AT, after the commit document is written
                    and before the root document names it (the commit point)
    enospc_fsync    ENOSPC from every fsync once the store is at step FAULT_AT
    enospc_commit   ENOSPC writing the commit document of the commit after step FAULT_AT
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _kill() -> None:
    mark = os.environ.get("FAULT_MARK")
    if mark:
        Path(mark).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _full(*_args, **_kwargs) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def install(fault: str, at: int, patch=setattr) -> None:
    """Put the fault in place; `patch` sets each attribute (pytest's monkeypatch.setattr undoes them)."""
    from storage import backend
    from storage.store import Store
    from train import step

    if fault == "kill_in_step":
        real_raster, calls = step.rasterize_and_loss, [0]

        def raster(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at:
                _kill()
            return real_raster(*args, **kwargs)

        patch(step, "rasterize_and_loss", raster)
    elif fault in ("kill_in_commit", "enospc_commit"):
        real_put, written = backend.Backend.put_json, [False]

        def put_json(self, key, doc, if_absent=False):
            if key.startswith("commits/") and key.endswith("/zarr.json") and "state" in doc["attributes"]:
                step_of_commit = doc["attributes"]["state"].get("step", 0)
                if fault == "enospc_commit" and step_of_commit > at:
                    _full()
                written[0] = step_of_commit == at
            elif key == "zarr.json" and written[0] and fault == "kill_in_commit":
                _kill()  # the commit document is on disk, the root does not name it yet
            return real_put(self, key, doc, if_absent)

        patch(backend.Backend, "put_json", put_json)
    elif fault == "enospc_fsync":
        real_sync = Store.sync_written

        def sync_written(self):
            if self.state.get("step", 0) >= at and self._unsynced:
                patch(backend, "_fsync", _full)
            return real_sync(self)

        patch(Store, "sync_written", sync_written)
    else:
        raise SystemExit(f"unknown FAULT {fault!r}")


if __name__ == "__main__":
    rank = int(os.environ.get("PMI_RANK", "0"))
    if rank == int(os.environ.get("FAULT_RANK", "0")):
        install(os.environ["FAULT"], int(os.environ["FAULT_AT"]))
    from train.__main__ import main

    sys.exit(main(sys.argv[1:]))
