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

{{/*
The Secret holding the replicas' shared secret: replicas.secret.existingSecret, or the one
the chart creates from replicas.secret.value (templates/secret-peers.yaml); empty: none.
*/}}
{{- define "epp.peersSecretName" -}}
{{- if .Values.replicas.secret.existingSecret -}}
{{- .Values.replicas.secret.existingSecret -}}
{{- else if .Values.replicas.secret.value -}}
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
{{- if and .Values.standaloneEnvoy.enabled .Values.tls.enabled -}}
{{- fail "standaloneEnvoy does not speak TLS to the EPP: disable tls or standaloneEnvoy" -}}
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
{{- $_ := set $server "metrics_port" .Values.ports.metrics -}}
{{- $_ := set $server "assumed_body_mode" .Values.bodyMode -}}
{{- if .Values.tls.enabled -}}
{{- $tls := dict "cert_file" "/etc/epp/tls/tls.crt" "key_file" "/etc/epp/tls/tls.key" -}}
{{- if .Values.tls.clientAuth -}}
{{- $_ := set $tls "client_ca_file" "/etc/epp/tls/ca.crt" -}}
{{- end -}}
{{- $_ := set $server "tls" $tls -}}
{{- end -}}
{{- $_ := set $config "server" $server -}}
{{- /* Replicas find each other through the headless Service (templates/service-peers.yaml). */ -}}
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
{{- toYaml $config -}}
{{- end -}}

{{/* The chart file with the standalone Envoy configuration for bodyMode and failureMode. */}}
{{- define "epp.envoyConfig" -}}
{{- $file := printf "files/envoy-%s-%s.yaml" (.Values.bodyMode | lower | replace "_" "-") (ternary "fail-open" "fail-close" (eq .Values.failureMode "FailOpen")) -}}
{{- $text := .Files.Get $file -}}
{{- if not $text -}}
{{- fail (printf "missing chart file %s" $file) -}}
{{- end -}}
{{- $text | replace "EPP_SERVICE_HOST" (include "epp.fullname" .) -}}
{{- end -}}
