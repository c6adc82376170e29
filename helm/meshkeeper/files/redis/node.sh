# A data node under Sentinel: the master, or a replica of it (master.sh says which). AOF,
# fsync every second, as the single server; the replication secrets go in a file, not argv.
set -eu
. "$(dirname "$0")/master.sh"
master=$(current_master)
echo "master of $MASTER_SET: $master (this node: $SELF)"
umask 077
{
  echo "port $REDIS_PORT"
  echo "bind $BIND"
  echo "dir $DATA"
  echo "aclfile $DATA/users.acl"
  echo "appendonly yes"
  echo "appendfsync everysec"
  echo 'save ""'
  echo "replica-announce-ip $SELF"
  echo "masteruser replica"
  echo "masterauth $REPLICATION_PASSWORD"
  if [ "$master" != "$SELF" ]; then echo "replicaof $master $REDIS_PORT"; fi
} > "$DATA/redis.conf"
exec redis-server "$DATA/redis.conf"
