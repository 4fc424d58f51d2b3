"""The job's secret: a random token in a mode-0600 file that every API call must carry."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from convoy.errors import ConfigError

TOKEN_FILE = "token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(path: Path, token: str | None = None) -> str:
    """Write ``token`` (default: a fresh random one) to a new file ``path`` with mode 0600.

    ``O_EXCL|O_NOFOLLOW``: a file or symlink someone put there first is refused, never written through."""
    token = token or new_token()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError as exc:
        raise ConfigError(f"token file {str(path)!r} already exists (a file or a link): remove it or give another "
                          "--run-dir") from exc
    except OSError as exc:
        raise ConfigError(f"cannot create the token file {str(path)!r}: {exc.strerror}; give another --run-dir") \
            from exc
    try:
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(token + "\n")
    except OSError as exc:
        path.unlink(missing_ok=True)  # ours (O_EXCL made it): no empty or partial token file is left behind
        raise ConfigError(f"cannot write the token file {str(path)!r}: {exc.strerror}; free space there or give "
                          "another --run-dir") from exc
    return token


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"token file {str(path)!r} cannot be read: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"token file {str(path)!r} is empty")
    return token
