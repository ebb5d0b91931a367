{{/*
Deployment + Service of one CPU gRPC service (router, tokenizer, grammar):
  (dict "root" $ "component" "router" "values" .Values.router "args" (list ...)
        "loadsModel" false "serviceAccount" "" "extraPorts" (list (dict "name" "epp" "port" 9002 "appProtocol" "...")))
"extraPorts" (optional): more container ports, each also a port of the Service.
The container runs `radixmesh <component> --host 0.0.0.0 --port P --metrics-port M ...`, serves
grpc.health.v1 on its gRPC port (probed natively by the kubelet) and metrics on M.
*/}}
{{- define "radixmesh.grpcComponent" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $component := .component -}}
{{- $name := include "radixmesh.componentName" (dict "root" $root "component" $component) -}}
{{- $ids := dict "root" $root "component" $component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels: {{- include "radixmesh.labels" $ids | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels: {{- include "radixmesh.selectorLabels" $ids | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "radixmesh.labels" $ids | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        radixmesh.io/grpc-port: {{ $v.port | quote }}
        radixmesh.io/metrics-port: {{ $root.Values.metrics.port | quote }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- if .serviceAccount }}
      serviceAccountName: {{ .serviceAccount }}
      automountServiceAccountToken: true
      {{- else }}
      automountServiceAccountToken: false
      {{- end }}
      {{- with include "radixmesh.imagePullSecrets" $root | trim }}{{ . | nindent 6 }}{{ end }}
      securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ include "radixmesh.terminationGrace" (dict "root" $root "drain" $v.drainTimeoutSeconds) }}
      {{- if .loadsModel }}
      {{- with include "radixmesh.modelInitContainer" (dict "root" $root "image" "service" "model" .model) | trim }}
      initContainers: {{- . | nindent 8 }}
      {{- end }}
      {{- end }}
      containers:
        - name: {{ $component }}
          image: {{ include "radixmesh.image" (dict "root" $root "kind" "service") }}
          imagePullPolicy: {{ $root.Values.images.service.pullPolicy }}
          {{- include "radixmesh.lifecycle" $root | indent 10 }}
          command: ["radixmesh"]
          args:
            - {{ $component }}
            - --host=0.0.0.0
            - --port={{ $v.port }}
            - --metrics-port={{ $root.Values.metrics.port }}
            - --log-level={{ $root.Values.logLevel }}
            - --drain-timeout-s={{ $v.drainTimeoutSeconds }}
            {{- with include "radixmesh.lanePort" (dict "root" $root "port" $v.lanePort) }}
            - --lane-port={{ . }}
            {{- end }}
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
            {{- with include "radixmesh.internalTlsArgs" $root | trim }}{{ . | nindent 12 }}{{ end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- with include "radixmesh.lanePort" (dict "root" $root "port" $v.lanePort) }}
            - name: lane
              containerPort: {{ . }}
              protocol: TCP
            {{- end }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- range .extraPorts }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
            {{- with include "radixmesh.healthContainerPort" $root | trim }}{{ . | nindent 12 }}{{ end }}
          env:
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - name: POD_NAMESPACE
              valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
            {{- with include "radixmesh.redisEnv" $root | trim }}{{ . | nindent 12 }}{{ end }}
            {{- with include "radixmesh.tracingEnv" $root | trim }}{{ . | nindent 12 }}{{ end }}
            {{- if .loadsModel }}
            {{- include "radixmesh.modelEnv" $root | trim | nindent 12 }}
            {{- with include "radixmesh.modelOfflineEnv" $root | trim }}{{ . | nindent 12 }}{{ end }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "radixmesh.grpcProbes" (dict "root" $root "port" $v.port "probes" $v.probes) | nindent 10 }}
          resources: {{- toYaml $v.resources | nindent 12 }}
          securityContext: {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            {{- if .loadsModel }}
            {{- include "radixmesh.modelMounts" $root | trim | nindent 12 }}
            {{- else }}
            - name: tmp
              mountPath: /tmp
            {{- end }}
            {{- with include "radixmesh.internalTlsMount" $root | trim }}{{ . | nindent 12 }}{{ end }}
      volumes:
        {{- if .loadsModel }}
        {{- include "radixmesh.modelVolumes" $root | trim | nindent 8 }}
        {{- else }}
        - name: tmp
          emptyDir: {}
        {{- end }}
        {{- with include "radixmesh.internalTlsVolume" $root | trim }}{{ . | nindent 8 }}{{ end }}
      {{- with include "radixmesh.scheduling" (dict "values" $v) | trim }}{{ . | nindent 6 }}{{ end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels: {{- include "radixmesh.labels" $ids | nindent 4 }}
spec:
  type: ClusterIP
  selector: {{- include "radixmesh.selectorLabels" $ids | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- with include "radixmesh.lanePort" (dict "root" $root "port" $v.lanePort) }}
    - name: lane
      port: {{ . }}
      targetPort: lane
      protocol: TCP
    {{- end }}
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- range .extraPorts }}
    - name: {{ .name }}
      port: {{ .port }}
      targetPort: {{ .name }}
      protocol: TCP
      {{- with .appProtocol }}
      appProtocol: {{ . }}
      {{- end }}
    {{- end }}
{{- end -}}
