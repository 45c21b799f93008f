"""Where the store is written: under a temporary name next to the output, renamed into place at the end.

An error at any point removes the temporary store and the sort's scratch files, so the output
path holds either nothing new or a complete store.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from storage import Store, StoreError
from tools.leftovers import leftovers, remove_leftovers, warn
from tools.tile.config import TileError


class OutputPlace:
    """Context manager: `tmp` to create the store at, `scratch` for sort runs; `finish()` renames."""

    def __init__(self, out: Path, overwrite: bool, scratch_parent: Path | None = None) -> None:
        self.out = Path(out)
        parent = self.out.parent
        self._scratch_parent = scratch_parent or parent
        self._clear_leftovers()
        self.replace = self._check_target(overwrite)
        if not parent.is_dir():
            raise TileError(f"{self.out}: parent folder {parent} does not exist")
        self.tmp = parent / f"{self.out.name}.tmp-{os.getpid()}"
        self.scratch: Path | None = None

    def _clear_leftovers(self) -> None:
        """What killed runs into this output left. A run killed inside `finish`, between its two
        renames, left no store at OUT but the one it replaced at OUT.old-<pid>: that is put back."""
        parent, name = self.out.parent, self.out.name
        for old, pid in leftovers(parent, name, ".old-"):
            if not os.path.lexists(self.out):
                os.rename(old, self.out)
                warn(f"put back {self.out} from {old}, where a run replacing it (process {pid}) was stopped")
        remove_leftovers(parent, name, ".old-", "replaced store")
        remove_leftovers(parent, name, ".tmp-", "unfinished store")
        remove_leftovers(self._scratch_parent, name, ".sort-", "sort scratch")

    def _check_target(self, overwrite: bool) -> bool:
        if not os.path.lexists(self.out):
            return False
        if not overwrite:
            raise TileError(f"{self.out}: already exists (pass --overwrite to replace a store)")
        try:
            Store.open(self.out, mode="r", verify="table")
        except StoreError:
            raise TileError(f"{self.out}: exists and is not an OctoSplat store; refusing to overwrite it") from None
        return True

    def make_scratch(self) -> Path:
        # The pid lets a later run tell a killed run's scratch from a live one's.
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{self.out.name}.sort-{os.getpid()}-", dir=self._scratch_parent))
        return self.scratch

    def finish(self) -> None:
        """Move the finished store into place (replacing the old store only now)."""
        if self.replace:
            old = self.out.parent / f"{self.out.name}.old-{os.getpid()}"
            os.rename(self.out, old)
            os.rename(self.tmp, self.out)
            shutil.rmtree(old)
        else:
            os.rename(self.tmp, self.out)

    def __enter__(self) -> "OutputPlace":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
