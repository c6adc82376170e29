{{/* Names: <release>-meshkeeper unless the release name already says meshkeeper. */}}
{{- define "meshkeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshkeeper.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels: stable across upgrades, so never the version. Call with (dict "ctx" $ "component" "x"). */}}
{{- define "meshkeeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshkeeper.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every object: the standard app.kubernetes.io/* set. Call with (dict "ctx" $ "component" "x"). */}}
{{- define "meshkeeper.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{ include "meshkeeper.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: meshkeeper
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "meshkeeper.controllerImage" -}}
{{- $i := .Values.controller.image -}}
{{ printf "%s:%s" $i.repository (default .Chart.AppVersion $i.tag) }}
{{- end }}

{{- define "meshkeeper.workerImage" -}}
{{- $i := .Values.worker.image -}}
{{ printf "%s:%s" $i.repository (default (printf "%s-%s" .Chart.AppVersion $i.variant) $i.tag) }}
{{- end }}

{{- define "meshkeeper.controllerURL" -}}
{{ printf "http://%s-controller:%d" (include "meshkeeper.fullname" .) (int .Values.controller.port) }}
{{- end }}

{{- define "meshkeeper.redisSecretName" -}}
{{- if .Values.externalRedis.existingSecret }}{{ .Values.externalRedis.existingSecret }}{{ else }}{{ include "meshkeeper.fullname" . }}-redis-url{{ end }}
{{- end }}

{{- define "meshkeeper.checkpointClaim" -}}
{{- default (printf "%s-checkpoints" (include "meshkeeper.fullname" .)) .Values.checkpoints.persistence.existingClaim }}
{{- end }}

{{/*
The controller's Redis URLs, as REDIS_URL and REDIS_PROVISIONER_URL (what `python -m
controller` reads): the in-chart Redis with the `controller` ACL user (its reconcile loop)
and the `provisioner` user (makes and deletes the agents' users), each password from the auth
Secret in a variable of its own (Kubernetes expands $(VAR) from a variable defined before
it); external URLs from their Secret. Only the controller gets them: agents join through the
controller and receive their own Redis user.
*/}}
{{- define "meshkeeper.redisEnv" -}}
{{- if and .Values.redis.enabled .Values.redis.sentinel.enabled }}
{{- include "meshkeeper.authEnv" (dict "ctx" . "name" "MESHKEEPER_REDIS_PASSWORD" "key" "redis-controller-password") }}
{{ include "meshkeeper.authEnv" (dict "ctx" . "name" "MESHKEEPER_REDIS_PROVISIONER_PASSWORD" "key" "redis-provisioner-password") }}
{{ include "meshkeeper.authEnv" (dict "ctx" . "name" "MESHKEEPER_REDIS_SENTINEL_PASSWORD" "key" "redis-sentinel-password") }}
{{- $sentinels := list }}
{{- range $node := splitList " " (include "meshkeeper.redisNodes" .) }}
{{- $sentinels = append $sentinels (printf "%s:26379" $node) }}
{{- end }}
{{- $target := printf "%s/%s/0?sentinel_username=discover&sentinel_password=$(MESHKEEPER_REDIS_SENTINEL_PASSWORD)" (join "," $sentinels) .Values.redis.sentinel.masterSet }}
- name: REDIS_URL
  value: {{ printf "redis+sentinel://controller:$(MESHKEEPER_REDIS_PASSWORD)@%s" $target | quote }}
- name: REDIS_PROVISIONER_URL
  value: {{ printf "redis+sentinel://provisioner:$(MESHKEEPER_REDIS_PROVISIONER_PASSWORD)@%s" $target | quote }}
{{- else if .Values.redis.enabled }}
{{- include "meshkeeper.authEnv" (dict "ctx" . "name" "MESHKEEPER_REDIS_PASSWORD" "key" "redis-controller-password") }}
{{ include "meshkeeper.authEnv" (dict "ctx" . "name" "MESHKEEPER_REDIS_PROVISIONER_PASSWORD" "key" "redis-provisioner-password") }}
- name: REDIS_URL
  value: {{ printf "redis://controller:$(MESHKEEPER_REDIS_PASSWORD)@%s-redis:6379/0" (include "meshkeeper.fullname" .) | quote }}
- name: REDIS_PROVISIONER_URL
  value: {{ printf "redis://provisioner:$(MESHKEEPER_REDIS_PROVISIONER_PASSWORD)@%s-redis:6379/0" (include "meshkeeper.fullname" .) | quote }}
{{- else }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "meshkeeper.redisSecretName" . }}
      key: {{ .Values.externalRedis.existingSecretKey }}
{{- if or .Values.externalRedis.existingSecret .Values.externalRedis.provisionerUrl }}
{{- /* optional: a Secret of yours without the key leaves the controller without a
provisioner (it warns; agents cannot join) rather than the pod unstartable */}}
- name: REDIS_PROVISIONER_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "meshkeeper.redisSecretName" . }}
      key: {{ .Values.externalRedis.existingSecretProvisionerKey }}
      optional: {{ not .Values.externalRedis.provisionerUrl }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret with api-token, scrape-token, join-token and the three Redis passwords (admin,
controller, provisioner; six under Sentinel: also replication, sentinel (clients' discovery)
and sentinel-peer). */}}
{{- define "meshkeeper.authSecretName" -}}
{{- default (printf "%s-auth" (include "meshkeeper.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/*
The auth Secret's data (base64), computed once per render and cached in .Values so the
Secret and the pods' checksum annotations agree: the value given in auth.*, else the one the
installed Secret already holds (lookup: kept across upgrades), else a fresh random one.
`helm template` and --dry-run cannot look up, so they render fresh values every time.
*/}}
{{- define "meshkeeper.authData" -}}
{{- if not (hasKey .Values "__authData") }}
{{- $existing := (lookup "v1" "Secret" .Release.Namespace (include "meshkeeper.authSecretName" .)).data | default dict }}
{{- $a := .Values.auth }}
{{- $given := dict "api-token" $a.apiToken "scrape-token" $a.scrapeToken "join-token" $a.joinToken "redis-admin-password" $a.redisAdminPassword "redis-controller-password" $a.redisControllerPassword "redis-provisioner-password" $a.redisProvisionerPassword }}
{{- if and .Values.redis.enabled .Values.redis.sentinel.enabled }}
{{- $_ := set $given "redis-replication-password" $a.redisReplicationPassword }}
{{- $_ := set $given "redis-sentinel-password" $a.redisSentinelPassword }}
{{- $_ := set $given "redis-sentinel-peer-password" $a.redisSentinelPeerPassword }}
{{- end }}
{{- $data := dict }}
{{- range $key, $value := $given }}
{{- $_ := set $data $key (ternary (b64enc $value) (get $existing $key | default (randAlphaNum 40 | b64enc)) (ne $value "")) }}
{{- end }}
{{- $_ := set .Values "__authData" $data }}
{{- end }}
{{- toYaml .Values.__authData }}
{{- end }}

{{/* Roll a pod when the Secret it reads through secretKeyRef changes (rotation by upgrade). */}}
{{- define "meshkeeper.authChecksum" -}}
{{- if not .Values.auth.existingSecret }}
checksum/auth: {{ include "meshkeeper.authData" . | sha256sum }}
{{- end }}
{{- end }}

{{/* One key of the auth Secret as a variable: (dict "ctx" $ "name" "ENV_NAME" "key" "api-token"). */}}
{{- define "meshkeeper.authEnv" -}}
- name: {{ .name }}
  valueFrom: {secretKeyRef: {name: {{ include "meshkeeper.authSecretName" .ctx }}, key: {{ .key }}}}
{{- end }}

{{/* Pod name, namespace and node from the downward API (logs, events, topology labels). */}}
{{- define "meshkeeper.podEnv" -}}
- name: MESHKEEPER_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: MESHKEEPER_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: MESHKEEPER_NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: MESHKEEPER_POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- end }}

{{/* Contradictory Redis settings fail the render with the fix in the message. */}}
{{- define "meshkeeper.checkValues" -}}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.url) (not .Values.externalRedis.existingSecret) }}
{{- fail "redis.enabled is false: set externalRedis.url or externalRedis.existingSecret" }}
{{- end }}
{{- if and .Values.redis.enabled (or .Values.externalRedis.url .Values.externalRedis.existingSecret .Values.externalRedis.provisionerUrl) }}
{{- fail "externalRedis is set but redis.enabled is true: set redis.enabled=false to use the external Redis" }}
{{- end }}
{{- $s := .Values.redis.sentinel }}
{{- if and .Values.redis.enabled $s.enabled }}
{{- if not .Values.redis.persistence.enabled }}
{{- fail "redis.sentinel needs redis.persistence.enabled: a master restarting empty before the Sentinels notice would have its replicas copy the empty data set" }}
{{- end }}
{{- if or (lt (int $s.quorum) 1) (gt (int $s.quorum) (int $s.replicas)) }}
{{- fail (printf "redis.sentinel.quorum %d: give 1 to redis.sentinel.replicas (%d); a majority (2 of 3) survives one lost node" (int $s.quorum) (int $s.replicas)) }}
{{- end }}
{{- end }}
{{- if and .Values.externalRedis.url .Values.externalRedis.existingSecret }}
{{- fail "set one of externalRedis.url and externalRedis.existingSecret, not both" }}
{{- end }}
{{- if and .Values.externalRedis.provisionerUrl (not .Values.externalRedis.url) }}
{{- fail "externalRedis.provisionerUrl goes with externalRedis.url; with externalRedis.existingSecret put the provisioner's URL in that Secret under externalRedis.existingSecretProvisionerKey" }}
{{- end }}
{{- if eq .Values.externalRedis.existingSecretKey .Values.externalRedis.existingSecretProvisionerKey }}
{{- fail "externalRedis.existingSecretKey and externalRedis.existingSecretProvisionerKey name the same key: the controller's and the provisioner's URLs need one each" }}
{{- end }}
{{- end }}

{{/*
The `controller` Redis user's rules (the reconcile loop): keys and channels under the prefix
and the server's uptime; no server-wide or user-managing command, and no killing or replacing
of the scripts agents run. Must equal services/store.controller_acl (test_helm.py checks).
*/}}
{{- define "meshkeeper.controllerACL" -}}
{{ printf "~%s* &%s* +@all -@dangerous +info -script|kill -script|flush -function" .Values.keyPrefix .Values.keyPrefix }}
{{- end }}

{{/*
The `provisioner` Redis user's rules: create, narrow, copy and delete the agents' users and
cut an old agent's connections at a rejoin; no key, no channel. The controller holds it apart
from its `controller` user (REDIS_PROVISIONER_URL), so a leaked controller password cannot
make a Redis user. Must equal services/store.provisioner_acl (test_helm.py checks).
*/}}
{{- define "meshkeeper.provisionerACL" -}}
resetkeys resetchannels -@all +ping +hello +auth +acl|setuser +acl|deluser +acl|getuser +acl|save +acl|list +client|kill
{{- end }}

{{/*
The init container of every data node: files/redis/aclfile.sh writes the users file (the
admin, controller and provisioner users; under Sentinel also `replica` and `sentinel`, services/store.py
acl_file) and keeps the agent users the controller saved.
*/}}
{{- define "meshkeeper.redisAclInit" -}}
{{- $r := .Values.redis }}
- name: aclfile
  image: {{ printf "%s:%s" $r.image.repository $r.image.tag }}
  imagePullPolicy: {{ $r.image.pullPolicy }}
  command: [sh, /scripts/aclfile.sh]
  env:
    - {name: DATA, value: /data}
    {{- include "meshkeeper.authEnv" (dict "ctx" . "name" "ADMIN_PASSWORD" "key" "redis-admin-password") | nindent 4 }}
    {{- include "meshkeeper.authEnv" (dict "ctx" . "name" "CONTROLLER_PASSWORD" "key" "redis-controller-password") | nindent 4 }}
    - {name: CONTROLLER_ACL, value: {{ include "meshkeeper.controllerACL" . | quote }}}
    {{- include "meshkeeper.authEnv" (dict "ctx" . "name" "PROVISIONER_PASSWORD" "key" "redis-provisioner-password") | nindent 4 }}
    - {name: PROVISIONER_ACL, value: {{ include "meshkeeper.provisionerACL" . | quote }}}
    {{- if $r.sentinel.enabled }}
    {{- include "meshkeeper.authEnv" (dict "ctx" . "name" "REPLICATION_PASSWORD" "key" "redis-replication-password") | nindent 4 }}
    - {name: REPLICA_ACL, value: {{ include "meshkeeper.replicaACL" . | quote }}}
    - {name: SENTINEL_ACL, value: {{ include "meshkeeper.sentinelACL" . | quote }}}
    {{- end }}
  resources: {{- toYaml $r.resources | nindent 4 }}
  securityContext: {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: data, mountPath: /data}
    - {name: scripts, mountPath: /scripts, readOnly: true}
{{- end }}

{{/* What a replica may run on its master, and the Sentinels on a data node: services/store.py
acl_file (test_helm_sentinel.py checks they agree). */}}
{{- define "meshkeeper.replicaACL" -}}
+psync +replconf +ping
{{- end }}
{{- define "meshkeeper.sentinelACL" -}}
&* +multi +slaveof +ping +exec +subscribe +config|rewrite +role +publish +info +client|setname +client|kill +script|kill
{{- end }}

{{/* The data nodes' stable names under the headless Service, space-separated (Sentinel mode). */}}
{{- define "meshkeeper.redisNodes" -}}
{{- $fn := include "meshkeeper.fullname" . }}
{{- $nodes := list }}
{{- range $i := until (int .Values.redis.sentinel.replicas) }}
{{- $nodes = append $nodes (printf "%s-redis-%d.%s-redis.%s.svc" $fn $i $fn $.Release.Namespace) }}
{{- end }}
{{- join " " $nodes }}
{{- end }}

{{/* What files/redis/node.sh and sentinel.sh read (Sentinel mode). */}}
{{- define "meshkeeper.redisSentinelEnv" -}}
{{- $s := .Values.redis.sentinel }}
{{- $fn := include "meshkeeper.fullname" . }}
- {name: DATA, value: /data}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- {name: SELF, value: {{ printf "$(POD_NAME).%s-redis.%s.svc" $fn .Release.Namespace | quote }}}
- {name: NODE0, value: {{ printf "%s-redis-0.%s-redis.%s.svc" $fn $fn .Release.Namespace | quote }}}
- {name: SENTINELS, value: {{ include "meshkeeper.redisNodes" . | quote }}}
- {name: MASTER_SET, value: {{ $s.masterSet | quote }}}
- {name: QUORUM, value: {{ $s.quorum | quote }}}
- {name: DOWN_AFTER_MS, value: {{ $s.downAfterMilliseconds | quote }}}
- {name: FAILOVER_TIMEOUT_MS, value: {{ $s.failoverTimeoutMilliseconds | quote }}}
- {name: REDIS_PORT, value: "6379"}
- {name: SENTINEL_PORT, value: "26379"}
- {name: BIND, value: "* -::*"}
{{ include "meshkeeper.authEnv" (dict "ctx" . "name" "REPLICATION_PASSWORD" "key" "redis-replication-password") }}
{{ include "meshkeeper.authEnv" (dict "ctx" . "name" "DISCOVER_PASSWORD" "key" "redis-sentinel-password") }}
{{ include "meshkeeper.authEnv" (dict "ctx" . "name" "PEER_PASSWORD" "key" "redis-sentinel-peer-password") }}
{{- end }}

{{/* A Kubernetes quantity ("16Gi", "500M", "1073741824", 2e9) in bytes, as an int64. */}}
{{- define "meshkeeper.bytes" -}}
{{- $q := toString . }}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 }}
{{- $unit := regexFind "[A-Za-z]+$" $q }}
{{- $number := trimSuffix $unit $q }}
{{- if and $unit (not (hasKey $units $unit)) }}
{{- fail (printf "%q is not a Kubernetes quantity this chart reads: use Ki, Mi, Gi, Ti, k, M, G or T" $q) }}
{{- end }}
{{- mulf (float64 $number) (get $units $unit | default 1) | int64 }}
{{- end }}

{{/*
The worker's memory-backed volumes (/dev/shm and the snapshots') count against its memory limit:
a render whose volumes leave the trainers less than a quarter of it fails, naming the fix.
*/}}
{{- define "meshkeeper.checkWorkerMemory" -}}
{{- $w := .Values.worker }}
{{- $limit := dig "limits" "memory" "" $w.resources }}
{{- if $limit }}
{{- $volumes := add (include "meshkeeper.bytes" $w.shmSize | int64) (include "meshkeeper.bytes" $w.snapshots.size | int64) }}
{{- $max := include "meshkeeper.bytes" $limit | int64 }}
{{- if gt (mul $volumes 4) (mul $max 3) }}
{{- fail (printf "worker.shmSize (%v) + worker.snapshots.size (%v) leave less than a quarter of worker.resources.limits.memory (%v) to the trainers: memory-backed volumes count against the pod's limit. Raise resources.limits.memory, or lower snapshots.size (hot recovery then keeps fewer slots) or shmSize" $w.shmSize $w.snapshots.size $limit) }}
{{- end }}
{{- end }}
{{- end }}
