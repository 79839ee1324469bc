{{/* Names. */}}
{{- define "epp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "epp.fullname" -}}
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

{{- define "epp.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "epp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "epp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "epp.poolName" -}}
{{- required "pool.name is required" .Values.pool.name -}}
{{- end -}}

{{/* The EPP Service's in-cluster DNS name. */}}
{{- define "epp.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "epp.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* "true" when the legacy InferenceModel objects are rendered (see values.yaml). */}}
{{- define "epp.renderInferenceModels" -}}
{{- if and .Values.legacyInferenceModels.models (or (eq .Values.legacyInferenceModels.render "always") (.Capabilities.APIVersions.Has "inference.networking.x-k8s.io/v1alpha2/InferenceModel")) -}}
true
{{- end -}}
{{- end -}}

{{/*
The Secret holding the replicas' shared secret: replicas.secret.existingSecret, or the one
the chart creates (templates/secret-peers.yaml) from replicas.secret.value or, with
replicas.secret.generate, a random one; empty: none (the peers port is unauthenticated).
*/}}
{{- define "epp.peersSecretName" -}}
{{- if .Values.replicas.secret.existingSecret -}}
{{- .Values.replicas.secret.existingSecret -}}
{{- else if or .Values.replicas.secret.value .Values.replicas.secret.generate -}}
{{- printf "%s-peers-secret" (include "epp.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Where the EPP reads it: a directory mount of that Secret, the one key as `secret`. */}}
{{- define "epp.peersSecretDir" -}}/etc/epp/peers-secret{{- end -}}

{{- define "epp.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
Labels. Call with (dict "ctx" $ "component" "endpoint-picker").
*/}}
{{- define "epp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epp.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "epp.labels" -}}
helm.sh/chart: {{ include "epp.chart" .ctx }}
{{ include "epp.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end -}}

{{/*
Checks the values a template cannot render sensibly without (values.schema.json checks
types and enums when Helm installs; these hold for any renderer).
*/}}
{{- define "epp.validate" -}}
{{- if and (gt (int .Values.workers) 1) (gt (int .Values.replicaCount) 1) -}}
{{- fail "workers > 1 with replicaCount > 1 is not supported: choose one (README, Workers)" -}}
{{- end -}}
{{- if not (has .Values.bodyMode (list "FULL_DUPLEX_STREAMED" "BUFFERED")) -}}
{{- fail (printf "bodyMode must be FULL_DUPLEX_STREAMED or BUFFERED, got %v" .Values.bodyMode) -}}
{{- end -}}
{{- if not (has .Values.failureMode (list "FailOpen" "FailClose")) -}}
{{- fail (printf "failureMode must be FailOpen or FailClose, got %v" .Values.failureMode) -}}
{{- end -}}
{{- if not (has .Values.discovery.mode (list "kubernetes" "static")) -}}
{{- fail (printf "discovery.mode must be kubernetes or static, got %v" .Values.discovery.mode) -}}
{{- end -}}
{{- with .Values.scheduling.weights -}}
{{- $sum := 0.0 -}}
{{- range $name, $weight := . -}}
{{- $sum = addf $sum $weight -}}
{{- end -}}
{{- if or (lt $sum 0.999999) (gt $sum 1.000001) -}}
{{- fail (printf "scheduling.weights must sum to 1.0, got %v" $sum) -}}
{{- end -}}
{{- end -}}
{{- $ports := default (list) .Values.pool.targetPorts -}}
{{- if and .Values.pool.create (or (lt (len $ports) 1) (gt (len $ports) 8)) -}}
{{- fail "pool.targetPorts must list 1 to 8 ports" -}}
{{- end -}}
{{- if hasKey .Values "models" -}}
{{- fail "models: is gone: it rendered InferenceModel, a CRD removed in the Gateway API Inference Extension v1.0. Use inferenceObjectives and modelRewrites (InferenceObjective, InferenceModelRewrite), or legacyInferenceModels.models for a cluster that still serves InferenceModel" -}}
{{- end -}}
{{- if hasKey .Values.tls "enabled" -}}
{{- fail "tls.enabled is gone: TLS is on by default (tls.secureServing: true, a self-signed certificate unless tls.secretName names a Secret); tls.secureServing: false serves plaintext" -}}
{{- end -}}
{{- if not (has .Values.inferenceApiGroup (list "llm-d.ai" "inference.networking.x-k8s.io")) -}}
{{- fail (printf "inferenceApiGroup must be llm-d.ai or inference.networking.x-k8s.io, got %v" .Values.inferenceApiGroup) -}}
{{- end -}}
{{- if not (has .Values.provider.name (list "none" "istio" "gke" "kgateway" "envoy-ai-gateway")) -}}
{{- fail (printf "provider.name must be none, istio, gke, kgateway or envoy-ai-gateway, got %v" .Values.provider.name) -}}
{{- end -}}
{{- if not (has .Values.legacyInferenceModels.render (list "ifServed" "always")) -}}
{{- fail (printf "legacyInferenceModels.render must be ifServed or always, got %v" .Values.legacyInferenceModels.render) -}}
{{- end -}}
{{- if not (has .Values.pool.group (list "inference.networking.k8s.io" "inference.networking.x-k8s.io")) -}}
{{- fail (printf "pool.group must be inference.networking.k8s.io or inference.networking.x-k8s.io, got %v" .Values.pool.group) -}}
{{- end -}}
{{- if and .Values.pool.create (ne .Values.pool.group "inference.networking.k8s.io") -}}
{{- fail "pool.create renders an inference.networking.k8s.io/v1 InferencePool: with pool.group inference.networking.x-k8s.io set pool.create=false (an existing v1alpha2 pool)" -}}
{{- end -}}
{{- if not (has .Values.pool.appProtocol (list "" "http" "kubernetes.io/h2c")) -}}
{{- fail (printf "pool.appProtocol must be empty, http or kubernetes.io/h2c, got %v" .Values.pool.appProtocol) -}}
{{- end -}}
{{- if and (not .Values.tls.secureServing) .Values.tls.secretName -}}
{{- fail "tls.secretName needs tls.secureServing: true (a certificate for a plaintext port)" -}}
{{- end -}}
{{- if and .Values.tls.clientAuth (not .Values.tls.secretName) -}}
{{- fail "tls.clientAuth needs tls.secretName (its ca.crt verifies the clients)" -}}
{{- end -}}
{{- if and .Values.standaloneEnvoy.enabled .Values.tls.clientAuth -}}
{{- fail "standaloneEnvoy has no client certificate: disable tls.clientAuth or standaloneEnvoy" -}}
{{- end -}}
{{- if and .Values.gateway.create (not .Values.gateway.className) -}}
{{- fail "gateway.className is required with gateway.create (a class whose controller supports InferencePool backends)" -}}
{{- end -}}
{{- if and .Values.gateway.create .Values.gateway.namespace (ne .Values.gateway.namespace .Release.Namespace) -}}
{{- fail "gateway.create makes the Gateway in the release namespace: leave gateway.namespace empty" -}}
{{- end -}}
{{- if and .Values.gateway.createClass (not .Values.gateway.controllerName) -}}
{{- fail "gateway.controllerName is required with gateway.createClass" -}}
{{- end -}}
{{- $ports := list (int .Values.ports.grpc) (int .Values.ports.grpcHealth) (int .Values.ports.metrics) -}}
{{- if gt (int .Values.replicaCount) 1 -}}
{{- $ports = append $ports (int .Values.ports.peers) -}}
{{- end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "ports must differ, got %v" $ports) -}}
{{- end -}}
{{- with .Values.replicas.secret -}}
{{- if and .existingSecret .value -}}
{{- fail "replicas.secret: set existingSecret or value, not both" -}}
{{- end -}}
{{- if and .value (lt (len (trim .value)) 16) -}}
{{- fail "replicas.secret.value must be at least 16 characters (the EPP refuses shorter secrets): e.g. openssl rand -hex 32" -}}
{{- end -}}
{{- if and (or .existingSecret .value) (not .key) -}}
{{- fail "replicas.secret.key is required with replicas.secret.existingSecret or .value" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Each worker's /metrics port, space-separated, worker 0 first (one port with workers: 1).
The rule of epp.serving.workers.metrics_ports, on the configuration the chart renders:
worker i takes the i-th port from server.metrics_port that no other port setting takes
(gRPC, gRPC health, replicas.listen_port (9010 unless set), server.debug_port (9091 unless
set; null: none)). tests/deploy/test_chart_workers.py holds the two to the same ports.
*/}}
{{- define "epp.metricsPorts" -}}
{{- $config := fromYaml (include "epp.config" .) -}}
{{- $server := $config.server -}}
{{- $replicas := dict -}}
{{- if hasKey $config "replicas" -}}
{{- $replicas = $config.replicas -}}
{{- end -}}
{{- $taken := list (int64 $server.grpc_port) (int64 $server.grpc_health_port) -}}
{{- $taken = append $taken (int64 (ternary $replicas.listen_port 9010 (hasKey $replicas "listen_port"))) -}}
{{- if not (hasKey $server "debug_port") -}}
{{- $taken = append $taken (int64 9091) -}}
{{- else if not (kindIs "invalid" $server.debug_port) -}}
{{- $taken = append $taken (int64 $server.debug_port) -}}
{{- end -}}
{{- $count := int .Values.workers -}}
{{- $first := int64 $server.metrics_port -}}
{{- $ports := list -}}
{{- range $offset := until (add $count (len $taken) | int) -}}
{{- $port := add $first $offset -}}
{{- if and (lt (len $ports) $count) (not (has $port $taken)) -}}
{{- $ports = append $ports $port -}}
{{- end -}}
{{- end -}}
{{- if gt (int64 (last $ports)) 65535 -}}
{{- fail (printf "workers %d from ports.metrics %d: past port 65535" $count $first) -}}
{{- end -}}
{{- join " " $ports -}}
{{- end -}}

{{/*
The EPP's configuration file (`epp serve --config`): EppConfig keys only. extraConfig
first, then the keys the chart manages set over it (plain `set`, so a 0 or false from
values still wins, unlike a merge).
*/}}
{{- define "epp.config" -}}
{{- $config := deepCopy .Values.extraConfig -}}
{{- $scheduling := dict -}}
{{- if hasKey $config "scheduling" -}}
{{- $scheduling = get $config "scheduling" -}}
{{- end -}}
{{- $_ := set $scheduling "max_queue" .Values.scheduling.maxQueue -}}
{{- $_ := set $scheduling "fallbacks" .Values.scheduling.fallbacks -}}
{{- with .Values.scheduling.weights -}}
{{- $_ := set $scheduling "weights" . -}}
{{- end -}}
{{- $_ := set $config "scheduling" $scheduling -}}
{{- $server := dict -}}
{{- if hasKey $config "server" -}}
{{- $server = get $config "server" -}}
{{- end -}}
{{- $_ := set $server "grpc_port" .Values.ports.grpc -}}
{{- $_ := set $server "grpc_health_port" .Values.ports.grpcHealth -}}
{{- $_ := set $server "metrics_port" .Values.ports.metrics -}}
{{- $_ := set $server "assumed_body_mode" .Values.bodyMode -}}
{{- $_ := set $server "secure_serving" .Values.tls.secureServing -}}
{{- if gt (int .Values.workers) 1 -}}
{{- $_ := set $server "workers" (int .Values.workers) -}}
{{- end -}}
{{- if .Values.tls.secretName -}}
{{- $tls := dict "cert_file" "/etc/epp/tls/tls.crt" "key_file" "/etc/epp/tls/tls.key" -}}
{{- if .Values.tls.clientAuth -}}
{{- $_ := set $tls "client_ca_file" "/etc/epp/tls/ca.crt" -}}
{{- end -}}
{{- $_ := set $server "tls" $tls -}}
{{- end -}}
{{- $_ := set $config "server" $server -}}
{{- /* Replicas find each other through the headless Service (templates/service-peers.yaml);
one replica has no peers and listens on no peers port. */ -}}
{{- if gt (int .Values.replicaCount) 1 -}}
{{- $replicas := dict -}}
{{- if hasKey $config "replicas" -}}
{{- $replicas = get $config "replicas" -}}
{{- end -}}
{{- $_ := set $replicas "peers" (list (printf "%s-peers:%v" (include "epp.fullname" .) .Values.ports.peers)) -}}
{{- $_ := set $replicas "listen_port" .Values.ports.peers -}}
{{- if include "epp.peersSecretName" . -}}
{{- $_ := set $replicas "secret_file" (printf "%s/secret" (include "epp.peersSecretDir" .)) -}}
{{- end -}}
{{- $_ := set $config "replicas" $replicas -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/*
The chart file with the standalone Envoy configuration for bodyMode and failureMode (and,
for a plaintext EPP, its -plaintext variant when the chart ships one).
*/}}
{{- define "epp.envoyConfig" -}}
{{- $file := printf "files/envoy-%s-%s%s.yaml" (.Values.bodyMode | lower | replace "_" "-") (ternary "fail-open" "fail-close" (eq .Values.failureMode "FailOpen")) (ternary "" "-plaintext" .Values.tls.secureServing) -}}
{{- $text := .Files.Get $file -}}
{{- if not $text -}}
{{- if .Values.tls.secureServing -}}
{{- fail (printf "missing chart file %s" $file) -}}
{{- else -}}
{{- fail "standaloneEnvoy dials the EPP over TLS: it needs tls.secureServing: true" -}}
{{- end -}}
{{- end -}}
{{- $text | replace "EPP_SERVICE_HOST" (include "epp.fullname" .) -}}
{{- end -}}
