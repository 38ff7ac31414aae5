{{- define "cadenza.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cadenza.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* helm test pods: not the server's selector labels (the Service must never route to them). */}}
{{- define "cadenza.testLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: test
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cadenza.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The CPU image, or the CUDA one in GPU mode; a digest wins over the tag. */}}
{{- define "cadenza.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.gpu.enabled -}}
{{- $tag = .Values.image.gpuTag | default (printf "%s-cuda" .Chart.AppVersion) -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "cadenza.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "cadenza.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "cadenza.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "cadenza.fullname" .)) -}}
{{- end -}}

{{- define "cadenza.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "cadenza.fullname" .)) -}}
{{- end -}}

{{- define "cadenza.apiKeysKey" -}}
{{- if .Values.apiKeys.existingSecret -}}{{ .Values.apiKeys.existingSecretKey }}{{- else -}}api-keys{{- end -}}
{{- end -}}

{{- define "cadenza.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "cadenza.fullname" .) .Release.Namespace) -}}
{{- end -}}

{{/* The ServiceMonitor is rendered when forced, or (auto) when the Prometheus Operator's API exists. */}}
{{- define "cadenza.serviceMonitor" -}}
{{- $sm := .Values.metrics.serviceMonitor.enabled -}}
{{- if and .Values.metrics.enabled (or (eq (toString $sm) "true") (and (eq (toString $sm) "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor"))) -}}
true
{{- end -}}
{{- end -}}

{{/* `cadenza health` arguments for the server's TLS (exec probes, helm test). */}}
{{- define "cadenza.healthTlsArgs" -}}
- --tls-ca=/etc/cadenza/tls/ca.crt
- --tls-server-name={{ include "cadenza.tlsServerName" . }}
{{- if .Values.tls.clientCA.probeClientSecret }}
- --tls-cert=/etc/cadenza/probe-client/tls.crt
- --tls-key=/etc/cadenza/probe-client/tls.key
{{- end }}
{{- end -}}

{{/* Volumes for the TLS material (server and probes). */}}
{{- define "cadenza.tlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "cadenza.tlsSecret" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: {{ if .Values.tls.existingSecret }}{{ .Values.tls.caKey }}{{ else }}ca.crt{{ end }}
        path: ca.crt
{{- if .Values.tls.clientCA.existingSecret }}
- name: client-ca
  secret:
    secretName: {{ .Values.tls.clientCA.existingSecret }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if .Values.tls.clientCA.probeClientSecret }}
- name: probe-client
  secret:
    secretName: {{ .Values.tls.clientCA.probeClientSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end -}}

{{- define "cadenza.tlsMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/cadenza/tls
  readOnly: true
{{- if .Values.tls.clientCA.existingSecret }}
- name: client-ca
  mountPath: /etc/cadenza/client-ca
  readOnly: true
{{- end }}
{{- if .Values.tls.clientCA.probeClientSecret }}
- name: probe-client
  mountPath: /etc/cadenza/probe-client
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}
