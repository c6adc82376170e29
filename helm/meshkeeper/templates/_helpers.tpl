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
MESHKEEPER_REDIS_URL for any container: a plain value for the in-chart Redis, a Secret
reference otherwise (an external URL may carry a password). Args use $(MESHKEEPER_REDIS_URL).
*/}}
{{- define "meshkeeper.redisEnv" -}}
- name: MESHKEEPER_REDIS_URL
{{- if .Values.redis.enabled }}
  value: {{ printf "redis://%s-redis:6379/0" (include "meshkeeper.fullname" .) | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "meshkeeper.redisSecretName" . }}
      key: {{ .Values.externalRedis.existingSecretKey }}
{{- end }}
{{- end }}

{{/* The API token, where a Secret holds one. */}}
{{- define "meshkeeper.tokenEnv" -}}
{{- with .Values.controller.auth.existingSecret }}
- name: MESHKEEPER_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.controller.auth.tokenKey }}
{{- end }}
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
