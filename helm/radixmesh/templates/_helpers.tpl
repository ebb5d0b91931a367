{{/* Names ------------------------------------------------------------------------------ */}}

{{- define "radixmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-radixmesh, or the release name alone when it already contains the chart name. */}}
{{- define "radixmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: (dict "root" $ "component" "router"). */}}
{{- define "radixmesh.componentName" -}}
{{- printf "%s-%s" (include "radixmesh.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "radixmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------- */}}

{{- define "radixmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .role }}
radixmesh.io/role: {{ . }}
{{- end }}
{{- end -}}

{{/* Selector labels plus version and manager: (dict "root" $ "component" "worker" "role" "decode"). */}}
{{- define "radixmesh.labels" -}}
helm.sh/chart: {{ include "radixmesh.chart" .root }}
{{ include "radixmesh.selectorLabels" . }}
app.kubernetes.io/part-of: radixmesh
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/* Label selector (string form) of every worker pod of this release: what the router watches. */}}
{{- define "radixmesh.workerSelector" -}}
app.kubernetes.io/component=worker,app.kubernetes.io/instance={{ .Release.Name }}
{{- end -}}

{{/* Images ----------------------------------------------------------------------------- */}}

{{- define "radixmesh.image" -}}
{{- $image := index .root.Values.images .kind -}}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* Addresses -------------------------------------------------------------------------- */}}

{{- define "radixmesh.routerAddress" -}}
{{- printf "%s:%d" (include "radixmesh.componentName" (dict "root" . "component" "router")) (int .Values.router.port) -}}
{{- end -}}

{{- define "radixmesh.tokenizerAddress" -}}
{{- printf "%s:%d" (include "radixmesh.componentName" (dict "root" . "component" "tokenizer")) (int .Values.tokenizer.port) -}}
{{- end -}}

{{- define "radixmesh.grammarAddress" -}}
{{- printf "%s:%d" (include "radixmesh.componentName" (dict "root" . "component" "grammar")) (int .Values.grammar.port) -}}
{{- end -}}

{{/* Name of the InferencePool (inferencePool.name, else the release's full name). */}}
{{- define "radixmesh.inferencePoolName" -}}
{{- default (include "radixmesh.fullname" .) .Values.inferencePool.name -}}
{{- end -}}

{{- define "radixmesh.routerServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "radixmesh.componentName" (dict "root" . "component" "router")) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Redis ------------------------------------------------------------------------------ */}}

{{- define "radixmesh.redisName" -}}
{{- include "radixmesh.componentName" (dict "root" . "component" "redis") -}}
{{- end -}}

{{/* (secret name, key) holding the bundled Redis password. */}}
{{- define "radixmesh.redisPasswordSecret" -}}
{{- default (include "radixmesh.redisName" .) .Values.redis.bundled.existingSecret -}}
{{- end -}}

{{- define "radixmesh.redisPasswordKey" -}}
{{- if .Values.redis.bundled.existingSecret -}}{{ .Values.redis.bundled.existingSecretKey }}{{- else -}}redis-password{{- end -}}
{{- end -}}

{{/* Env vars giving RADIXMESH_REDIS_URL (nothing when redis.mode is none). */}}
{{- define "radixmesh.redisEnv" -}}
{{- if eq .Values.redis.mode "bundled" }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "radixmesh.redisPasswordSecret" . }}
      key: {{ include "radixmesh.redisPasswordKey" . }}
- name: RADIXMESH_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "radixmesh.redisName" .) (int .Values.redis.bundled.port) | quote }}
{{- else if eq .Values.redis.mode "external" }}
- name: RADIXMESH_REDIS_URL
  valueFrom:
    secretKeyRef:
      {{- if .Values.redis.external.existingSecret }}
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
      {{- else }}
      name: {{ include "radixmesh.redisName" . }}-url
      key: redis-url
      {{- end }}
{{- end }}
{{- end -}}

{{/* The router's flags (a list): for the router Deployment, or the gateway's --embedded-router. */}}
{{- define "radixmesh.routerArgs" -}}
{{- $args := list (printf "--policy=%s" .Values.router.policy) (printf "--block-size=%d" (int .Values.kvIndex.blockSize)) -}}
{{- if eq .Values.router.discovery "kubernetes" -}}
{{- $args = concat $args (list "--discovery=kubernetes" (printf "--selector=%s" (include "radixmesh.workerSelector" .)) (printf "--namespace=%s" .Release.Namespace)) -}}
{{- else -}}
{{- $args = append $args "--discovery=redis" -}}
{{- end -}}
{{- $args = concat $args (include "radixmesh.redisArgs" . | fromYamlArray) -}}
{{- if .Values.workers.decode.enabled -}}
{{- $args = append $args (printf "--pd-min-prefill-tokens=%d" (int .Values.router.pdMinPrefillTokens)) -}}
{{- end -}}
{{- $args = append $args (printf "--host-hit-weight=%v" .Values.router.hostHitWeight) -}}
{{- $args = append $args (printf "--peer-fetch-min-tokens=%d" (int .Values.router.peerFetchMinTokens)) -}}
{{- toYaml $args }}
{{- end -}}

{{- define "radixmesh.redisArgs" -}}
{{- if ne .Values.redis.mode "none" }}
- --redis-url=$(RADIXMESH_REDIS_URL)
{{- end }}
{{- end -}}

{{/* Model ------------------------------------------------------------------------------ */}}

{{/* The name clients pass as "model": servedName, else what the loader calls model.name. */}}
{{- define "radixmesh.servedModelName" -}}
{{- $m := .Values.model.name -}}
{{- if .Values.model.servedName -}}{{ .Values.model.servedName }}
{{- else if hasPrefix "/" $m -}}{{ base $m | trimSuffix ".gguf" }}
{{- else -}}{{ $m }}
{{- end -}}
{{- end -}}

{{- define "radixmesh.cacheDir" -}}/var/cache/radixmesh{{- end -}}

{{/* Env of every container that loads the model (and of the init step). */}}
{{- define "radixmesh.modelEnv" -}}
- name: RADIXMESH_CACHE_DIR
  value: {{ include "radixmesh.cacheDir" . }}
- name: HF_HOME
  value: {{ include "radixmesh.cacheDir" . }}/hf
- name: TRITON_CACHE_DIR
  value: {{ include "radixmesh.cacheDir" . }}/triton
- name: RADIXMESH_ALLOW_HUB
  value: "1"
{{- with .Values.model.source.init.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.model.source.init.hfTokenSecret.key }}
      optional: true
{{- end }}
{{- end -}}

{{- define "radixmesh.modelVolumes" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.model.cache.sizeLimit }}
- name: tmp
  emptyDir: {}
{{- $source := .Values.model.source }}
{{- if eq $source.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $source.pvc.claimName }}
    readOnly: true
{{- else if eq $source.type "hostPath" }}
- name: model
  hostPath:
    path: {{ $source.hostPath.path }}
    type: {{ $source.hostPath.type }}
{{- end }}
{{- end -}}

{{- define "radixmesh.modelMounts" -}}
- name: cache
  mountPath: {{ include "radixmesh.cacheDir" . }}
- name: tmp
  mountPath: /tmp
{{- $source := .Values.model.source }}
{{- if has $source.type (list "pvc" "hostPath") }}
- name: model
  mountPath: {{ $source.mountPath }}
  readOnly: true
  {{- if and (eq $source.type "pvc") $source.pvc.subPath }}
  subPath: {{ $source.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The init step that fetches the model into the cache volume: (dict "root" $ "image" "worker" "model" M). */}}
{{- define "radixmesh.modelInitContainer" -}}
{{- $root := .root -}}
{{- if eq $root.Values.model.source.type "init" }}
- name: fetch-model
  image: {{ include "radixmesh.image" (dict "root" $root "kind" .image) }}
  imagePullPolicy: {{ (index $root.Values.images .image).pullPolicy }}
  {{- with $root.Values.model.source.init.command }}
  command: {{- toYaml . | nindent 4 }}
  {{- else }}
  command:
    - python
    - -c
    - |
      import sys
      from radixmesh.engine.loader.default_model import resolve_model_path
      name, path = resolve_model_path(sys.argv[1])
      print(f"radixmesh: model {sys.argv[1]!r} ready at {path}")
    - {{ .model | quote }}
  {{- end }}
  env:
    - name: RADIXMESH_MODEL
      value: {{ .model | quote }}
    {{- include "radixmesh.modelEnv" $root | trim | nindent 4 }}
  volumeMounts:
    {{- include "radixmesh.modelMounts" $root | trim | nindent 4 }}
  {{- with $root.Values.model.source.init.resources }}
  resources: {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext: {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
{{- end }}
{{- end -}}

{{/* Main containers read the fetched model offline (no hub calls at every restart). */}}
{{- define "radixmesh.modelOfflineEnv" -}}
{{- if eq .Values.model.source.type "init" }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- end -}}

{{/* UCX settings of the nixl KV transport (worker.disagg.ucx), as env; nothing for empty values. */}}
{{- define "radixmesh.ucxEnv" -}}
{{- with .tls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with .netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- with .tcpPortRange }}
- name: UCX_TCP_PORT_RANGE
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Pod pieces ------------------------------------------------------------------------- */}}

{{/*
gRPC probes of a service: (dict "root" $ "port" 50051 "probes" .probes), on its gRPC port, or on the plaintext
health port with tls.internal (the kubelet's gRPC probes cannot present a client certificate).
Liveness (and startup) ask grpc.health.v1 for the service "liveness", SERVING while the process serves;
readiness asks for "" (the whole server), SERVING only while the service's dependencies answer (a router
with a healthy worker). A missing dependency takes a pod out of its Service, never restarts it.
*/}}
{{- define "radixmesh.grpcProbes" -}}
{{- $port := int .port -}}
{{- if .root.Values.tls.internal.enabled }}{{ $port = int .root.Values.tls.internal.healthPort }}{{ end -}}
startupProbe:
  grpc: {port: {{ $port }}, service: liveness}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  grpc: {port: {{ $port }}, service: ""}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  grpc: {port: {{ $port }}, service: liveness}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end -}}

{{/* TLS ---------------------------------------------------------------------------------------- */}}

{{- define "radixmesh.tlsDir" -}}/etc/radixmesh/tls{{- end -}}

{{/* Secret of the internal (mutual TLS) certificate: tls.internal.secretName, else the chart's Certificate's. */}}
{{- define "radixmesh.internalTlsSecret" -}}
{{- default (include "radixmesh.componentName" (dict "root" . "component" "internal-tls")) .Values.tls.internal.secretName -}}
{{- end -}}

{{/* Secret of the gateway's public certificate: tls.public.secretName, else the chart's Certificate's. */}}
{{- define "radixmesh.publicTlsSecret" -}}
{{- default (include "radixmesh.componentName" (dict "root" . "component" "gateway-tls")) .Values.tls.public.secretName -}}
{{- end -}}

{{/* Flags of a gRPC service (router, tokenizer, grammar, worker) with tls.internal: serve mutual TLS, dial peers
with it, and serve plaintext health for the probes. */}}
{{- define "radixmesh.internalTlsArgs" -}}
{{- if .Values.tls.internal.enabled }}
{{- $dir := printf "%s/internal" (include "radixmesh.tlsDir" .) }}
- --tls-cert={{ $dir }}/tls.crt
- --tls-key={{ $dir }}/tls.key
- --tls-ca={{ $dir }}/ca.crt
- --tls-server-name={{ .Values.tls.internal.serverName }}
- --health-port={{ .Values.tls.internal.healthPort }}
{{- end }}
{{- end -}}

{{/* The health port's container port (with tls.internal). */}}
{{- define "radixmesh.healthContainerPort" -}}
{{- if .Values.tls.internal.enabled }}
- name: health
  containerPort: {{ .Values.tls.internal.healthPort }}
  protocol: TCP
{{- end }}
{{- end -}}

{{- define "radixmesh.internalTlsVolume" -}}
{{- if .Values.tls.internal.enabled }}
- name: tls-internal
  secret:
    secretName: {{ include "radixmesh.internalTlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "radixmesh.internalTlsMount" -}}
{{- if .Values.tls.internal.enabled }}
- name: tls-internal
  mountPath: {{ include "radixmesh.tlsDir" . }}/internal
  readOnly: true
{{- end }}
{{- end -}}

{{/* Scheduling of a pod: (dict "values" componentValues). */}}
{{- define "radixmesh.scheduling" -}}
{{- with .values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "radixmesh.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Engine flags from the engine values map (camelCase keys -> --kebab-case flags; null skipped). */}}
{{/* GPUs of a worker pod (its merged values): `gpus` when set, else one per tensor-parallel rank. */}}
{{- define "radixmesh.workerGpus" -}}
{{- if kindIs "invalid" .gpus }}{{ .engine.tpSize | default 1 | int }}{{ else }}{{ .gpus | int }}{{ end -}}
{{- end -}}

{{- define "radixmesh.engineArgs" -}}
{{- range $key := keys . | sortAlpha }}
{{- $value := index $ $key }}
{{- if kindIs "bool" $value }}
{{- if $value }}
- --{{ kebabcase $key }}
{{- end }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
- {{ printf "--%s=%d" (kebabcase $key) (int64 $value) | quote }}
{{- else if not (kindIs "invalid" $value) }}
- {{ printf "--%s=%v" (kebabcase $key) $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Tracing -------------------------------------------------------------------------------- */}}

{{/* Where radixmesh containers send spans: tracing.otlpEndpoint, else the bundled collector, else nothing (off). */}}
{{- define "radixmesh.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint -}}
{{- .Values.tracing.otlpEndpoint -}}
{{- else if .Values.otelCollector.enabled -}}
{{- printf "http://%s:%d" (include "radixmesh.componentName" (dict "root" . "component" "otel-collector")) (int .Values.otelCollector.port) -}}
{{- end -}}
{{- end -}}

{{/* Env of every radixmesh container: the OTLP endpoint and sampler (the standard OTEL_* variables); nothing when tracing is off. */}}
{{- define "radixmesh.tracingEnv" -}}
{{- with include "radixmesh.otlpEndpoint" . }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $.Values.tracing.sampler | quote }}
{{- with $.Values.tracing.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
- name: OTEL_K8S_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(OTEL_K8S_POD_NAME)" $.Release.Namespace | quote }}
{{- end }}
{{- end -}}

{{/* A Generate lane port (router.lanePort, worker.lanePort), or nothing: none set, or internal TLS (the lane is
plaintext; the services keep Generate on their gRPC ports). Args: root, port. */}}
{{- define "radixmesh.lanePort" -}}
{{- if and .port (not .root.Values.tls.internal.enabled) }}{{ .port }}{{ end -}}
{{- end }}

{{/* Graceful shutdown -------------------------------------------------------------------- */}}

{{/* A pod's terminationGracePeriodSeconds: the preStop wait, its drain, and 15 s to stop: (dict "root" $ "drain" N). */}}
{{- define "radixmesh.terminationGrace" -}}
{{- add .root.Values.shutdown.preStopSeconds .drain 15 -}}
{{- end -}}

{{/* The container's preStop hook: keep serving while endpoints and routers drop the pod, then SIGTERM drains it. */}}
{{- define "radixmesh.lifecycle" -}}
{{- if gt (int .Values.shutdown.preStopSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.shutdown.preStopSeconds }}"]
{{- end }}
{{- end -}}
