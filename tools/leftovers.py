"""What a killed run leaves behind: temporary outputs named after its process, `<out>.tmp-<pid>`
(and `<out>.sort-<pid>-*` scratch, `<out>.old-<pid>` while a store is replaced), which only a
later run into the same output can clear up."""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path


class LeftoverWarning(UserWarning):
    """What a killed earlier run left next to an output was removed (or put back)."""


def leftovers(folder: Path, out_name: str, marker: str) -> list[tuple[Path, str]]:
    """(path, pid) of `folder/<out_name><marker><pid>...` whose process no longer runs on this
    machine. `marker` is ".tmp-", ".sort-" or ".old-"; this process's own pid counts as gone (it
    has not made its temporary output yet)."""
    if not folder.is_dir():
        return []
    prefix = out_name + marker
    found = []
    for path in sorted(p for p in folder.iterdir() if p.name.startswith(prefix)):
        pid = path.name[len(prefix):].split("-")[0]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            found.append((path, pid))
    return found


def remove_leftovers(folder: Path, out_name: str, marker: str, what: str) -> None:
    """Remove the leftovers of `marker`, with a warning naming each."""
    for path, pid in leftovers(folder, out_name, marker):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        warn(f"removed {path}, the {what} of an earlier run (process {pid}) that was stopped")


def warn(message: str) -> None:
    warnings.warn(message, LeftoverWarning, stacklevel=4)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
