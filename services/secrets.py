"""Secret files: written mode 0600 from their creation on, never readable by others, not even
for an instant. Shared by `meshkeeper up` (cli/secrets.py) and the compose deployment
(deploy/compose/compose-secrets.py, which runs in the controller image)."""

from __future__ import annotations

import os
from pathlib import Path


def write_secret(path: Path, text: str) -> Path:
    """`text` into `path`, mode 0600 from its creation on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    return path
