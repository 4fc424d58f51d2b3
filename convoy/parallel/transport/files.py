"""Where a role service may read or write a file a caller names: inside the job's run directory (links resolved
first, so none leads out), and only files of the kind it keeps, so that no caller can overwrite the job's token,
its state or its logs, nor a file of the user's outside the run."""

from __future__ import annotations

import os
from pathlib import Path

from convoy.parallel.transport.errors import OutsideRunDir


def confined(run_dir: Path | None, requested: str, suffix: str) -> Path:
    """``requested`` (relative: to the run dir) as a path inside ``run_dir`` ending in ``suffix``, else
    ``OutsideRunDir`` naming why."""
    if run_dir is None:
        raise OutsideRunDir(f"this service was given no run dir, so it reads and writes no file a caller names "
                            f"({requested!r}); a job's services have CONVOY_RUN_DIR, others take run_dir=")
    root = os.path.realpath(run_dir)
    path = os.path.realpath(os.path.join(root, requested))
    if os.path.commonpath([root, path]) != root or path == root:
        raise OutsideRunDir(f"{requested!r} is outside the job's run dir {root}; name a file under it (a relative "
                            f"path is taken from there)")
    if not path.endswith(suffix):
        raise OutsideRunDir(f"{requested!r} does not end in {suffix!r}: this service reads and writes only its "
                            f"{suffix} files in the run dir")
    return Path(path)
