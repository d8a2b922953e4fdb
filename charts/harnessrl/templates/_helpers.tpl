{{/* Names and labels shared by every template. */}}

{{- define "harnessrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "harnessrl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "harnessrl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "harnessrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: harnessrl
{{- end }}

{{/* The operator pod's selector; "component" keeps it apart from PostgreSQL's. */}}
{{- define "harnessrl.selector" -}}
app.kubernetes.io/name: {{ include "harnessrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "harnessrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "harnessrl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: with serviceAccount.create=false name the ServiceAccount the operator runs as" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "harnessrl.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "harnessrl.postgresql" -}}
{{- printf "%s-postgresql" (include "harnessrl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "harnessrl.webhook" -}}
{{- printf "%s-webhook" (include "harnessrl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret and key holding the store URL: the embedded PostgreSQL's, or the user's. */}}
{{- define "harnessrl.storeSecret" -}}
{{- if .Values.postgresql.enabled }}
{{- include "harnessrl.postgresql" . }}
{{- else }}
{{- required "store.existingSecret: with postgresql.enabled=false name a Secret holding the PostgreSQL URL (postgresql+psycopg://user:password@host:5432/db)" .Values.store.existingSecret }}
{{- end }}
{{- end }}

{{- define "harnessrl.storeSecretKey" -}}
{{- if .Values.postgresql.enabled }}url{{ else }}{{ .Values.store.existingSecretKey }}{{ end }}
{{- end }}

{{/* cert-manager or generated: "auto" follows whether the cluster serves cert-manager.io/v1. */}}
{{- define "harnessrl.certManager" -}}
{{- $mode := .Values.webhook.certificates }}
{{- if eq $mode "cert-manager" }}
{{- if not (.Capabilities.APIVersions.Has "cert-manager.io/v1") }}
{{- fail "webhook.certificates=cert-manager: the cluster does not serve cert-manager.io/v1 — install cert-manager, or set webhook.certificates=generated (or auto)" }}
{{- end }}
{{- true }}
{{- else if and (eq $mode "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1") }}
{{- true }}
{{- end }}
{{- end }}

{{- define "harnessrl.monitoring" -}}
{{- if and .Values.monitoring.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}
{{- true }}
{{- end }}
{{- end }}
