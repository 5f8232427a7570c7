{{/* Common labels. */}}
{{- define "kiwi.labels" -}}
app.kubernetes.io/name: kiwi
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kiwi
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The image reference. */}}
{{- define "kiwi.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Checks values that would otherwise fail late, on the nodes. */}}
{{- define "kiwi.validate" -}}
{{- if not (has (toString .Values.scheduler) (list "on" "off")) -}}
{{- fail (printf "scheduler must be \"on\" or \"off\", not %q" (toString .Values.scheduler)) -}}
{{- end -}}
{{- if le (float64 .Values.tq) 0.0 -}}
{{- fail (printf "tq must be a positive number of seconds, not %v" .Values.tq) -}}
{{- end -}}
{{- if lt (int .Values.swapBudgetMiB) 0 -}}
{{- fail (printf "swapBudgetMiB must be 0 (what the swap pool holds) or more, not %v" .Values.swapBudgetMiB) -}}
{{- end -}}
{{- if lt (int .Values.vgpusPerGpu) 1 -}}
{{- fail (printf "vgpusPerGpu must be at least 1, not %v" .Values.vgpusPerGpu) -}}
{{- end -}}
{{- if lt (int .Values.arbiter.limitNofile) 1024 -}}
{{- fail (printf "arbiter.limitNofile must be at least 1024, not %v" .Values.arbiter.limitNofile) -}}
{{- end -}}
{{- if not (has .Values.deviceListStrategy (list "envvar" "cdi-cri" "cdi-annotations")) -}}
{{- fail (printf "deviceListStrategy must be envvar, cdi-cri or cdi-annotations, not %q" .Values.deviceListStrategy) -}}
{{- end -}}
{{- end -}}
