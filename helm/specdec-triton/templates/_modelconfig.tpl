{{/*
Triton model configurations for the pair in .Values: the committed config.pbtxt files in model_repository/
with the chart's settings. tests/deploy checks that each one equals what `specdec.serving.repository.render`
(the local launcher) writes for the same settings, so the two cannot drift apart.
*/}}

{{- define "specdec.param" -}}
parameters { key: {{ index . 0 | quote }}, value: { string_value: {{ index . 1 | toString | quote }} } }
{{- end -}}

{{- define "specdec.tokenizerPath" -}}
{{- default .Values.models.target.path .Values.models.target.tokenizerPath -}}
{{- end -}}

{{- define "specdec.instanceGroup" -}}
{{- $root := index . 0 -}}{{- $role := index . 1 -}}
{{- if eq (int $root.Values.gpu.count) 0 -}}
instance_group [ { count: 1, kind: KIND_CPU } ]
{{- else if and (eq $role "target") $root.Values.gpu.spreadTarget -}}
instance_group [ { count: 1, kind: KIND_MODEL } ]
{{- else -}}
instance_group [ { count: 1, kind: KIND_GPU, gpus: [ {{ ternary $root.Values.gpu.targetGpu $root.Values.gpu.draftGpu (eq $role "target") }} ] } ]
{{- end -}}
{{- end -}}

{{- define "specdec.loraAdapters" -}}
{{- $pairs := list -}}
{{- range .Values.models.loraAdapters -}}{{- $pairs = append $pairs (printf "%s=%s" .name .path) -}}{{- end -}}
{{- if ne .Values.models.source "existingClaim" -}}
{{- range .Values.models.fetch.loraRepos -}}{{- $pairs = append $pairs (printf "%s=%s/lora/%s" .name $.Values.models.mountPath .name) -}}{{- end -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{- define "specdec.headPaths" -}}
{{- if eq .Values.models.draft.method "head" -}}{{ .Values.models.draft.path }}{{- end -}}
{{- end -}}

{{- /* A draft model made of the target's layers runs the target's LoRA adapters on them (draft_model's
lora_layers; a layer-skip self-draft's are the target's: first) */ -}}
{{- define "specdec.draftLoraLayers" -}}
{{- if has .Values.models.draft.method (list "model" "skip") -}}{{ .Values.models.draft.loraLayers }}{{- end -}}
{{- end -}}

{{- define "specdec.lmParams" -}}
{{- $root := index . 0 -}}{{- $role := index . 1 -}}{{- $path := index . 2 -}}
{{- $onGpu := gt (int $root.Values.gpu.count) 0 -}}
{{- $head := eq $root.Values.models.draft.method "head" -}}
{{ include "specdec.param" (list "model_path" $path) }}
{{- if eq $role "target" }}
{{ include "specdec.param" (list "draft_heads" (include "specdec.headPaths" $root)) }}
{{ include "specdec.param" (list "hosted_heads" (ternary (printf "draft_model=%s" $root.Values.models.draft.path) "" (and $head $root.Values.models.draft.inTarget))) }}
{{ include "specdec.param" (list "hosted_head_weights_dtype" $root.Values.models.weightsDtype) }}
{{ include "specdec.param" (list "hosted_stop_below" $root.Values.speculation.draftStopBelow) }}
{{ include "specdec.param" (list "lora_adapters" (include "specdec.loraAdapters" $root)) }}
{{ include "specdec.param" (list "lora_directory" (include "specdec.loraDirectory" $root)) }}
{{ include "specdec.param" (list "max_loras" $root.Values.models.maxLoras) }}
{{ include "specdec.param" (list "max_lora_rank" $root.Values.models.maxLoraRank) }}
{{ include "specdec.param" (list "run_ahead" $root.Values.executor.runAhead) }}
{{- else }}
{{- $kind := $root.Values.models.draft.method }}
{{ include "specdec.param" (list "draft_kind" (ternary $kind "model" (has $kind (list "head" "skip")))) }}
{{ include "specdec.param" (list "skip_layers" (ternary $root.Values.models.draft.skipLayers "auto" (eq $kind "skip"))) }}
{{ include "specdec.param" (list "skip_search_seed" "0") }}
{{ include "specdec.param" (list "skip_search_interval_s" "10") }}
{{ include "specdec.param" (list "draft_stop_below" $root.Values.speculation.draftStopBelow) }}
{{ include "specdec.param" (list "target_path" (ternary $root.Values.models.target.path "" $head)) }}
{{ include "specdec.param" (list "target_draft_heads" (include "specdec.headPaths" $root)) }}
{{ include "specdec.param" (list "lora_layers" (include "specdec.draftLoraLayers" $root)) }}
{{- end }}
{{ include "specdec.param" (list "dtype" $root.Values.models.dtype) }}
{{ include "specdec.param" (list "weights_dtype" $root.Values.models.weightsDtype) }}
{{ include "specdec.param" (list "device" (ternary "cuda" "cpu" $onGpu)) }}
{{ include "specdec.param" (list "device_map" (ternary "auto" "" (and $onGpu (eq $role "target") $root.Values.gpu.spreadTarget))) }}
{{ include "specdec.param" (list "max_sequences" $root.Values.speculation.maxSequences) }}
{{ include "specdec.param" (list "sequence_idle_timeout_s" $root.Values.speculation.sequenceIdleTimeoutSeconds) }}
{{ include "specdec.param" (list "heap_trim_interval_s" $root.Values.speculation.heapTrimIntervalSeconds) }}
{{ include "specdec.param" (list "executor" $root.Values.executor.kind) }}
{{ include "specdec.param" (list "max_num_draft_tokens" $root.Values.speculation.maxNumDraftTokens) }}
{{ include "specdec.param" (list "max_context_tokens" $root.Values.speculation.maxContextTokens) }}
{{ include "specdec.param" (list "compile" $root.Values.executor.compile) }}
{{ include "specdec.param" (list "fuse_kernels" $root.Values.executor.fuseKernels) }}
{{ include "specdec.param" (list "fuse_mlp" $root.Values.executor.fuseMlp) }}
{{ include "specdec.param" (list "attention" $root.Values.executor.attention) }}
{{ include "specdec.param" (list "prefill_graph_rows" $root.Values.executor.prefillGraphRows) }}
{{ include "specdec.param" (list "kv_memory_fraction" (index $root.Values.executor.kvMemoryFraction $role)) }}
{{ include "specdec.param" (list "torch_threads" $root.Values.executor.torchThreads) }}
{{ include "specdec.param" (list "prefix_caching" $root.Values.executor.prefixCaching.enabled) }}
{{ include "specdec.param" (list "prefix_cache_tokens" $root.Values.executor.prefixCaching.tokens) }}
{{ include "specdec.param" (list "batched_forward" "true") }}
{{ include "specdec.param" (list "pipelined_execute" $root.Values.executor.pipelinedExecute) }}
{{ include "specdec.instanceGroup" (list $root $role) }}
{{- end -}}

{{- define "specdec.triton.config.preprocessing" -}}
name: "preprocessing"
backend: "python"
max_batch_size: 64
input [
  { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "messages", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "tools", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "chat_template_kwargs", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "chat_template", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "continue_final_message", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "prompt_token_ids", data_type: TYPE_INT32, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_draft_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "adaptive_draft", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "num_draft_branches", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "min_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "seed", data_type: TYPE_UINT64, dims: [ 1 ], optional: true },
  { name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "end_id", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "min_length", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "min_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "ignore_eos", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "stop_words", data_type: TYPE_STRING, dims: [ -1 ], optional: true },
  { name: "bad_words", data_type: TYPE_STRING, dims: [ -1 ], optional: true },
  { name: "embedding_bias_words", data_type: TYPE_STRING, dims: [ -1 ], optional: true },
  { name: "embedding_bias_weights", data_type: TYPE_FP32, dims: [ -1 ], optional: true },
  { name: "repetition_penalty", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "presence_penalty", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "frequency_penalty", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "beam_width", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_return_sequences", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "pad_id", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "exclude_input_in_output", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "draft_model", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "apply_chat_template", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_log_probs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_prompt_log_probs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "num_top_log_probs", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "return_finish_reason", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_cumulative_logprob", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_perf_metrics", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "priority", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "return_logprobs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_input_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_output_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "guided_decoding_guide_type", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "guided_decoding_guide", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "reasoning_parser", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "thinking_token_budget", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "lora_name", data_type: TYPE_STRING, dims: [ 1 ], optional: true }
]
output [
  { name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "input_length", data_type: TYPE_INT32, dims: [ 1 ] }
]
{{ include "specdec.param" (list "tokenizer_path" (include "specdec.tokenizerPath" .)) }}
{{ include "specdec.param" (list "apply_chat_template" (ternary "true" "false" .Values.models.applyChatTemplate)) }}
{{ include "specdec.param" (list "chat_template" (ternary "chat_template.jinja" "" (ne .Values.models.chatTemplate ""))) }}
{{ include "specdec.param" (list "trust_request_chat_template" (ternary "true" "false" .Values.models.trustRequestChatTemplate)) }}
{{ include "specdec.param" (list "chat_template_content_format" .Values.models.chatTemplateContentFormat) }}
instance_group [ { count: 1, kind: KIND_CPU } ]
{{- end -}}

{{- define "specdec.triton.config.postprocessing" -}}
name: "postprocessing"
backend: "python"
max_batch_size: 64
input [
  { name: "output_ids", data_type: TYPE_INT32, dims: [ -1 ], allow_ragged_batch: true },
  { name: "prefix_ids", data_type: TYPE_INT32, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "text_length", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "skip_special_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "sequence_id", data_type: TYPE_UINT64, dims: [ 1 ], optional: true }
]
output [
  { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] }
]
{{ include "specdec.param" (list "tokenizer_path" (include "specdec.tokenizerPath" .)) }}
instance_group [ { count: 1, kind: KIND_CPU } ]
{{- end -}}

{{- define "specdec.sequenceBatching" -}}
sequence_batching {
  max_sequence_idle_microseconds: 600000000
  oldest { max_candidate_sequences: 256, max_queue_delay_microseconds: 0 }
}
{{- end -}}

{{- define "specdec.triton.config.draft_model" -}}
name: "draft_model"
backend: "python"
max_batch_size: 64
{{ include "specdec.sequenceBatching" . }}
input [
  { name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ], allow_ragged_batch: true },
  { name: "cache_length", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "reserve_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_draft_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_draft_branches", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "min_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "seed", data_type: TYPE_UINT64, dims: [ 1 ], optional: true },
  { name: "lora_name", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "cache_salt", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "release", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "features", data_type: TYPE_FP32, dims: [ -1, -1 ], optional: true, allow_ragged_batch: true }
]
output [
  { name: "draft_tokens", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "draft_probs", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "cached_length", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "draft_parents", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "forward_stats", data_type: TYPE_FP32, dims: [ 3 ] }
]
{{ include "specdec.lmParams" (list . "draft" (ternary .Values.models.target.path .Values.models.draft.path (eq .Values.models.draft.method "skip"))) }}
{{ include "specdec.param" (list "target_tokenizer_path" (include "specdec.tokenizerPath" .)) }}
{{- if has .Values.models.draft.method (list "model" "skip") }}
{{ include "specdec.param" (list "lora_adapters" (include "specdec.loraAdapters" .)) }}
{{ include "specdec.param" (list "lora_directory" (include "specdec.loraDirectory" .)) }}
{{ include "specdec.param" (list "max_loras" .Values.models.maxLoras) }}
{{ include "specdec.param" (list "max_lora_rank" .Values.models.maxLoraRank) }}
{{- end }}
{{- end -}}

{{- define "specdec.triton.config.target_model" -}}
name: "target_model"
backend: "python"
max_batch_size: 64
{{ include "specdec.sequenceBatching" . }}
input [
  { name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ], allow_ragged_batch: true },
  { name: "cache_length", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "reserve_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_logits", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "allowed_tokens", data_type: TYPE_INT32, dims: [ -1, -1 ], optional: true, allow_ragged_batch: true },
  { name: "tree_parents", data_type: TYPE_INT32, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "accepted_path", data_type: TYPE_INT32, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "score_rows", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "score_next", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "lora_name", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "cache_salt", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "draft_head", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "draft_ask", data_type: TYPE_FP64, dims: [ 7 ], optional: true },
  { name: "release", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }
]
output [
  { name: "greedy_tokens", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "greedy_log_probs", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "greedy_top_ids", data_type: TYPE_INT32, dims: [ -1, -1 ] },
  { name: "greedy_top_log_probs", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "scored_log_probs", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "scored_ranks", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "scored_logits", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "scored_top_ids", data_type: TYPE_INT32, dims: [ -1, -1 ] },
  { name: "scored_top_log_probs", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "logits", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "features", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "forward_stats", data_type: TYPE_FP32, dims: [ 3 ] },
  { name: "cached_tokens", data_type: TYPE_INT32, dims: [ 2 ] },
  { name: "draft_tokens", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "draft_parents", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "draft_probs", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "draft_stats", data_type: TYPE_FP32, dims: [ 3 ] }
]
{{ include "specdec.lmParams" (list . "target" .Values.models.target.path) }}
{{- end -}}

{{- define "specdec.triton.config.speculative_decoding" -}}
{{- $s := .Values.speculation -}}
name: "speculative_decoding"
backend: "python"
max_batch_size: 64
model_transaction_policy { decoupled: true }
input [
  { name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ], allow_ragged_batch: true },
  { name: "max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_draft_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "adaptive_draft", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "num_draft_branches", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "min_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "seed", data_type: TYPE_UINT64, dims: [ 1 ], optional: true },
  { name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "end_id", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "min_length", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "min_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "ignore_eos", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "stop_words", data_type: TYPE_STRING, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "bad_words", data_type: TYPE_STRING, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "embedding_bias_words", data_type: TYPE_STRING, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "embedding_bias_weights", data_type: TYPE_FP32, dims: [ -1 ], optional: true, allow_ragged_batch: true },
  { name: "repetition_penalty", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "presence_penalty", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "frequency_penalty", data_type: TYPE_FP32, dims: [ 1 ], optional: true },
  { name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "exclude_input_in_output", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "draft_model", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "return_log_probs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_prompt_log_probs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_prompt_ids", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_generation_logits", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_context_logits", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "num_top_log_probs", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "return_finish_reason", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_cumulative_logprob", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_perf_metrics", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "priority", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "return_logprobs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_input_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_output_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "guided_decoding_guide_type", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "guided_decoding_guide", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "reasoning_parser", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "thinking_token_budget", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "lora_name", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "cache_salt", data_type: TYPE_STRING, dims: [ 1 ], optional: true }
]
output [
  { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "output_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "prefix_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "text_length", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "skip_special_tokens", data_type: TYPE_BOOL, dims: [ 1 ] },
  { name: "sequence_id", data_type: TYPE_UINT64, dims: [ 1 ] },
  { name: "finish_reason", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "num_input_tokens", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "num_output_tokens", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "total_draft_tokens", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "total_accepted_draft_tokens", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "acceptance_rate", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "num_rounds", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "mean_accepted_length", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "num_cached_tokens", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "output_log_probs", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "cum_log_probs", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "cumulative_logprob", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "arrival_time_ns", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "first_scheduled_time_ns", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "first_token_time_ns", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "last_token_time_ns", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "kv_cache_reused_blocks", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "kv_cache_alloc_new_blocks", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "kv_cache_alloc_total_blocks", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "logprobs", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "output_top_ids", data_type: TYPE_INT32, dims: [ -1, -1 ] },
  { name: "output_top_log_probs", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "output_prompt_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "output_prompt_log_probs", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "output_prompt_ranks", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "generation_logits", data_type: TYPE_FP32, dims: [ -1, -1, -1 ] },
  { name: "context_logits", data_type: TYPE_FP32, dims: [ -1, -1 ] },
  { name: "output_prompt_top_ids", data_type: TYPE_INT32, dims: [ -1, -1 ] },
  { name: "output_prompt_top_log_probs", data_type: TYPE_FP32, dims: [ -1, -1 ] }
]
{{ include "specdec.param" (list "tokenizer_path" (include "specdec.tokenizerPath" .)) }}
{{ include "specdec.param" (list "generation_config" (ternary .Values.models.target.path .Values.models.generationConfig (has .Values.models.generationConfig (list "auto" "vllm")))) }}
{{ include "specdec.param" (list "target_model" "target_model") }}
{{ include "specdec.param" (list "draft_models" (get (dict "model" "draft_model,ngram,suffix,ngram+draft_model" "head" "draft_model,ngram,suffix,ngram+draft_model" "skip" "draft_model,ngram,suffix,ngram+draft_model" "ngram" "ngram,suffix" "suffix" "suffix,ngram") .Values.models.draft.method)) }}
{{ include "specdec.param" (list "lora_adapters" (include "specdec.loraAdapters" .)) }}
{{ include "specdec.param" (list "lora_directory" (include "specdec.loraDirectory" .)) }}
{{ include "specdec.param" (list "head_drafts" (ternary "draft_model" "" (and (eq .Values.models.draft.method "head") (not .Values.models.draft.inTarget)))) }}
{{ include "specdec.param" (list "hosted_drafts" (ternary "draft_model" "" (and (eq .Values.models.draft.method "head") .Values.models.draft.inTarget))) }}
{{ include "specdec.param" (list "suffix_cache_tokens" $s.suffixCacheTokens) }}
{{ include "specdec.param" (list "heap_trim_interval_s" $s.heapTrimIntervalSeconds) }}
{{ include "specdec.param" (list "lookup_branches" $s.lookupBranches) }}
{{ include "specdec.param" (list "lookup_min_ngram" $s.lookupMinNgram) }}
{{ include "specdec.param" (list "lookup_max_ngram" $s.lookupMaxNgram) }}
{{ include "specdec.param" (list "lookup_first_min_ngram" $s.lookupFirstMinNgram) }}
{{ include "specdec.param" (list "draft_branches" $s.draftBranches) }}
{{ include "specdec.param" (list "adaptive_draft" (ternary "true" "false" $s.adaptiveDraft)) }}
{{ include "specdec.param" (list "default_num_draft_tokens" $s.defaultNumDraftTokens) }}
{{ include "specdec.param" (list "max_num_draft_tokens" $s.maxNumDraftTokens) }}
{{ include "specdec.param" (list "default_max_tokens" $s.defaultMaxTokens) }}
{{ include "specdec.param" (list "max_max_tokens" $s.maxMaxTokens) }}
{{ include "specdec.param" (list "max_context_tokens" $s.maxContextTokens) }}
{{ include "specdec.param" (list "max_stop_words" 16) }}
{{ include "specdec.param" (list "max_bad_words" 16) }}
{{ include "specdec.param" (list "max_guide_chars" 65536) }}
{{ include "specdec.param" (list "max_logits_tokens" $s.maxLogitsTokens) }}
{{ include "specdec.param" (list "max_live_sequences" $s.maxLiveSequences) }}
{{ include "specdec.param" (list "when_full" $s.whenFull) }}
{{ include "specdec.param" (list "verify_gather_ms" $s.verifyGatherMs) }}
{{ include "specdec.param" (list "max_drafting_sequences" $s.maxDraftingSequences) }}
{{ include "specdec.param" (list "prefill_chunk_tokens" $s.prefillChunkTokens) }}
{{ include "specdec.param" (list "model_call_timeout_s" .Values.server.modelCallTimeoutSeconds) }}
instance_group [ { count: {{ int ($s.orchestratorInstances | default (ternary 1 2 (gt (int .Values.gpu.count) 0))) }}, kind: KIND_CPU } ]
{{- end -}}

{{- define "specdec.triton.config.vllm_compatible" -}}
name: "vllm_compatible"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "exclude_input_in_output", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "draft_model", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "num_draft_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "num_draft_branches", data_type: TYPE_INT32, dims: [ 1 ], optional: true },
  { name: "adaptive_draft", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_finish_reason", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_cumulative_logprob", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_logprobs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_input_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_output_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }
]
output [
  { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "finish_reason", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "cumulative_logprob", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "logprobs", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "num_input_tokens", data_type: TYPE_UINT32, dims: [ 1 ] },
  { name: "num_output_tokens", data_type: TYPE_UINT32, dims: [ -1 ] }
]
# what it calls: direct = preprocessing, then speculative_decoding (no postprocessing step per response);
# ensemble = the model `ensemble` names
parameters { key: "upstream", value: { string_value: "direct" } }
parameters { key: "ensemble", value: { string_value: "ensemble" } }
# the server's own gRPC endpoint, host:port, through which it calls them ("": the launcher's, else
# 127.0.0.1:8001)
parameters { key: "server_grpc_url", value: { string_value: "" } }
instance_group [ { count: 1, kind: KIND_CPU } ]
{{- end -}}
