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
  value: {{ ternary .Values.modelCache.mountPath .Values.cacheDir .Values.modelCache.enabled | quote }}
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
{{- if .Values.modelCache.enabled }}
- name: node-model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
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
{{- if .Values.modelCache.enabled }}
- name: node-model-cache
  hostPath:
    path: {{ .Values.modelCache.hostPath }}
    type: DirectoryOrCreate
{{- end }}
{{- end }}

{{/* The model names (model.name, or every models[].name) space-separated: what the pre-pull prepares. */}}
{{- define "duet.modelNames" -}}
{{- $names := list }}
{{- range (.Values.models | default (list .Values.model)) }}{{ $names = append $names .name }}{{ end }}
{{- join " " $names }}
{{- end }}

{{/* The node model cache's pre-pull (modelCache.prePull): an init container that copies the image's
cache (prepared default model, built kernels) into the node's directory where missing, then prepares
or downloads model.name (each models[].name) there, so the pod's own containers find it and a later pod on the node
downloads nothing. Nothing when the cache is off. */}}
{{- define "duet.prePull" -}}
{{- $v := .Values }}
{{- if and $v.modelCache.enabled $v.modelCache.prePull }}
- name: model-cache-pre-pull
  image: {{ include "duet.image" . }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  command: ["/bin/sh", "-c", "cp -Rn \"$DUET_IMAGE_CACHE\"/. \"$DUET_CACHE_DIR\"/ 2>/dev/null; for m in $DUET_PRE_PULL_MODEL; do python -m workers.models.assets --model \"$m\" || exit 1; done"]
  env:
    {{- include "duet.env" . | nindent 4 }}
    - {name: DUET_IMAGE_CACHE, value: {{ $v.cacheDir | quote }}}
    - {name: DUET_PRE_PULL_MODEL, value: {{ include "duet.modelNames" . | quote }}}
  volumeMounts:
    {{- include "duet.volumeMounts" . | nindent 4 }}
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
{{- range (include "duet.pools" . | fromJsonArray) }}{{ if gt (int .gpusPerRank) 0 }}{{ $out = append $out .name }}{{ end }}{{ end }}
{{- join ", " $out }}
{{- end }}

{{/* .Values.pools with poolDefaults filled in (deep merge; the pool wins), as a JSON list, each with
the derived keys the templates share:
  gang           ranks per replica = epSize * spSize * tpSize (a replica is one worker pod)
  groupReplicas / groupMinReplicas / groupMaxReplicas   the worker group's pods: the replicas' plus
                 one per standby replica (standbyReplicas, or up to maxStandby when autoscaled)
  podCpus/podGpus/podMemory   what that pod requests: gang x the per-rank amounts
  rayResource    the pool's own custom Ray resource, duet_pool_<name>: each rank's bundle asks for one
                 unit (resources_per_rank in the ConfigMap), and only the pool's worker group offers it
  rayResources   what each of the group's pods offers of it: {duet_pool_<name>: gang}, one unit per rank slot
  drafterResourcesResolved    the Ray resources its drafter actors request (see "duet.drafterResources")
Numbers come back as float64 from JSON: wrap them in int where an integer is needed. */}}
{{- define "duet.pools" -}}
{{- $out := list }}
{{- range .Values.pools }}
{{- $pool := mustMergeOverwrite (deepCopy $.Values.poolDefaults) (deepCopy .) }}
{{- if kindIs "invalid" $pool.minReplicas }}{{ $_ := set $pool "minReplicas" $pool.replicas }}{{ end }}
{{- if kindIs "invalid" $pool.maxReplicas }}{{ $_ := set $pool "maxReplicas" $pool.replicas }}{{ end }}
{{- $spare := int $pool.standbyReplicas }}
{{- $_ := set $pool "groupReplicas" (add (int $pool.replicas) $spare) }}
{{- $_ := set $pool "groupMinReplicas" (add (int $pool.minReplicas) $spare) }}
{{- $_ := set $pool "groupMaxReplicas" (add (int $pool.maxReplicas) (max $spare (int $pool.maxStandby))) }}
{{- $gang := mul (int $pool.epSize) (int $pool.spSize) (int $pool.tpSize) }}
{{- $memAmount := regexFind "^[0-9]+" (toString $pool.memoryPerRank) | atoi }}
{{- $memUnit := regexFind "(Mi|Gi)$" (toString $pool.memoryPerRank) }}
{{- $_ := set $pool "gang" $gang }}
{{- $_ := set $pool "podCpus" (mul $gang (int $pool.cpusPerRank)) }}
{{- $_ := set $pool "podGpus" (mul $gang (int $pool.gpusPerRank)) }}
{{- $_ := set $pool "podMemory" (printf "%d%s" (mul $gang $memAmount) $memUnit) }}
{{- $_ := set $pool "rayResource" (printf "duet_pool_%s" $pool.name) }}
{{- $_ := set $pool "rayResources" (dict $pool.rayResource $gang) }}
{{- $_ := set $pool "drafterResourcesResolved" (include "duet.drafterResources" (dict "root" $ "spec" $pool.speculative) | fromJson) }}
{{- $out = append $out $pool }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* The Ray resources a pool's drafter actors request (pools[].speculative.drafterResources): the
pool's own mapping if set; null = {<drafters.rayResource>: drafterCpus} when the pool drafts with a
model and the chart runs drafter pods (only they advertise that resource, so drafters land there),
else {} (drafters take CPUs wherever Ray finds them). Called with dict "root" "spec". */}}
{{- define "duet.drafterResources" -}}
{{- $d := .root.Values.drafters }}
{{- if not (kindIs "invalid" .spec.drafterResources) }}
{{- toJson .spec.drafterResources }}
{{- else if and $d.enabled (eq .spec.method "draft_model") }}
{{- toJson (dict $d.rayResource (int .spec.drafterCpus)) }}
{{- else }}
{{- toJson dict }}
{{- end }}
{{- end }}

{{/* The drafters worker group as a pool-like dict (what "duet.workerGroup" needs), or {} when off. */}}
{{- define "duet.drafterGroup" -}}
{{- $d := .Values.drafters }}
{{- if $d.enabled }}
{{- $g := dict "groupName" "drafters" "role" "drafter" "replicas" (int $d.replicas)
      "podCpus" (int $d.cpusPerPod) "podGpus" 0 "podMemory" $d.memoryPerPod
      "rayResources" (dict $d.rayResource (int $d.cpusPerPod))
      "nodeSelector" $d.nodeSelector "tolerations" $d.tolerations "affinity" $d.affinity }}
{{- $_ := set $g "minReplicas" (ternary $d.replicas $d.minReplicas (kindIs "invalid" $d.minReplicas) | int) }}
{{- $_ := set $g "maxReplicas" (ternary $d.replicas $d.maxReplicas (kindIs "invalid" $d.maxReplicas) | int) }}
{{- toJson $g }}
{{- else }}
{{- toJson dict }}
{{- end }}
{{- end }}

{{/* One entry of the RayCluster's workerGroupSpecs. Called with dict "root" $ "g" <group>, where the
group (from "duet.pools" or "duet.drafterGroup") gives groupName, role, pool (optional), replicas,
minReplicas, maxReplicas, podCpus, podGpus, podMemory, rayResources (custom Ray resources of each
pod, optional), nodeSelector, tolerations, affinity. rayStartParams values are strings; custom
resources use the form KubeRay documents: resources: '"{\"drafter\": 8}"'. */}}
{{- define "duet.workerGroup" -}}
{{- $v := .root.Values }}
{{- $g := .g -}}
- groupName: {{ $g.groupName }}
  replicas: {{ int $g.replicas }}
  minReplicas: {{ int $g.minReplicas }}
  maxReplicas: {{ int $g.maxReplicas }}
  rayStartParams:
    num-cpus: {{ int $g.podCpus | quote }}
    {{- if gt (int $g.podGpus) 0 }}
    num-gpus: {{ int $g.podGpus | quote }}
    {{- end }}
    {{- with $g.rayResources }}
    {{- $items := list }}
    {{- range $name, $amount := . }}{{ $items = append $items (printf "\\\"%s\\\": %d" $name (int $amount)) }}{{ end }}
    resources: {{ printf "\"{%s}\"" (join ", " $items) | squote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "duet.selectorLabels" .root | nindent 8 }}
        app.kubernetes.io/component: ray-worker
        {{- with $g.pool }}
        duet.ai/pool: {{ . | quote }}
        {{- end }}
        duet.ai/role: {{ $g.role }}
    spec:
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "duet.prePull" .root) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      {{- $drain := and $v.workerDrain.enabled (ne $g.role "drafter") }}
      {{- if $drain }}
      # the preStop drain (live migration) plus a margin for Ray to stop
      terminationGracePeriodSeconds: {{ add (int $v.workerDrain.timeoutSeconds) 30 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "duet.image" .root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          securityContext:
            {{- toYaml $v.securityContext | nindent 12 }}
          env:
            {{- include "duet.env" .root | nindent 12 }}
            {{- if $drain }}
            - name: DUET_POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
            {{- end }}
          {{- if $drain }}
          # Before the pod stops (scale-down, node drain, rolling upgrade): move the running requests of
          # this pod's workers to their pools' other workers by live KV migration (`duet drain`).
          lifecycle:
            preStop:
              exec:
                command: ["/bin/sh", "-c", "duet drain --node-ip \"$DUET_POD_IP\" --timeout {{ int $v.workerDrain.timeoutSeconds }} || true"]
          {{- end }}
          resources:
            requests:
              cpu: {{ int $g.podCpus | quote }}
              memory: {{ $g.podMemory }}
              {{- if gt (int $g.podGpus) 0 }}
              nvidia.com/gpu: {{ int $g.podGpus | quote }}
              {{- end }}
            limits:
              memory: {{ $g.podMemory }}
              {{- if gt (int $g.podGpus) 0 }}
              nvidia.com/gpu: {{ int $g.podGpus | quote }}
              {{- end }}
          volumeMounts:
            {{- include "duet.volumeMounts" .root | nindent 12 }}
            - {name: shared-mem, mountPath: /dev/shm}
      volumes:
        {{- include "duet.volumes" .root | nindent 8 }}
        {{- include "duet.rayVolumes" .root | nindent 8 }}
{{- end }}
