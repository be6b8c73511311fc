{{/* Names and labels. */}}
{{- define "specdec.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specdec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specdec.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference-server
{{- end -}}

{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "specdec.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "specdec.adminSecretName" -}}
{{- default (printf "%s-admin" (include "specdec.fullname" .)) .Values.server.modelRepositoryApi.existingSecret -}}
{{- end -}}

{{- define "specdec.modelsClaimName" -}}
{{- if eq .Values.models.source "existingClaim" -}}
{{- .Values.models.existingClaim.name -}}
{{- else -}}
{{- printf "%s-models" (include "specdec.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Where the Responses API's stored responses are mounted (openai.responsesStoreClaim) */}}
{{- define "specdec.responsesStorePath" -}}/var/lib/specdec/responses{{- end -}}

{{/* Where clients' torch profiles go (openai.profiling) */}}
{{- define "specdec.profilesPath" -}}/var/lib/specdec/profiles{{- end -}}

{{/* models.fetch.loraRepos as the fetch's LORA_REPOS: name=repo,name=repo */}}
{{- define "specdec.loraRepos" -}}
{{- $pairs := list -}}
{{- range .Values.models.fetch.loraRepos -}}{{- $pairs = append $pairs (printf "%s=%s" .name .repo) -}}{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* Where models.loraClaim is mounted (writable), and the directory of LoRA adapters the models read. */}}
{{- define "specdec.loraClaimPath" -}}/var/lib/specdec/lora{{- end -}}
{{- define "specdec.loraDirectory" -}}
{{- .Values.models.loraDirectory | default (ternary (include "specdec.loraClaimPath" .) "" (ne .Values.models.loraClaim "")) -}}
{{- end -}}

{{/* The models the server loads, in load order (explicit model control). */}}
{{- define "specdec.modelNames" -}}
{{- $names := list "preprocessing" "postprocessing" "target_model" -}}
{{- if or (has .Values.models.draft.method (list "model" "skip")) (and (eq .Values.models.draft.method "head") (not .Values.models.draft.inTarget)) -}}
{{- $names = append $names "draft_model" -}}
{{- end -}}
{{- $names = concat $names (list "speculative_decoding" "vllm_compatible" "ensemble") -}}
{{- join "," $names -}}
{{- end -}}

{{/* Triton's queue-to-compute ratio for one pod, the autoscaling signal (PromQL). */}}
{{/* The recorded scaling signal (prometheusrule.yaml) and its expression, per pod of this release. */}}
{{- define "specdec.scalingSignal" -}}specdec:scaling_signal{{- end -}}
{{- define "specdec.scalingSignalExpr" -}}
{{- $sel := printf "namespace=\"%s\",pod=~\"%s-.*\"" .Release.Namespace (include "specdec.fullname" .) -}}
max by (namespace, pod) (label_replace(sum by (namespace, pod) (rate(nv_inference_queue_duration_us{model="target_model",{{ $sel }}}[1m])) / clamp_min(sum by (namespace, pod) (rate(nv_inference_compute_infer_duration_us{model="target_model",{{ $sel }}}[1m])), 1), "signal", "queue", "", "") or label_replace(sum by (namespace, pod) (specdec_queued_requests{ {{- $sel -}} }) / clamp_min(sum by (namespace, pod) (specdec_max_live_sequences{ {{- $sel -}} }), 1), "signal", "backlog", "", ""))
{{- end -}}

{{/* What KEDA compares with its threshold: the signal averaged over the release's pods. */}}
{{- define "specdec.kedaQuery" -}}
avg({{ include "specdec.scalingSignal" . }}{namespace="{{ .Release.Namespace }}",pod=~"{{ include "specdec.fullname" . }}-.*"})
{{- end -}}

{{/* Cross-field checks JSON Schema cannot express; rendered (as nothing) by the Deployment. */}}
{{- define "specdec.validate" -}}
{{- $s := .Values.speculation -}}
{{- if gt (int $s.defaultNumDraftTokens) (int $s.maxNumDraftTokens) -}}
{{- fail (printf "speculation.defaultNumDraftTokens (%v) exceeds speculation.maxNumDraftTokens (%v)" $s.defaultNumDraftTokens $s.maxNumDraftTokens) -}}
{{- end -}}
{{- if gt (int $s.defaultMaxTokens) (int $s.maxMaxTokens) -}}
{{- fail (printf "speculation.defaultMaxTokens (%v) exceeds speculation.maxMaxTokens (%v)" $s.defaultMaxTokens $s.maxMaxTokens) -}}
{{- end -}}
{{- $f := .Values.models.fetch -}}
{{- if and (ne .Values.models.source "existingClaim") (not $f.targetRepo) (not (and (eq .Values.models.draft.method "head") $f.draftRepo)) -}}
{{- fail "models.fetch.targetRepo is empty: only a draft head in the speculators library's layout (models.draft.method head, models.fetch.draftRepo) names the model it drafts for" -}}
{{- end -}}
{{- $gpus := int .Values.gpu.count -}}
{{- if and (gt $gpus 0) (or (ge (int .Values.gpu.targetGpu) $gpus) (ge (int .Values.gpu.draftGpu) $gpus)) -}}
{{- fail (printf "gpu.targetGpu and gpu.draftGpu must be below gpu.count (%d)" $gpus) -}}
{{- end -}}
{{- if and .Values.gpu.spreadTarget (lt $gpus 2) -}}
{{- fail "gpu.spreadTarget needs gpu.count of 2 or more" -}}
{{- end -}}
{{- if and .Values.gpu.mps (eq $gpus 0) -}}
{{- fail "gpu.mps needs a GPU (gpu.count 1 or more)" -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail "autoscaling.minReplicas exceeds autoscaling.maxReplicas" -}}
{{- end -}}
{{- if and .Values.models.fetch.loraRepos (eq .Values.models.source "existingClaim") -}}
{{- fail "models.fetch.loraRepos are fetched by the init container, which models.source existingClaim does not run: put the adapters on the claim and list them in models.loraAdapters" -}}
{{- end -}}
{{- $named := list -}}
{{- range .Values.models.loraAdapters -}}{{- $named = append $named .name -}}{{- end -}}
{{- range .Values.models.fetch.loraRepos -}}
{{- if has .name $named -}}
{{- fail (printf "LoRA adapter %q is named twice (models.loraAdapters, models.fetch.loraRepos)" .name) -}}
{{- end -}}
{{- $named = append $named .name -}}
{{- end -}}
{{- if and .Values.openai.allowRuntimeLoraUpdating (not .Values.models.loraClaim) -}}
{{- fail "openai.allowRuntimeLoraUpdating needs models.loraClaim: the adapters it loads are links in a writable directory (the weights' volume is mounted read-only)" -}}
{{- end -}}
{{- if and (include "specdec.singleNodeClaim" .) (or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled .Values.keda.enabled) -}}
{{- fail "models.newClaim.accessModes is ReadWriteOnce only: pods on other nodes cannot mount it; use ReadOnlyMany or ReadWriteMany for more than one replica" -}}
{{- end -}}
{{- end -}}

{{/* "true" when the weights live on a new claim that only one node can mount (ReadWriteOnce only). */}}
{{- define "specdec.singleNodeClaim" -}}
{{- $modes := .Values.models.newClaim.accessModes -}}
{{- if and (eq .Values.models.source "newClaim") (not (has "ReadOnlyMany" $modes)) (not (has "ReadWriteMany" $modes)) -}}
true
{{- end -}}
{{- end -}}

{{/* The Deployment's strategy: updateStrategy when set; Recreate for a single-node claim (a surge pod
     scheduled on another node could never mount it, and the rollout would hang); else a surge of one
     with none unavailable (a new pod loads the models before an old one goes). */}}
{{- define "specdec.strategy" -}}
{{- if .Values.updateStrategy -}}
{{ toYaml .Values.updateStrategy }}
{{- else if include "specdec.singleNodeClaim" . -}}
type: Recreate
{{- else -}}
type: RollingUpdate
rollingUpdate:
  maxSurge: 1
  maxUnavailable: 0
{{- end -}}
{{- end -}}
