"""The secrets `meshkeeper up` generates into `{run-dir}/secrets/` (docs/security.md).

The directory is 0700 and every file 0600, created with that mode (never readable by others,
not even for an instant). Each `up` generates a fresh set: the previous stack's agents and
tokens stop working with it, and clients that read MESHKEEPER_TOKEN_FILE pick up the new
admin token by themselves.

    api-token                  admin API token (MESHKEEPER_TOKEN_FILE)
    viewer-token               read-only API token (the mesh page)
    submitter-token            submits, and cancels or suspends its own jobs only: the one to
                               hand a colleague who shares this stack
    scrape-token               Prometheus: /metrics and /v1/sd/workers only
    join-token                 what agents join the controller with
    redis-admin-password       Redis user `admin` (operators)
    redis-controller-password  Redis user `controller` (the reconcile loop)
    redis-provisioner-password Redis user `provisioner` (makes agents' users)
    auth.json                  the controller's --auth-file: sha256 hashes only
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from services.secrets import write_secret
from services.tokens import new_token, write_auth_file


@dataclass(frozen=True)
class LocalSecrets:
    dir: Path
    admin_token: str
    viewer_token: str
    submitter_token: str
    scrape_token: str
    join_token: str
    redis_admin_password: str
    redis_controller_password: str
    redis_provisioner_password: str

    @property
    def api_token_file(self) -> Path:
        return self.dir / "api-token"

    @property
    def join_token_file(self) -> Path:
        return self.dir / "join-token"

    @property
    def auth_file(self) -> Path:
        return self.dir / "auth.json"

    @classmethod
    def create(cls, run_dir: Path) -> LocalSecrets:
        d = run_dir / "secrets"
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)  # mkdir's mode does not apply to a directory that already existed
        s = cls(d, *(new_token() for _ in range(8)))
        for name, value in (
            ("api-token", s.admin_token),
            ("viewer-token", s.viewer_token),
            ("submitter-token", s.submitter_token),
            ("scrape-token", s.scrape_token),
            ("join-token", s.join_token),
            ("redis-admin-password", s.redis_admin_password),
            ("redis-controller-password", s.redis_controller_password),
            ("redis-provisioner-password", s.redis_provisioner_password),
        ):
            write_secret(d / name, value)
        write_auth_file(
            s.auth_file,
            [
                ("admin", "admin", s.admin_token),
                ("viewer", "viewer", s.viewer_token),
                ("submitter", "submitter", s.submitter_token),
                ("prometheus", "scrape", s.scrape_token),
            ],
            s.join_token,
        )
        return s
