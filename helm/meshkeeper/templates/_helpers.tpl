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
The controller's Redis URL, as REDIS_URL (what `python -m controller` reads): the in-chart
Redis with the `controller` ACL user, its password from the auth Secret (Kubernetes expands
$(VAR) from a variable defined before it); an external URL from its Secret. Only the
controller gets one: agents join through the controller and receive their own Redis user.
*/}}
{{- define "meshkeeper.redisEnv" -}}
{{- if .Values.redis.enabled }}
{{- include "meshkeeper.authEnv" (dict "ctx" . "name" "MESHKEEPER_REDIS_PASSWORD" "key" "redis-controller-password") }}
- name: REDIS_URL
  value: {{ printf "redis://controller:$(MESHKEEPER_REDIS_PASSWORD)@%s-redis:6379/0" (include "meshkeeper.fullname" .) | quote }}
{{- else }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "meshkeeper.redisSecretName" . }}
      key: {{ .Values.externalRedis.existingSecretKey }}
{{- end }}
{{- end }}

{{/* The Secret with api-token, scrape-token, join-token and the two Redis passwords. */}}
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
{{- $given := dict "api-token" $a.apiToken "scrape-token" $a.scrapeToken "join-token" $a.joinToken "redis-admin-password" $a.redisAdminPassword "redis-controller-password" $a.redisControllerPassword }}
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
{{- if and .Values.redis.enabled (or .Values.externalRedis.url .Values.externalRedis.existingSecret) }}
{{- fail "externalRedis is set but redis.enabled is true: set redis.enabled=false to use the external Redis" }}
{{- end }}
{{- if and .Values.externalRedis.url .Values.externalRedis.existingSecret }}
{{- fail "set one of externalRedis.url and externalRedis.existingSecret, not both" }}
{{- end }}
{{- end }}

{{/*
The `controller` Redis user's rules: keys and channels under the prefix, no server-wide
commands, and managing agent users. Must equal services/store.controller_acl (test_helm.py
checks): the controller creates one user per joined agent and saves them to the aclfile.
*/}}
{{- define "meshkeeper.controllerACL" -}}
{{ printf "~%s* &%s* +@all -@dangerous +info +acl|setuser +acl|deluser +acl|getuser +acl|save +acl|list +client|kill" .Values.keyPrefix .Values.keyPrefix }}
{{- end }}
