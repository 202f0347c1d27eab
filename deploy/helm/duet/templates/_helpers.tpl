{{/* Names, labels and the pieces every pod shares. */}}

{{- define "duet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-duet, or <release> if it already contains the chart name; RayCluster and prefix of every object. */}}
{{- define "duet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "duet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "duet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "duet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "duet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "duet.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The KubeRay worker group name of a pool: pool names allow "_", Kubernetes names do not. */}}
{{- define "duet.groupName" -}}
{{- replace "_" "-" . }}
{{- end }}

{{- define "duet.controllerService" -}}
{{- printf "%s-controller" (include "duet.fullname" .) }}
{{- end }}

{{/* Environment of every Duet container. */}}
{{- define "duet.env" -}}
- name: DUET_CACHE_DIR
  value: {{ .Values.cacheDir | quote }}
- name: DUET_CONFIG
  value: /etc/duet/duet.yaml
{{- end }}

{{/* Volume mounts of every Duet container (config, model volume). */}}
{{- define "duet.volumeMounts" -}}
- name: duet-config
  mountPath: /etc/duet
  readOnly: true
{{- if .Values.modelVolume.enabled }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "duet.volumes" -}}
- name: duet-config
  configMap:
    name: {{ include "duet.fullname" . }}-config
{{- if .Values.modelVolume.enabled }}
- name: models
  {{- toYaml .Values.modelVolume.source | nindent 2 }}
{{- end }}
{{- end }}

{{/* Volumes of Ray pods: /dev/shm for the object store. */}}
{{- define "duet.rayVolumes" -}}
- name: shared-mem
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSize }}
{{- end }}

{{/* Names of pools that request GPUs, comma-separated (empty if none). */}}
{{- define "duet.gpuPools" -}}
{{- $out := list }}
{{- range (include "duet.pools" . | fromJsonArray) }}{{ if gt (int .gpusPerReplica) 0 }}{{ $out = append $out .name }}{{ end }}{{ end }}
{{- join ", " $out }}
{{- end }}

{{/* .Values.pools with poolDefaults filled in (deep merge; the pool wins), as a JSON list.
Numbers come back as float64 from JSON: wrap them in int where an integer is needed. */}}
{{- define "duet.pools" -}}
{{- $out := list }}
{{- range .Values.pools }}
{{- $pool := mustMergeOverwrite (deepCopy $.Values.poolDefaults) (deepCopy .) }}
{{- if kindIs "invalid" $pool.minReplicas }}{{ $_ := set $pool "minReplicas" $pool.replicas }}{{ end }}
{{- if kindIs "invalid" $pool.maxReplicas }}{{ $_ := set $pool "maxReplicas" $pool.replicas }}{{ end }}
{{- $out = append $out $pool }}
{{- end }}
{{- toJson $out }}
{{- end }}
