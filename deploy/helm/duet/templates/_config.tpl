{{/*
The ONE place where chart values become Duet's config (cluster/config/duet.py, loaded by `duet serve`
on the Ray head and by `duet router`). Only keys the loader of this Duet version accepts are
emitted; a value the code does not use yet is listed by "duet.notWired" (NOTES.txt prints it) and
documented as "not yet used" in README.md. When the code grows a key, extend the dicts in
"duet.config" below; tests/deploy/test_helm_chart.py loads every rendered config with the real
loader, tests/deploy/test_chart_pools.py checks that each pool value reaches its config key.
*/}}

{{/* Cross-field checks the JSON schema cannot express (values merged from poolDefaults, sums over
pools); each message names the value and the fix. The loader repeats the checks it owns at start. */}}
{{- define "duet.validate" -}}
{{- $v := .Values }}
{{- $names := list }}
{{- $roles := list }}
{{- $blockSizes := list }}
{{- $drafterGroup := include "duet.drafterGroup" . | fromJson }}
{{- range $i, $p := (include "duet.pools" . | fromJsonArray) }}
{{- $at := printf "pools[%d] (%s)" $i $p.name }}
{{- if has $p.name $names }}
{{- fail (printf "pools[%d].name=%q: pool names must be unique" $i $p.name) }}
{{- end }}
{{- $names = append $names $p.name }}
{{- $roles = append $roles $p.role }}
{{- if ne $p.role "drafter" }}{{ $blockSizes = append $blockSizes (int $p.engine.blockSize) | uniq }}{{ end }}
{{- include "duet.validatePool" (dict "root" $ "p" $p "at" $at "drafterGroup" $drafterGroup) }}
{{- end }}
{{- include "duet.validateModels" . }}
{{- if not (or (has "colocated" $roles) (has "decode" $roles)) }}
{{- fail (printf "pools: roles %v: needs a colocated or decode pool to stream tokens (a prefill pool only computes prompts)" $roles) }}
{{- end }}
{{- include "duet.validateDrafterPools" . }}
{{- if gt (len $blockSizes) 1 }}
{{- fail (printf "pools: engine.blockSize differs between pools (%v): KV blocks move between pools, so every pool must use the same" $blockSizes) }}
{{- end }}
{{- if and (ne $v.model.quantization "none") (ne $v.model.dtype "float32") (ne $v.model.dtype "auto") }}
{{- fail (printf "model.quantization=%s needs model.dtype=float32 or auto (quantized weights run with float32 activations; it is %s)" $v.model.quantization $v.model.dtype) }}
{{- end }}
{{- if and $v.drafters.enabled (not (kindIs "invalid" $v.drafters.minReplicas)) (lt (int $v.drafters.replicas) (int $v.drafters.minReplicas)) }}
{{- fail (printf "drafters: replicas=%v must be >= minReplicas=%v" $v.drafters.replicas $v.drafters.minReplicas) }}
{{- end }}
{{- if and $v.drafters.enabled (not (kindIs "invalid" $v.drafters.maxReplicas)) (gt (int $v.drafters.replicas) (int $v.drafters.maxReplicas)) }}
{{- fail (printf "drafters: replicas=%v must be <= maxReplicas=%v" $v.drafters.replicas $v.drafters.maxReplicas) }}
{{- end }}
{{- if and .Values.router.tls.secretName (not .Values.router.tls.serverName) }}
{{- fail "router.tls.serverName: required with router.tls.secretName (a name in the certificate; the probes check it)" }}
{{- end }}
{{- if and .Values.router.tls.requireClientCerts (not .Values.router.tls.secretName) }}
{{- fail "router.tls.requireClientCerts=true needs router.tls.secretName (mTLS is TLS with client certificates)" }}
{{- end }}
{{- include "duet.validateAutoscaling" . }}
{{- if and .Values.serviceMonitor.enabled (not .Values.router.metrics.enabled) }}
{{- fail "serviceMonitor.enabled=true needs router.metrics.enabled=true (there is nothing to scrape otherwise)" }}
{{- end }}
{{- end }}

{{/* Several models (models[]): unique served names; every pool but a drafter pool names one of them;
each model has a pool that streams its tokens. */}}
{{- define "duet.validateModels" -}}
{{- $served := include "duet.servedModels" . | fromJsonArray }}
{{- if ne (len $served) (len (uniq $served)) }}
{{- fail (printf "models: served names %v: two models with one name; set servedName on one of them" $served) }}
{{- end }}
{{- $streaming := list }}
{{- range $i, $p := (include "duet.pools" . | fromJsonArray) }}
{{- if eq $p.role "drafter" }}
{{- if $p.model }}{{ fail (printf "pools[%d] (%s).model=%s: a drafter pool drafts for the pools naming it; leave model unset" $i $p.name $p.model) }}{{ end }}
{{- else }}
{{- if and $p.model (not (has $p.model $served)) }}
{{- fail (printf "pools[%d] (%s).model=%s: unknown model; served: %v" $i $p.name $p.model $served) }}
{{- end }}
{{- if and (not $p.model) (gt (len $served) 1) }}
{{- fail (printf "pools[%d] (%s).model: with several models each pool names the one it serves: one of %v" $i $p.name $served) }}
{{- end }}
{{- if or (eq $p.role "colocated") (eq $p.role "decode") }}{{ $streaming = append $streaming ($p.model | default (first $served)) }}{{ end }}
{{- end }}
{{- end }}
{{- range (ternary $served list (gt (len $served) 1)) }}
{{- if not (has . $streaming) }}
{{- fail (printf "models: no colocated or decode pool serves %s; add a pool with model: %s" . .) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Drafter pools (role drafter): each has a model and is named by a pool's speculative.drafterPool,
which must name one. */}}
{{- define "duet.validateDrafterPools" -}}
{{- $pools := include "duet.pools" . | fromJsonArray }}
{{- $drafterPools := list }}
{{- $named := list }}
{{- range $pools }}{{ if eq .role "drafter" }}{{ $drafterPools = append $drafterPools .name }}{{ end }}{{ if .speculative.drafterPool }}{{ $named = append $named .speculative.drafterPool }}{{ end }}{{ end }}
{{- range $i, $p := $pools }}
{{- $at := printf "pools[%d] (%s)" $i $p.name }}
{{- if eq $p.role "drafter" }}
{{- if not $p.drafter.model }}
{{- fail (printf "%s: role drafter needs drafter.model (a draft checkpoint or model name sharing the target's tokenizer)" $at) }}
{{- end }}
{{- if ne $p.speculative.method "none" }}
{{- fail (printf "%s: role drafter with speculative.method=%s: a drafter pool drafts for others; speculate on the pools that name it (set speculative.method: none here)" $at $p.speculative.method) }}
{{- end }}
{{- if gt (int $p.gang) 1 }}
{{- fail (printf "%s: role drafter with a gang of %d ranks: a drafter replica is one rank (epSize, spSize and tpSize 1)" $at (int $p.gang)) }}
{{- end }}
{{- if not (has $p.name $named) }}
{{- fail (printf "%s: no pool's speculative.drafterPool names this drafter pool, so it would serve nobody" $at) }}
{{- end }}
{{- else if $p.drafter.model }}
{{- fail (printf "%s: drafter.model=%s: only a role: drafter pool runs a drafter (for a private drafter per worker set speculative.draftModel)" $at $p.drafter.model) }}
{{- end }}
{{- with $p.speculative.drafterPool }}
{{- if not (has . $drafterPools) }}
{{- fail (printf "%s: speculative.drafterPool=%s must name a pool with role drafter (drafter pools: %v)" $at . $drafterPools) }}
{{- end }}
{{- if or (ne $p.speculative.method "draft_model") $p.speculative.draftModel }}
{{- fail (printf "%s: speculative.drafterPool=%s needs speculative.method: draft_model and no speculative.draftModel (the drafter pool names its model)" $at .) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Duet's SLO autoscaler (autoscaling.duet): who owns the pods and where its metrics come from. The
checks apply when it runs: autoscaling.duet.enabled and at least one pool it scales ("duet.autoscalerOn"). */}}
{{- define "duet.validateAutoscaling" -}}
{{- $v := .Values }}
{{- $a := $v.autoscaling }}
{{- if include "duet.autoscalerOn" . }}
{{- if and (eq $a.duet.actuator "kubernetes") $a.enableInTreeAutoscaling }}
{{- fail "autoscaling.duet.actuator=kubernetes with autoscaling.enableInTreeAutoscaling=true: both would resize the same worker groups; set enableInTreeAutoscaling: false (Duet then owns the pools' groups; size the drafters group with its replicas) or use actuator: ray (Duet adds/drains actors, KubeRay adds/removes pods)" }}
{{- end }}
{{- if and (eq $a.duet.actuator "ray") (not $a.enableInTreeAutoscaling) }}
{{- fail "autoscaling.duet.actuator=ray needs autoscaling.enableInTreeAutoscaling=true: the ray actuator only adds worker actors, and without KubeRay's autoscaler no pod would be added for them; or use actuator: kubernetes (or autoscaling.duet.enabled: false)" }}
{{- end }}
{{- if not $v.router.metrics.enabled }}
{{- fail "autoscaling.duet.enabled=true needs router.metrics.enabled=true: the controller reads the router's /metrics (or set autoscaling.duet.enabled: false)" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when Duet's SLO autoscaler runs: autoscaling.duet.enabled and some pool it scales. */}}
{{- define "duet.autoscalerOn" -}}
{{- if (include "duet.autoscaledPools" . | fromJsonArray) }}true{{ end }}
{{- end }}

{{/* The pools Duet's SLO autoscaler scales (JSON list of merged pools): those with slo and a profile
measured for the model they serve ("duet.profileFits"). */}}
{{- define "duet.autoscaledPools" -}}
{{- $out := list }}
{{- if .Values.autoscaling.duet.enabled }}
{{- range (include "duet.pools" . | fromJsonArray) }}{{ if and .slo .profile (include "duet.profileFits" (dict "root" $ "p" .)) }}{{ $out = append $out . }}{{ end }}{{ end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* "true" when pool .p's profile was measured for the model the pool serves (dict "root" "p"): the
last path component of the profile's `model` is the pool's served name or its model's name. A
profile without `model` fits any. A replica's capacity is the model's: the shipped profile of the
default pool is SmolLM2's, and a deployment serving another model with it is not scaled by it. */}}
{{- define "duet.profileFits" -}}
{{- $v := .root.Values }}
{{- $name := include "duet.poolModel" . }}
{{- $names := list $name }}
{{- range ($v.models | default (list $v.model)) }}{{ if eq (.servedName | default (base .name)) $name }}{{ $names = append $names (base .name) }}{{ end }}{{ end }}
{{- if or (not .p.profile.model) (has (base (toString .p.profile.model)) $names) }}true{{ end }}
{{- end }}

{{/* The served name of the model pool .p serves (dict "root" "p"): its `model`, else the default model's. */}}
{{- define "duet.poolModel" -}}
{{- .p.model | default (first (include "duet.servedModels" .root | fromJsonArray)) }}
{{- end }}

{{/* The checks of one pool (dict "root" "p" "at" "drafterGroup"), merged with poolDefaults. */}}
{{- define "duet.validatePool" -}}
{{- $p := .p }}
{{- $at := .at }}
{{- if or (lt (int $p.replicas) (int $p.minReplicas)) (gt (int $p.replicas) (int $p.maxReplicas)) }}
{{- fail (printf "%s: replicas=%v must be between minReplicas=%v and maxReplicas=%v" $at $p.replicas $p.minReplicas $p.maxReplicas) }}
{{- end }}
{{- if gt (int $p.engine.maxNumSeqs) (int $p.engine.maxNumBatchedTokens) }}
{{- fail (printf "%s: engine.maxNumSeqs=%v must be <= engine.maxNumBatchedTokens=%v" $at $p.engine.maxNumSeqs $p.engine.maxNumBatchedTokens) }}
{{- end }}
{{- if and (eq $p.placementStrategy "STRICT_SPREAD") (gt (int $p.gang) 1) }}
{{- fail (printf "%s: placementStrategy=STRICT_SPREAD puts each of the pool's %d x %d rank bundles on its own node, but one pod holds a whole gang of %d ranks; use PACK (or SPREAD)" $at (int $p.replicas) (int $p.gang) (int $p.gang)) }}
{{- end }}
{{- if and (eq $p.placementStrategy "STRICT_PACK") (gt (int $p.maxReplicas) 1) }}
{{- fail (printf "%s: placementStrategy=STRICT_PACK puts every bundle of the pool on one node, but each of its up to %d replicas has its own pod; use PACK" $at (int $p.maxReplicas)) }}
{{- end }}
{{- $sp := $p.speculative }}
{{- if and (eq $p.role "prefill") (ne $sp.method "none") }}
{{- fail (printf "%s: speculative.method=%s: a prefill pool produces one token per request; speculate on the decode pool (set this pool's speculative.method: none, or move it out of poolDefaults)" $at $sp.method) }}
{{- end }}
{{- if and (eq $sp.method "draft_model") (ne $sp.draftQuantization "none") (ne $.root.Values.model.dtype "float32") }}
{{- fail (printf "%s: speculative.draftQuantization=%s with model.dtype=%s: the drafter runs with the target's dtype and quantized weights need float32 activations; set speculative.draftQuantization: none or model.dtype: float32" $at $sp.draftQuantization $.root.Values.model.dtype) }}
{{- end }}
{{- if gt (int $sp.ngramMin) (int $sp.ngramMax) }}
{{- fail (printf "%s: speculative.ngramMin=%v must be <= speculative.ngramMax=%v" $at $sp.ngramMin $sp.ngramMax) }}
{{- end }}
{{- if and (eq $sp.method "draft_model") (not $sp.draftModel) (not $sp.drafterPool) }}
{{- fail (printf "%s: speculative.method=draft_model needs speculative.draftModel (a checkpoint or model name with the target's tokenizer) or speculative.drafterPool (a drafter pool)" $at) }}
{{- end }}
{{- if and (eq $sp.method "draft_model") $.drafterGroup (hasKey $p.drafterResourcesResolved $.root.Values.drafters.rayResource) (gt (int $sp.drafterCpus) (int $.root.Values.drafters.cpusPerPod)) }}
{{- fail (printf "%s: speculative.drafterCpus=%v exceeds drafters.cpusPerPod=%v: no drafter pod could hold a drafter (lower drafterCpus or raise cpusPerPod)" $at $sp.drafterCpus $.root.Values.drafters.cpusPerPod) }}
{{- end }}
{{- if and $.drafterGroup (eq (include "duet.groupName" $p.name) "drafters") }}
{{- fail (printf "%s: the worker group name \"drafters\" belongs to drafters.enabled; rename the pool" $at) }}
{{- end }}
{{- end }}

{{/* Values the chart accepts but this Duet version does not use yet, and deployments that render
but would not behave as the values suggest (one line each; NOTES.txt prints them). */}}
{{- define "duet.notWired" -}}
{{- $pools := include "duet.pools" . | fromJsonArray }}
{{- $drafterGroup := include "duet.drafterGroup" . | fromJson }}
{{- $drafting := list }}
{{- if and .Values.autoscaling.duet.enabled (not (include "duet.autoscalerOn" .)) }}
- autoscaling.duet.enabled: no pool has both slo and a profile of its model, so Duet's SLO autoscaler scales nothing and every pool keeps its size; give a pool a p90 target (slo) and a capacity profile (`duet profile --out FILE`), or set autoscaling.duet.enabled: false
{{- end }}
{{- range $pools }}
{{- if and .slo .profile $.Values.autoscaling.duet.enabled (not (include "duet.profileFits" (dict "root" $ "p" .))) }}
- pools[{{ .name }}].profile was measured for model {{ .profile.model }}, not the model this pool serves ({{ include "duet.poolModel" (dict "root" $ "p" .) }}): a replica's capacity is the model's, so Duet's SLO autoscaler leaves this pool at its size; give it the profile `duet profile --model <its model> --out FILE` measures
{{- end }}
{{- if and (or .slo .profile) (not (and .slo .profile $.Values.autoscaling.duet.enabled)) }}
- pools[{{ .name }}].slo/profile: Duet's SLO autoscaler scales a pool only with slo, profile and autoscaling.duet.enabled all set; this pool keeps its size (KubeRay's in-tree autoscaler, if on, still adds pods for pending placements)
{{- end }}
{{- if and (eq .speculative.method "draft_model") (not .speculative.drafterPool) }}{{ $drafting = append $drafting .name }}
{{- if not .drafterResourcesResolved }}
- pools[{{ .name }}].speculative.drafterResources is {}: its drafter actors ask for CPUs only, so Ray may put them on any pod with spare CPUs and KubeRay's autoscaler may add another group's pod for them; enable drafters (or name a resource)
{{- end }}
{{- end }}
{{- end }}
{{- if and $drafterGroup (not $drafting) }}
- drafters.enabled: no pool has speculative.method draft_model with a private drafter (no drafterPool), so nothing requests the drafter pods' "{{ .Values.drafters.rayResource }}" resource
{{- end }}
{{- end }}

{{/* The router's security settings: environment of the router container only (cluster/config/duet.py
reads DUET_TLS_* and DUET_AUTH_TOKENS_FILE), so the shared ConfigMap names no file that exists only
in router pods. */}}
{{- define "duet.routerSecurityEnv" -}}
{{- if .Values.router.tls.secretName }}
- {name: DUET_TLS_CERT_FILE, value: /etc/duet/tls/tls.crt}
- {name: DUET_TLS_KEY_FILE, value: /etc/duet/tls/tls.key}
{{- if .Values.router.tls.requireClientCerts }}
- {name: DUET_TLS_CLIENT_CA_FILE, value: /etc/duet/tls/ca.crt}
{{- end }}
{{- end }}
{{- if .Values.router.auth.tokensSecret }}
- {name: DUET_AUTH_TOKENS_FILE, value: /etc/duet/auth/tokens}
{{- end }}
{{- end }}

{{/* A router probe on health service $service: kubelet's gRPC probe, or over TLS the healthcheck command. */}}
{{- define "duet.routerProbe" -}}
{{- $v := .root.Values }}
{{- if $v.router.tls.secretName }}
exec:
  command:
    - python
    - -m
    - router.healthcheck
    - --target
    - {{ printf "127.0.0.1:%d" (int $v.router.port) }}
    - --service
    - {{ .service | quote }}
    - --tls-ca
    - /etc/duet/tls/ca.crt
    - --tls-server-name
    - {{ $v.router.tls.serverName }}
    {{- if $v.router.tls.requireClientCerts }}
    - --tls-cert
    - /etc/duet/tls/tls.crt
    - --tls-key
    - /etc/duet/tls/tls.key
    {{- end }}
{{- else if .service }}
grpc: {port: {{ $v.router.port }}, service: {{ .service }}}
{{- else }}
grpc: {port: {{ $v.router.port }}}
{{- end }}
{{- end }}

{{/* The Duet config file (YAML) held by the ConfigMap. */}}
{{/* One model's Duet config section (JSON) from a `model` / `models[]` value: "m" the value, "shared"
the shared_weights_dir, "served" whether it may carry servedName (models[] entries). */}}
{{- define "duet.modelConfig" -}}
{{- $m := .m }}
{{- $adapters := list }}
{{- range ($m.adapters | default list) }}
{{- $adapters = append $adapters (dict "name" .name "source" .source "pinned" (.pinned | default false)) }}
{{- end }}
{{- $out := dict "name" $m.name "dtype" ($m.dtype | default "auto") "max_model_len" $m.maxModelLen
      "quantization" ($m.quantization | default "none") "shared_weights_dir" .shared "adapters" $adapters
      "adapter_dir" $m.adapterDir }}
{{- if and .served $m.servedName }}{{ $_ := set $out "served_name" $m.servedName }}{{ end }}
{{- toJson $out }}
{{- end }}

{{/* The served names of the deployment's models (JSON list): models[] (servedName, else the last path
component of name), or the one model's. */}}
{{- define "duet.servedModels" -}}
{{- $out := list }}
{{- range (.Values.models | default (list .Values.model)) }}
{{- $out = append $out (.servedName | default (base .name)) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{- define "duet.config" -}}
{{- $v := .Values }}
{{- $pools := list }}
{{- range (include "duet.pools" . | fromJsonArray) }}
{{- $engine := dict "block_size" (int .engine.blockSize) "kv_cache_memory_bytes" (toString .engine.kvCacheMemory)
      "max_num_batched_tokens" (int .engine.maxNumBatchedTokens) "max_num_seqs" (int .engine.maxNumSeqs)
      "enable_prefix_caching" .engine.enablePrefixCaching "device" (.engine.device | default "auto")
      "cuda_graphs" (.engine.cudaGraphs | default false)
      "host_tier_bytes" (toString (ternary "auto" .engine.hostTierMemory (kindIs "invalid" .engine.hostTierMemory)))
      "disk_tier_bytes" (toString (.engine.diskTierSize | default "0"))
      "host_tier_shared" (.engine.hostTierShared | default false)
      "tier_load_timeout_s" (float64 (.engine.tierLoadTimeoutSeconds | default 0.5))
      "tier_policy" (.engine.tierPolicy | default "lru")
      "kv_cache_dtype" (.engine.kvCacheDtype | default "auto")
      "lora" (dict "enabled" .engine.lora.enabled "max_loaded" (int .engine.lora.maxLoaded)
                   "max_rank" (int .engine.lora.maxRank)) }}
{{- $sp := .speculative }}
{{- $speculative := dict "method" $sp.method "num_speculative_tokens" (int $sp.numSpeculativeTokens)
      "adaptive" $sp.adaptive "ngram_min" (int $sp.ngramMin) "ngram_max" (int $sp.ngramMax)
      "draft_model" $sp.draftModel "draft_quantization" $sp.draftQuantization "drafter_cpus" (int $sp.drafterCpus)
      "drafter_resources" .drafterResourcesResolved "draft_timeout_s" (float64 $sp.draftTimeoutSeconds)
      "overlap" $sp.overlap "drafter_device" ($sp.drafterDevice | default "auto") "drafter_pool" $sp.drafterPool }}
{{- $pool := dict "name" .name "role" .role "model" .model "replicas" (int .replicas)
      "cpus_per_replica" (int .cpusPerRank) "placement_strategy" .placementStrategy
      "max_restarts" (int .maxRestarts) "ep_size" (int .epSize) "sp_size" (int .spSize) "tp_size" (int .tpSize)
      "gpus_per_rank" (int .gpusPerRank) "resources_per_rank" (dict .rayResource 1)
      "standby_replicas" (int .standbyReplicas) "standby_load" (.standbyLoad | default "model") "engine" $engine "speculative" $speculative }}
{{- if eq .role "drafter" }}
{{- $d := .drafter }}
{{- $_ := set $pool "drafter" (dict "model" $d.model "quantization" $d.quantization "threads" (int $d.threads)
      "idle_timeout_s" (float64 $d.idleTimeoutSeconds)) }}
{{- end }}
{{- $pools = append $pools $pool }}
{{- end }}
{{- $shared := ternary (printf "%s/weights" $v.modelCache.mountPath) nil (and $v.modelCache.enabled $v.modelCache.sharedWeights) }}
{{- $models := list }}
{{- range $v.models }}
{{- $models = append $models (include "duet.modelConfig" (dict "m" . "shared" $shared "served" true) | fromJson) }}
{{- end }}
{{- $config := dict
  "pools" $pools
  "router" (dict "host" "0.0.0.0" "port" (int $v.router.port) "http_port" (int $v.router.httpPort)
      "policy" $v.router.policy
      "policy_options" $v.router.policyOptions "max_in_flight" (int $v.router.maxInFlight)
      "max_queue" (int $v.router.maxQueue) "shutdown_grace_s" (float64 $v.router.shutdownGraceSeconds)
      "wake_timeout_s" (float64 $v.router.wakeTimeoutSeconds)
      "max_request_bytes" (toString $v.router.maxRequestBytes))
  "ray" (dict "address" "auto" "namespace" $v.rayNamespace)
  "controller" (dict "poll_interval_s" (float64 $v.head.controller.pollIntervalSeconds)
      "start_timeout_s" (float64 $v.head.controller.startTimeoutSeconds) "host" "0.0.0.0"
      "port" (int $v.head.controller.port)) }}
{{- if $models }}
{{- $_ := set $config "models" $models }}
{{- else }}
{{- $_ := set $config "model" (include "duet.modelConfig" (dict "m" $v.model "shared" $shared "served" false) | fromJson) }}
{{- end }}
{{- with (include "duet.autoscaledPools" . | fromJsonArray) }}
{{- $scaled := list }}
{{- range . }}
{{- $p := dict "pool" .name "min_replicas" (int .minReplicas) "max_replicas" (int .maxReplicas)
      "profile" (printf "/etc/duet/profile-%s.json" .name) "max_standby" (int .maxStandby) }}
{{- if .slo.ttftMs }}{{ $_ := set $p "slo_ttft_ms" (float64 .slo.ttftMs) }}{{ end }}
{{- if .slo.tpotMs }}{{ $_ := set $p "slo_tpot_ms" (float64 .slo.tpotMs) }}{{ end }}
{{- $scaled = append $scaled $p }}
{{- end }}
{{- $d := $v.autoscaling.duet }}
{{- $auto := dict "enabled" true "interval_s" (float64 $d.intervalSeconds) "drain_grace_s" (float64 $d.drainGraceSeconds)
      "down_cooldown_s" (float64 $d.downCooldownSeconds) "actuator" $d.actuator "pools" $scaled
      "scale_to_zero_after_s" (float64 $d.scaleToZeroAfterSeconds)
      "metrics_urls" (list (printf "dns+http://%s-router-pods:%d/metrics" (include "duet.fullname" $) (int $v.router.metrics.port))) }}
{{- if eq $d.actuator "kubernetes" }}
{{- $_ := set $auto "kubernetes" (dict "raycluster" (include "duet.fullname" $) "namespace" $.Release.Namespace) }}
{{- end }}
{{- $_ := set $config "autoscaling" $auto }}
{{- end }}
{{- toYaml $config }}
{{- end }}
