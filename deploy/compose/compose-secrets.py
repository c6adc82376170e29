"""Secrets for docker-compose.yml (docs/deploy.md, "Secrets"): the one-shot `secrets` service
runs this in the controller image before anything else starts, so `docker compose up` is
secure without any input.

Each secret is taken from its variable when set (a rotation: set it and run `up` again), else
kept from the previous run, else generated. Every consumer gets a volume of its own holding
only what it needs, owned by its uid and readable by nobody else:

    controller  auth.json (sha256 hashes only), redis-url (its Redis user, `controller`),
                redis-provisioner-url (the user that makes the agents' users, `provisioner`),
                api-token (for you: docker compose exec controller cat
                /run/secrets/meshkeeper/api-token)
    worker      join-token: agents join through the controller and get their own Redis user
    prometheus  scrape-token
    grafana     grafana-admin-password
    redis       redis-admin-password (its healthcheck), and users.acl on the Redis data
                volume: `default` off, admin, controller and provisioner rewritten from the
                secrets, the agent users the controller saved (ACL SAVE) kept

    python compose-secrets.py [ROOT]   (ROOT: default /secrets, where the compose file mounts them)
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from services.redis_url import with_credentials
from services.secrets import write_secret
from services.store import acl_file
from services.tokens import new_token, write_auth_file

# secret -> the variable that may give it
GIVEN_BY = {
    "api-token": "MESHKEEPER_API_TOKEN",
    "scrape-token": "MESHKEEPER_SCRAPE_TOKEN",
    "join-token": "MESHKEEPER_JOIN_TOKEN",
    "redis-admin-password": "REDIS_ADMIN_PASSWORD",
    "redis-controller-password": "REDIS_CONTROLLER_PASSWORD",
    "redis-provisioner-password": "REDIS_PROVISIONER_PASSWORD",
    "grafana-admin-password": "GRAFANA_ADMIN_PASSWORD",
}
# the uids the images run as
UID = {"controller": 10001, "worker": 10001, "prometheus": 65534, "grafana": 472, "redis": 999}
TOKEN_RE = re.compile(r"^[\x21-\x7e]{16,}$")  # printable, no spaces, long enough to be a secret


def values(store: Path, env: dict[str, str]) -> dict[str, str]:
    """Every secret: given, else kept, else new; the store is updated to match."""
    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = {}
    for name, var in GIVEN_BY.items():
        given, kept = env.get(var, "").strip(), store / name
        if given and not TOKEN_RE.match(given):
            sys.exit(
                f"{var}: use at least 16 printable characters without spaces, "
                "or leave it unset and one is generated"
            )
        value = given or (kept.read_text().strip() if kept.exists() else "") or new_token()
        write_secret(kept, value)
        out[name] = value
    return out


def hand_out(path: Path, text: str, owner: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # the previous run left it read-only
    write_secret(path, text)
    if os.geteuid() == 0:
        os.chown(path, UID[owner], UID[owner])
    os.chmod(path, 0o400)


def merge_acl(path: Path, prefix: str, admin: str, controller: str, provisioner: str) -> None:
    """The aclfile Redis starts with: the fixed users from the secrets, the saved agents kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    agents = [
        line
        for line in (path.read_text().splitlines() if path.exists() else [])
        if line.startswith("user agent-")
    ]
    tmp = path.with_name(path.name + ".new")
    # 0600 from its creation on: it holds the passwords of every Redis user
    users = acl_file(prefix, admin, controller, provisioner) + "\n".join(agents)
    write_secret(tmp, users.rstrip())
    if os.geteuid() == 0:
        os.chown(tmp, UID["redis"], UID["redis"])
    tmp.replace(path)


def main(root: Path, env: dict[str, str]) -> None:
    v = values(root / "store", env)
    prefix = env.get("MESHKEEPER_PREFIX", "mk:")
    redis = env.get("MESHKEEPER_REDIS_ADDRESS", "redis://redis:6379/0")
    c = root / "controller"
    c.mkdir(parents=True, exist_ok=True)
    write_auth_file(
        c / "auth.json",
        [("admin", "admin", v["api-token"]), ("prometheus", "scrape", v["scrape-token"])],
        v["join-token"],
    )
    if os.geteuid() == 0:
        os.chown(c / "auth.json", UID["controller"], UID["controller"])
    hand_out(
        c / "redis-url",
        with_credentials(redis, "controller", v["redis-controller-password"]),
        "controller",
    )
    hand_out(
        c / "redis-provisioner-url",
        with_credentials(redis, "provisioner", v["redis-provisioner-password"]),
        "controller",
    )
    hand_out(c / "api-token", v["api-token"], "controller")
    hand_out(root / "worker" / "join-token", v["join-token"], "worker")
    hand_out(root / "prometheus" / "scrape-token", v["scrape-token"], "prometheus")
    hand_out(root / "grafana" / "grafana-admin-password", v["grafana-admin-password"], "grafana")
    hand_out(root / "redis" / "redis-admin-password", v["redis-admin-password"], "redis")
    merge_acl(
        root / "redis-data" / "users.acl",
        prefix,
        v["redis-admin-password"],
        v["redis-controller-password"],
        v["redis-provisioner-password"],
    )
    print(
        f"secrets ready in {root} (api-token: docker compose exec controller "
        "cat /run/secrets/meshkeeper/api-token)"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/secrets"), dict(os.environ))
