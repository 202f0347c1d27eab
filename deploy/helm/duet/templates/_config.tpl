{{/*
The ONE place where chart values become Duet's config (cluster/config.py, loaded by `duet serve`
on the Ray head and by `duet router`). Only keys the loader of this Duet version accepts are
emitted; a value the code does not use yet is listed by "duet.notWired" (NOTES.txt prints it) and
documented as "not yet used" in README.md. When the code grows a key, extend the dicts below and
"duet.wiredRoles"; tests/deploy/test_helm_chart.py loads every rendered config with the real loader.
*/}}

{{/* Pool roles the Duet code serves; pools of other roles get a worker group but no Duet pool. */}}
{{- define "duet.wiredRoles" -}}
colocated
{{- end }}

{{/* How many pools of wired roles the code accepts (cluster/config.py: exactly one for now). */}}
{{- define "duet.maxWiredPools" -}}
1
{{- end }}

{{- define "duet.wiredPools" -}}
{{- $roles := splitList " " (include "duet.wiredRoles" .) }}
{{- $out := list }}
{{- range (include "duet.pools" . | fromJsonArray) }}
{{- if has .role $roles }}{{ $out = append $out . }}{{ end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* Cross-field checks the JSON schema cannot express; each message names the value and the fix. */}}
{{- define "duet.validate" -}}
{{- $names := list }}
{{- range $i, $p := (include "duet.pools" . | fromJsonArray) }}
{{- if has $p.name $names }}
{{- fail (printf "pools[%d].name=%q: pool names must be unique" $i $p.name) }}
{{- end }}
{{- $names = append $names $p.name }}
{{- if or (lt (int $p.replicas) (int $p.minReplicas)) (gt (int $p.replicas) (int $p.maxReplicas)) }}
{{- fail (printf "pools[%d] (%s): replicas=%v must be between minReplicas=%v and maxReplicas=%v" $i $p.name $p.replicas $p.minReplicas $p.maxReplicas) }}
{{- end }}
{{- if gt (int $p.engine.maxNumSeqs) (int $p.engine.maxNumBatchedTokens) }}
{{- fail (printf "pools[%d] (%s): engine.maxNumSeqs=%v must be <= engine.maxNumBatchedTokens=%v" $i $p.name $p.engine.maxNumSeqs $p.engine.maxNumBatchedTokens) }}
{{- end }}
{{- end }}
{{- $wired := include "duet.wiredPools" . | fromJsonArray }}
{{- range $wired }}
{{- if lt (int .replicas) 1 }}
{{- fail (printf "pools (%s): replicas=%v: a %s pool serves with at least 1 worker (Duet's pool.replicas >= 1)" .name .replicas .role) }}
{{- end }}
{{- end }}
{{- if ne (len $wired) (int (include "duet.maxWiredPools" .)) }}
{{- fail (printf "pools: this Duet version serves exactly %s pool(s) of role %s; found %d (add one with role: colocated, or remove extras)" (include "duet.maxWiredPools" .) (include "duet.wiredRoles" .) (len $wired)) }}
{{- end }}
{{- if and .Values.router.tls.secretName (not .Values.router.tls.serverName) }}
{{- fail "router.tls.serverName: required with router.tls.secretName (a name in the certificate; the probes check it)" }}
{{- end }}
{{- if and .Values.router.tls.requireClientCerts (not .Values.router.tls.secretName) }}
{{- fail "router.tls.requireClientCerts=true needs router.tls.secretName (mTLS is TLS with client certificates)" }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not .Values.router.metrics.enabled) }}
{{- fail "serviceMonitor.enabled=true needs router.metrics.enabled=true (there is nothing to scrape otherwise)" }}
{{- end }}
{{- end }}

{{/* Values the chart accepts but this Duet version does not use yet (one line each). */}}
{{- define "duet.notWired" -}}
{{- $roles := splitList " " (include "duet.wiredRoles" .) }}
{{- range (include "duet.pools" . | fromJsonArray) }}
{{- if not (has .role $roles) }}
- pools[{{ .name }}].role={{ .role }}: the worker group "{{ include "duet.groupName" .name }}" is created, but Duet starts no {{ .role }} workers yet (Ray may place the colocated pool's workers on its CPUs)
{{- end }}
{{- if gt (int .epSize) 1 }}
- pools[{{ .name }}].epSize={{ .epSize }}: expert parallelism is not built yet; each worker runs the whole model
{{- end }}
{{- if .slo }}
- pools[{{ .name }}].slo: the SLO autoscaler is not built yet; the pool keeps its size (KubeRay's autoscaler still applies)
{{- end }}
{{- if gt (int .gpusPerReplica) 0 }}
- pools[{{ .name }}].gpusPerReplica={{ .gpusPerReplica }}: pods get the GPUs, but Duet's pool config has no GPU key yet (actors reserve CPUs only)
{{- end }}
{{- end }}
{{- end }}

{{/* The router's security settings: environment of the router container only (cluster/config.py
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
{{- define "duet.config" -}}
{{- $v := .Values }}
{{- $pools := list }}
{{- range (include "duet.wiredPools" . | fromJsonArray) }}
{{- $engine := dict "block_size" (int .engine.blockSize) "kv_cache_memory_bytes" (toString .engine.kvCacheMemory)
      "max_num_batched_tokens" (int .engine.maxNumBatchedTokens) "max_num_seqs" (int .engine.maxNumSeqs)
      "enable_prefix_caching" .engine.enablePrefixCaching }}
{{- $pools = append $pools (dict "name" .name "role" .role "replicas" (int .replicas)
      "cpus_per_replica" (int .cpusPerReplica) "placement_strategy" .placementStrategy
      "max_restarts" (int .maxRestarts) "engine" $engine) }}
{{- end }}
{{- $config := dict
  "model" (dict "name" $v.model.name "dtype" $v.model.dtype "max_model_len" $v.model.maxModelLen)
  "pools" $pools
  "router" (dict "host" "0.0.0.0" "port" (int $v.router.port) "policy" $v.router.policy
      "policy_options" $v.router.policyOptions "max_in_flight" (int $v.router.maxInFlight)
      "max_queue" (int $v.router.maxQueue) "shutdown_grace_s" (float64 $v.router.shutdownGraceSeconds)
      "max_request_bytes" (toString $v.router.maxRequestBytes))
  "ray" (dict "address" "auto" "namespace" $v.rayNamespace)
  "controller" (dict "poll_interval_s" (float64 $v.head.controller.pollIntervalSeconds)
      "start_timeout_s" (float64 $v.head.controller.startTimeoutSeconds) "host" "0.0.0.0"
      "port" (int $v.head.controller.port)) }}
{{- toYaml $config }}
{{- end }}
