# The Sentinel beside each data node. Its file is written fresh at every start (rotated
# passwords take effect) from the master master.sh finds, keeping the Sentinel's id; the
# replicas and the other Sentinels it learns again from them within seconds. Clients get
# `discover` (discovery only, docs/deploy.md); the Sentinels talk to one another as `peer`.
set -eu
. "$(dirname "$0")/master.sh"
hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
master=$(current_master)
myid=$(grep '^sentinel myid ' "$DATA/sentinel.conf" 2>/dev/null || true)
umask 077
{
  echo "port $SENTINEL_PORT"
  echo "bind $BIND"
  echo "dir $DATA"
  echo "sentinel resolve-hostnames yes"
  echo "sentinel announce-hostnames yes"
  echo "sentinel announce-ip $SELF"
  if [ -n "$myid" ]; then echo "$myid"; fi
  echo "sentinel monitor $MASTER_SET $master $REDIS_PORT $QUORUM"
  echo "sentinel down-after-milliseconds $MASTER_SET $DOWN_AFTER_MS"
  echo "sentinel failover-timeout $MASTER_SET $FAILOVER_TIMEOUT_MS"
  echo "sentinel auth-user $MASTER_SET sentinel"
  echo "sentinel auth-pass $MASTER_SET $REPLICATION_PASSWORD"
  echo "user default off"
  echo "user discover on #$(hash "$DISCOVER_PASSWORD") -@all +ping +auth +hello" \
    "+client|setname +sentinel|get-master-addr-by-name +sentinel|masters +sentinel|master" \
    "+sentinel|replicas +sentinel|slaves +sentinel|sentinels"
  echo "user peer on #$(hash "$PEER_PASSWORD") +@all"
  echo "sentinel sentinel-user peer"
  echo "sentinel sentinel-pass $PEER_PASSWORD"
} > "$DATA/sentinel.conf.new"
mv "$DATA/sentinel.conf.new" "$DATA/sentinel.conf"
exec redis-server "$DATA/sentinel.conf" --sentinel
