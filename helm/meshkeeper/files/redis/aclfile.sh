# The users file of a data node, as services/store.py acl_file writes it (tests check they
# agree): written fresh at every start so a rotated Secret takes effect, keeping the agent
# users the controller's provisioner created and saved with ACL SAVE (joined agents survive
# a restart).
# `default` is off (nobody logs in as it) but keeps every permission: redis-server 7.0
# replays the AOF as default and refused MULTI/EXEC blocks under -@all, dropping jobs.
set -eu
hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
{
  echo "user default off ~* &* +@all"
  echo "user admin on #$(hash "$ADMIN_PASSWORD") ~* &* +@all"
  echo "user controller on #$(hash "$CONTROLLER_PASSWORD") $CONTROLLER_ACL"
  echo "user provisioner on #$(hash "$PROVISIONER_PASSWORD") $PROVISIONER_ACL"
  if [ -n "${REPLICATION_PASSWORD:-}" ]; then
    echo "user replica on #$(hash "$REPLICATION_PASSWORD") $REPLICA_ACL"
    echo "user sentinel on #$(hash "$REPLICATION_PASSWORD") $SENTINEL_ACL"
  fi
  grep '^user agent-' "$DATA/users.acl" 2>/dev/null || true
} > "$DATA/users.acl.new"
mv "$DATA/users.acl.new" "$DATA/users.acl"
