{{/* PodDisruptionBudget of one component: (dict "root" $ "component" "router" "role" "" "values" v). */}}
{{- define "radixmesh.pdb" -}}
{{- if .values.pdb.enabled }}
{{- $ids := dict "root" .root "component" .component "role" .role }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "radixmesh.componentName" (dict "root" .root "component" .name) }}
  namespace: {{ .root.Release.Namespace }}
  labels: {{- include "radixmesh.labels" $ids | nindent 4 }}
spec:
  {{- if not (kindIs "invalid" .values.pdb.minAvailable) }}
  minAvailable: {{ .values.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels: {{- include "radixmesh.selectorLabels" $ids | nindent 6 }}
{{- end }}
{{- end -}}

{{/* HorizontalPodAutoscaler of one Deployment: (dict "root" $ "name" "worker-decode" "values" v "path" "workers.decode"). */}}
{{- define "radixmesh.hpa" -}}
{{- $a := .values.autoscaling }}
{{- if $a.enabled }}
{{- if and (not $a.targetCPUUtilizationPercentage) (not $a.metrics) }}
{{- fail (printf "%s.autoscaling: give targetCPUUtilizationPercentage or metrics (autoscaling/v2 metric specs)" .path) }}
{{- end }}
{{- if lt (int $a.maxReplicas) (int $a.minReplicas) }}
{{- fail (printf "%s.autoscaling: maxReplicas (%d) is below minReplicas (%d)" .path (int $a.maxReplicas) (int $a.minReplicas)) }}
{{- end }}
{{- $name := include "radixmesh.componentName" (dict "root" .root "component" .name) }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $name }}
  namespace: {{ .root.Release.Namespace }}
  labels: {{- include "radixmesh.labels" (dict "root" .root "component" .component "role" .role) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- with $a.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
    {{- with $a.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
{{- end -}}
