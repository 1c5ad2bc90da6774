{{/* Names, labels and the environment every Stovepipe pod shares. */}}

{{- define "stovepipe.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name: the release name, with the chart's unless it holds it. */}}
{{- define "stovepipe.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "stovepipe.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Helm's standard labels; a component is added where it tells pods apart. */}}
{{- define "stovepipe.labels" -}}
helm.sh/chart: {{ include "stovepipe.chart" . }}
{{ include "stovepipe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stovepipe
{{- end }}

{{- define "stovepipe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stovepipe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stovepipe.workerSelectorLabels" -}}
{{ include "stovepipe.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{- define "stovepipe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stovepipe.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "stovepipe.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret the workers read their secret environment from. */}}
{{- define "stovepipe.secretName" -}}
{{- default (include "stovepipe.fullname" .) .Values.secrets.existingSecret }}
{{- end }}

{{/* The Secret the migration Job reads: a hook of its own when the chart makes the
secrets (a pre-install hook runs before the release's other resources exist). */}}
{{- define "stovepipe.migrateSecretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else }}
{{- printf "%s-migrate" (include "stovepipe.fullname" .) }}
{{- end }}
{{- end }}

{{- define "stovepipe.usesSasl" -}}
{{- if has .Values.kafka.securityProtocol (list "SASL_PLAINTEXT" "SASL_SSL") }}true{{ end }}
{{- end }}

{{- define "stovepipe.usesTls" -}}
{{- if has .Values.kafka.securityProtocol (list "SSL" "SASL_SSL") }}true{{ end }}
{{- end }}

{{/* Values that cannot work together: refused before anything is applied (the worker
refuses the same Kafka settings at start; streams/config/kafka_security.py). */}}
{{- define "stovepipe.checks" -}}
{{- $w := .Values.worker }}
{{- $startup := mul .Values.probes.startup.periodSeconds .Values.probes.startup.failureThreshold }}
{{- if lt (int $w.sessionTimeoutSeconds) (int (add $w.terminationGracePeriodSeconds $startup)) }}
{{- fail (printf "worker.sessionTimeoutSeconds (%v) must be at least worker.terminationGracePeriodSeconds (%v) + the startup probe's allowance (%v = periodSeconds * failureThreshold): a restarted pod must rejoin its consumer group before the session ends, or its restart rebalances every worker" $w.sessionTimeoutSeconds $w.terminationGracePeriodSeconds $startup) }}
{{- end }}
{{- if lt (int $w.maxReplicas) (int $w.minReplicas) }}
{{- fail (printf "worker.maxReplicas (%v) is below worker.minReplicas (%v)" $w.maxReplicas $w.minReplicas) }}
{{- end }}
{{- $k := .Values.kafka }}
{{- $protocol := default "PLAINTEXT" $k.securityProtocol }}
{{- $o := $k.sasl.oauthbearer }}
{{- $saslSet := or $k.sasl.mechanism $k.sasl.username $o.clientId $o.tokenEndpointUrl $o.scope $o.extensions }}
{{- if and $saslSet (not (include "stovepipe.usesSasl" .)) }}
{{- fail (printf "kafka.sasl is set but kafka.securityProtocol is %s, which ignores it: use SASL_SSL (or SASL_PLAINTEXT)" $protocol) }}
{{- end }}
{{- if and (include "stovepipe.usesSasl" .) (not $k.sasl.mechanism) }}
{{- fail (printf "kafka.securityProtocol %s needs kafka.sasl.mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER)" $protocol) }}
{{- end }}
{{- $tlsSet := or $k.tls.caSecret $k.tls.clientSecret $k.tls.endpointIdentification }}
{{- if and $tlsSet (not (include "stovepipe.usesTls" .)) }}
{{- fail (printf "kafka.tls is set but kafka.securityProtocol is %s, which ignores it: use SSL or SASL_SSL" $protocol) }}
{{- end }}
{{- end }}

{{/* The environment of every Stovepipe container but its secrets: where Kafka and
PostgreSQL are and how to reach them. */}}
{{- define "stovepipe.env" -}}
- name: STOVEPIPE_KAFKA_BOOTSTRAP
  value: {{ .Values.kafka.bootstrap | quote }}
- name: STOVEPIPE_TOPIC_PREFIX
  value: {{ .Values.kafka.topicPrefix | quote }}
- name: STOVEPIPE_APP_ID
  value: {{ .Values.kafka.consumerGroup | quote }}
- name: STOVEPIPE_POSTGRES_DSN
  value: {{ .Values.postgres.dsn | quote }}
{{- if .Values.topicsYaml }}
- name: STOVEPIPE_TOPICS_FILE
  value: /etc/stovepipe/config/topics.yaml
{{- end }}
{{- $k := .Values.kafka }}
{{- if $k.securityProtocol }}
- name: STOVEPIPE_KAFKA_SECURITY_PROTOCOL
  value: {{ $k.securityProtocol | quote }}
{{- end }}
{{- if $k.sasl.mechanism }}
- name: STOVEPIPE_KAFKA_SASL_MECHANISM
  value: {{ $k.sasl.mechanism | quote }}
{{- end }}
{{- if $k.sasl.username }}
- name: STOVEPIPE_KAFKA_SASL_USERNAME
  value: {{ $k.sasl.username | quote }}
{{- end }}
{{- with $k.sasl.oauthbearer }}
{{- if .clientId }}
- name: STOVEPIPE_KAFKA_SASL_OAUTHBEARER_METHOD
  value: oidc
- name: STOVEPIPE_KAFKA_SASL_OAUTHBEARER_CLIENT_ID
  value: {{ .clientId | quote }}
{{- end }}
{{- if .tokenEndpointUrl }}
- name: STOVEPIPE_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL
  value: {{ .tokenEndpointUrl | quote }}
{{- end }}
{{- if .scope }}
- name: STOVEPIPE_KAFKA_SASL_OAUTHBEARER_SCOPE
  value: {{ .scope | quote }}
{{- end }}
{{- if .extensions }}
- name: STOVEPIPE_KAFKA_SASL_OAUTHBEARER_EXTENSIONS
  value: {{ .extensions | quote }}
{{- end }}
{{- end }}
{{- if $k.tls.caSecret }}
- name: STOVEPIPE_KAFKA_SSL_CA_LOCATION
  value: /etc/stovepipe/kafka-tls/ca/ca.crt
{{- end }}
{{- if $k.tls.clientSecret }}
- name: STOVEPIPE_KAFKA_SSL_CERTIFICATE_LOCATION
  value: /etc/stovepipe/kafka-tls/client/tls.crt
- name: STOVEPIPE_KAFKA_SSL_KEY_LOCATION
  value: /etc/stovepipe/kafka-tls/client/tls.key
{{- end }}
{{- if $k.tls.endpointIdentification }}
- name: STOVEPIPE_KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM
  value: {{ $k.tls.endpointIdentification | quote }}
{{- end }}
{{- end }}

{{/* Volumes holding the TLS material named in the values, and their mounts. */}}
{{- define "stovepipe.tlsVolumes" -}}
{{- if .Values.kafka.tls.caSecret }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.tls.caSecret }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- if .Values.kafka.tls.clientSecret }}
- name: kafka-client
  secret:
    secretName: {{ .Values.kafka.tls.clientSecret }}
    items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]
{{- end }}
{{- if .Values.postgres.caSecret }}
- name: postgres-ca
  secret:
    secretName: {{ .Values.postgres.caSecret }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- end }}

{{- define "stovepipe.tlsMounts" -}}
{{- if .Values.kafka.tls.caSecret }}
- name: kafka-ca
  mountPath: /etc/stovepipe/kafka-tls/ca
  readOnly: true
{{- end }}
{{- if .Values.kafka.tls.clientSecret }}
- name: kafka-client
  mountPath: /etc/stovepipe/kafka-tls/client
  readOnly: true
{{- end }}
{{- if .Values.postgres.caSecret }}
- name: postgres-ca
  mountPath: /etc/stovepipe/postgres-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Restricted pod security: unprivileged, read-only root, no capabilities. */}}
{{- define "stovepipe.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "stovepipe.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}
