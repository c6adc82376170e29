# Sourced by node.sh and sentinel.sh: which data node is the master now.
#  1. the master a Sentinel that answers names (the set is running: a pod came back);
#  2. else the one this pod's own Sentinel last recorded (the whole set restarting, no
#     Sentinel up yet; a Sentinel rewrites its file after every failover);
#  3. else the first node (a fresh install).
# A node must never start as master on its own say-so: after a failover it would come back
# as a second master, and the Sentinels would make the set sync from whichever they saw.
current_master() {
  for s in $SENTINELS; do
    m=$(REDISCLI_AUTH="$DISCOVER_PASSWORD" timeout 3 redis-cli --no-auth-warning --raw \
      -h "$s" -p "$SENTINEL_PORT" --user discover \
      sentinel get-master-addr-by-name "$MASTER_SET" 2>/dev/null | head -n1) || m=""
    case "$m" in
      "" | *" "*) ;; # nothing, or an error reply
      *) echo "$m"; return ;;
    esac
  done
  m=$(awk -v set="$MASTER_SET" '$1 == "sentinel" && $2 == "monitor" && $3 == set { print $4 }' \
    "$DATA/sentinel.conf" 2>/dev/null || true)
  echo "${m:-$NODE0}"
}
