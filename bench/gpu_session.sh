#!/usr/bin/env bash
# Everything a lent GPU machine should measure, in parts that each fit one 10-minute device command.
# Build the kit once here (`make gpukit`), carry `.gpukit`, and start each device command with
# `source .gpukit/activate.sh`; GPU_SESSION_SECONDS=N keeps the whole run within N seconds:
#
#   source .gpukit/activate.sh && bash bench/gpu_session.sh tests bench          # ~8 min
#   source .gpukit/activate.sh && bash bench/gpu_session.sh orchestrators executor
#
# Parts:
#   tests          tests/gpu (greedy equality in float32/float64, seeded sampling, CUDA graphs vs eager)
#   heads          a trained head's draft step (EAGLE-1, EAGLE-3, Medusa, an MLP speculator) against the 8B-shaped
#                  target's step and its 4-layer layer-skip draft's, in process (bench/head_bench.py; ~3 min with the pair's build)
#   bench          `make bench-gpu`'s table: the 8B-shaped pair against the bound, compiled PyTorch and
#                  transformers, served at 1 and 8 streams (the GPU table of docs/results/)
#   orchestrators  the served rows with one orchestrator instance and with two: the A/B behind the GPU
#                  default of speculation.orchestratorInstances (one)
#   executor       in-process steps of the static executor, with and without the fused SiLU MLP (fuse_mlp),
#                  against the compiled static-cache reference
#   streams        the 8-stream rows with draft_model's sequence batcher waiting 300 and 1000 us to fill its
#                  executions, and 1000 us with target_model's waiting 300 us: whether the draft's batching is
#                  what 8 speculative streams lack (~7 min; `bash bench/gpu_session.sh streams`). Measured on
#                  host D and left: four orchestrator instances, verify_gather_ms
#   prefix         prefix caching on the 8B-shaped pair: a shared 1500-word system prompt against unshared
#                  ones (TTFT), and chunked prefill: plain streams' gaps beside long prompts, whole and in
#                  chunks of 512 (~9 min; `bash bench/gpu_session.sh prefix`)
#   pipeline       the served rows with the models' execute pipelined (pipelined_execute=true: host work
#                  overlapping the forwards) and without, one server after the other (~2 min on an H200;
#                  named twice, the second pair runs in the other order; measured there: no gain)
#   load           speculation under load: 8, 16 and 32 streams, K=0 against fixed K=4 and adaptive, with no
#                  limit and with max_drafting_sequences=8 (one server each, ~9 min): does speculation stop
#                  paying at some count (fixed K: apart from the policy's choice), and does the limit give
#                  K=0's throughput back there
#   overhead       where a served round goes on the GPU (tiny pair): greedy, sampled, and guided by a regex
#                  (target_model picking with the grammar's bitmask) (~3 min)
#   overhead8b     where a served round goes with the 8B-shaped pair (greedy, K=0 and K=4, verify buckets as
#                  the bench sets them) (~3 min): its K=4 round spent ~5.3 ms outside the in-process forwards on
#                  an H200 (15.5 ms per round at 210 tokens/s against 10.2 ms of forwards), its K=0 round ~2.4
#                  ms, against 3.0 and 1.8 ms for the tiny pair's machinery on host D: which part grows.
#                  Host E (H100): 3.7 ms of machinery per K=4 round, 2.0 ms per K=0 round
#   ksweep         batch-1 draft lengths past 4: two servers, K=5 and 6 (verify buckets up to 7 rows) and K=7 and
#                  8 (up to 9), each beside its own K=0, with adaptive up to 6 and 8 (~2 min): which K pays best
#                  on this GPU, against K=4's 1.76-1.79x on an H200
#   mps            the served rows with the launcher's --mps (a CUDA MPS daemon of the server's own) and
#                  without (~2 min; named twice, off on on off): on an H200, 8 speculative streams kept each
#                  model in forwards 1.8-2.0x as long as its work alone, as two time-sliced CUDA contexts
#                  would; under MPS the draft's and the target's kernels run side by side;
#                  with K=5's batch-1 row beside K=4's (the verify buckets then 1, 2, 4, 6 rows)
#   prompts        the served rows with prompts in captured buckets of their own (prefill_graph_rows=512, the
#                  default) and with eager prompts (0), K=5 beside K=4 (~2 min; named twice: on off off on).
#                  Measured on H100 host E (two passes on, off): buckets ahead in every row, TTFT 42-52 -> 16 ms
#   maxk           the served rows with the deployment's default max_num_draft_tokens=16 (verify buckets up to 17
#                  rows: prompts of up to 17 tokens replay graphs, K=4's verify pads to 8 rows) against the bench's
#                  max K of 5 (buckets up to 6 rows: these prompts run eagerly), K=5 beside K=4 (~2 min; named
#                  twice: off on on off): what a deployment with the chart's defaults gets (one pass on host E)
#   kernels        the 8B-shaped target's captured step kernel by kernel (torch.profiler), each weight kind's
#                  product alone (cuBLAS and cuBLASLt, 1/5/16 rows) and the decode attention's SDPA backends
#                  (bench/kernel_profile.py, ~3 min): what keeps the step from the bound (issue 47)
#   attention      the paged attention kernel (engine/paged_attention.py, the CUDA default) against the gathered
#                  window and SDPA: in-process steps (executor_bench, graphs-mlp against graphs-mlp-sdpa), the tests
#                  that run the kernel (tests/gpu -k paged), the served rows (one server each, paged first), and
#                  the kernel-by-kernel profile of the step with it (~7 min)
#   ahead          target_model's greedy one-token steps run ahead of their requests (run_ahead, the CUDA default)
#                  against not: the served rows, one server each, run ahead first, then the in-process step
#                  (executor_bench graphs-mlp) they compare with (~6 min): what the round's host work costs
#                  once the device goes on with the next step (issue 47, item 2)
#   drafttrees     the draft model's token trees (draft_branches=2: its chain and its second choice beside each
#                  token, K nodes) against its chains, served rows at K=4 and K=8, one server each (~5 min)
#   drafts         every draft beside one K=0 on ONE server (each request names its draft_model and branches:
#                  gpu_bench --drafts): the 4-layer draft model's chains and trees, the skip set the search found
#                  on an H200 given as a list (captured), and two heads built for the pair in seconds
#                  (gpu_bench.synthetic_heads): EAGLE-1 as the pair's embedding exit (agreeing as a 0-layer exit
#                  does: served beside the draft model at a like α), its trees, and a random EAGLE-3 (costs only)
#                  (~3 min; H200 runs in docs/results/2026-12-04-gpu-h200-drafts.md and -heads.md).
#                  GPU_SESSION_SMALL=1 runs it with the tiny shapes on CPU (PYTHON=.venv/bin/python), to check it
#                  before a GPU is lent
#   headround      where a head's served round goes when its request drafts nothing (round_overhead
#                  --paused-draft: the K=0 rows name the random EAGLE-3 head) and at K=4, the target's features
#                  handed over on the device and through the host (target_model.device_outputs), one server each
#                  (~4 min)
#   hostedround    a head hosted in target_model (--heads-in-target: one call a round, the head drafting in the
#                  verify call) against the same head as a draft model of its own: the EAGLE-1 embedding exit's
#                  K=4 chains, their rounds split (round_overhead), one server each, the hosted head with its
#                  rounds run ahead (run_ahead, CUDA's default) and without (~4.5 min)
#   fp8            FP8 weights (weights_dtype fp8: the weight-only FP8 kernel, a scale per output channel)
#                  against bf16: the FP8 GPU test (left to `tests` when named before), the kernel's launches
#                  per weight kind against cuBLAS's bf16 (bench/fp8_kernel_bench.py, ~1.5 min; skipped where
#                  SPECDEC_FP8_KERNEL is set), then the served rows with the fastest launch, one server each
#                  (~6 min; named twice: on off off on): issue 47's served target-only <= 3.8 ms with FP8
#   swift          the layer-skip self-draft searched on the fly (--skip-draft swift=auto, served as the default
#                  draft) against the pair's fixed 4-layer early exit, one server each (~5 min; named twice: on
#                  off off on): issue 48's GPU comparison (the pair's costs are real, its acceptance synthetic)
#   lora           LoRA adapters in CUDA graphs (every adapter's product for every row): the 8B-shaped target's
#                  step and verify with none, base rows, one adapter and mixed rows, 2 then 8 adapters of rank
#                  16, then adapters read on demand: a read, a slot, steps over 2 and 6 slots (bench/lora_bench.py,
#                  ~4 min)
#   traces         a client's torch profile of the served pair (POST /start_profile, /stop_profile): one stream
#                  at K=0 and K=4; each model's CPU operators and kernels by device time after the table in
#                  traces.md (bench/gpu_bench.py --traces; the traces in traces/: Perfetto) (~3 min)
#   openai         the OpenAI API's cost on the 8B-shaped pair (bench/openai_gateway_bench.py --pair 8b): streamed
#                  completions through the launcher's API (calling preprocessing, then speculative_decoding) and
#                  through a second one calling the ensemble (its postprocessing step a streamed response), the
#                  gRPC stream to the ensemble and vllm_compatible beside them, at 1 and 4 streams, K=4 (~4 min):
#                  what the API adds to a GPU's round (issue 47, item 2). On two CPU cores, the default pair:
#                  the direct API 1.09-1.16x the ensemble's tokens/s (docs/results/2026-12-07-openai-direct.md)
#   profile        cProfile over draft_model's and target_model's execute (SPECDEC_PROFILE_DIR): 8 target-only
#                  streams, then 1 stream at K=0, 4 and adaptive; pstats' reports in profile-*.txt (~2 min):
#                  where the host time inside an execution goes (the adapter's share: "in execute" - "in
#                  forwards" in the many-stream rows)
#
# Results: with $OUT set (the folder the device tool brings back, at most 8 files), every part's table,
# log and server log go to /tmp/gpu-session, and on exit $OUT receives four files: tables.md (every table),
# summary.txt (each part's exit code and time), gpu.txt and session.tgz (all of it). Without $OUT they stay
# in .cache/gpu-session. So one command runs any parts, in the order named. A session lent 15 device-minutes
# (a start takes 1-2 of them) has room for one full command: name the parts most wanted first, and what no
# longer fits the budget is skipped, the rest coming back whole. The next one, in that order (~9 min): the GPU
# tests of what changed without a GPU on 2026-12-04 (a head's fills and tree levels captured, a searched skip
# draft's graphs following its set, a paused head's steps run ahead), every draft on one server (the head's
# trees with their levels captured; the searched skip draft captured beside the set it found before), then a
# head's rounds split (K=0 rounds run ahead: 2.2 ms a round slower than K=0 before); first the head hosted in
# target_model against the same head called (2026-12-05; on two CPU cores 15.8-16.0 ms a K=4 round against 18.8):
#
#   source .gpukit/activate.sh && GPU_TESTS_K="head or searched or ahead or hosted" GPU_SESSION_SECONDS=540 \
#     bash bench/gpu_session.sh tests hostedround drafts headround
#
# After it: fp8 (FP8 against bf16 side by side in one command), bench (the served rows at 1 and 8 streams) and
# openai (the OpenAI API calling speculative_decoding itself against through the ensemble, ~4 min).
set -uo pipefail
cd "$(dirname "$0")/.."
dest="${OUT:-}"
# GPU_SESSION_DIR: where the logs and tables go (the tests' own folder); else as above.
if [ -n "${GPU_SESSION_DIR:-}" ]; then out=$GPU_SESSION_DIR
elif [ -n "$dest" ]; then out=/tmp/gpu-session; rm -rf "$out"; else out=.cache/gpu-session; fi
mkdir -p "$out"
touch "$out/summary.txt"

pack() {
  [ -n "$dest" ] || return 0
  for table in "$out"/*.md; do
    [ -e "$table" ] && { echo "## $(basename "$table")"; cat "$table"; echo; }
  done > "$dest/tables.md"
  cp "$out/summary.txt" "$out/gpu.txt" "$dest/" 2>/dev/null
  tar czf "$dest/session.tgz" -C "$out" .
}
trap pack EXIT
python="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$python" -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$out/gpu.txt" 2>&1

# GPU_SESSION_SECONDS: the whole script's budget (a device command's limit less what follows it): each run's
# timeout is cut to what is left, and a run with under a minute left is skipped, so the results so far come
# back whole.
budget=${GPU_SESSION_SECONDS:-0}
cache="$("$python" -c 'from specdec.serving import pairs; print(pairs.cache_dir())' 2>/dev/null || echo .cache)"

# The kit must hold every package the server imports: without one, each server fails at load and every
# part reports nothing (a kit without llguidance cost a GPU session's first run).
if ! missing=$("$python" -c 'import llguidance, tritonclient.grpc, transformers, specdec.decoding.grammar' 2>&1); then
  echo "the GPU kit lacks a package the server needs (make gpukit builds it): ${missing##*$'\n'}" | tee -a "$out/summary.txt"
  exit 2
fi

run() {  # run NAME SECONDS COMMAND...: its output in $out/NAME.log, its exit code and time in summary.txt
  local name=$1 seconds=$2 started=$SECONDS
  shift 2
  if [ "$budget" -gt 0 ]; then
    local left=$((budget - SECONDS))
    if [ "$left" -lt 60 ]; then echo "$name: skipped, ${left} s left" | tee -a "$out/summary.txt"; return; fi
    [ "$seconds" -gt "$left" ] && seconds=$left
  fi
  local log
  rm -f "$cache/bench-gpu-server.log" "$cache/bench-overhead-server.log"  # an earlier server's: not this part's
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - started)) s" | tee -a "$out/summary.txt"
  # A served bench's server log (each bench starts its own server, which writes it anew).
  for log in "$cache/bench-gpu-server.log" "$cache/bench-overhead-server.log"; do
    [ -f "$log" ] && mv -f "$log" "$out/$name.server.log"
  done
  return 0
}

# synthetic_heads: gpu_bench's 8B-shaped pair and two heads built for it in seconds ($eagle1:
# its embedding exit as an EAGLE-1 head, agreeing as the pair's 0-layer exit does; $eagle3: random, its costs
# only; gpu_bench.synthetic_heads), each built once; GPU_SESSION_SMALL=1: the tiny shapes on CPU ($small:
# gpu_bench's arguments for them), to check a part before a GPU is lent (PYTHON=.venv/bin/python). A head
# trained on this pair learns nothing that serves (2026-12-04: 151 s of training on an H200, served α 0.00).
synthetic_heads() {
  shape="False, 'bfloat16', 'cuda'" small=()
  [ -n "${GPU_SESSION_SMALL:-}" ] && shape="True, 'float32', 'cpu'" small=(--small --prompts 2 --max-tokens 16)
  run pair-build 240 "$python" -c \
    "from bench.gpu_bench import synthetic_pair, synthetic_heads as h; h(synthetic_pair($shape)[0])"
  read -r eagle1 eagle3 < <("$python" -c "from bench.gpu_bench import synthetic_pair, synthetic_heads as h
heads = h(synthetic_pair($shape)[0]); print(heads['eagle1'], heads['eagle3'])" 2>/dev/null)
}

# ab NAME FIRST SECONDS BENCH_ARGS -- ON_ARGS... [--off OFF_ARGS...]: gpu_bench's served rows with ON_ARGS
# ("on") and with OFF_ARGS, by default none ("off"), FIRST of the two first; the part's second call runs them
# in the other order (named twice: ABBA). BENCH_ARGS (one word list) apply to both.
declare -A rounds
ab() {
  local name=$1 first=$2 seconds=$3 bench=$4 mode
  shift 5
  local on_args=() off_args=() side=on arg
  for arg in "$@"; do
    if [ "$arg" = --off ]; then side=off
    elif [ "$side" = on ]; then on_args+=("$arg")
    else off_args+=("$arg"); fi
  done
  rounds[$name]=$((${rounds[$name]:-0} + 1))
  local order=(on off)
  [ "$first" = off ] && order=(off on)
  [ $((rounds[$name] % 2)) = 0 ] && order=("${order[1]}" "${order[0]}")
  for mode in "${order[@]}"; do
    if [ "$mode" = on ]; then extra=("${on_args[@]}"); else extra=("${off_args[@]}"); fi
    # shellcheck disable=SC2086  # BENCH_ARGS split into words
    run "$name-$mode-${rounds[$name]}" "$seconds" "$python" -m bench.gpu_bench --served-only --prompts 4 $bench \
      "${extra[@]}" --out "$out/$name-$mode-${rounds[$name]}.md"
  done
}

for part in "$@"; do
  case "$part" in
    tests)  # -v: a line a test, so a run cut off by its budget still says which passed; GPU_TESTS_K: pytest's -k
      only=(); [ -n "${GPU_TESTS_K:-}" ] && only=(-k "$GPU_TESTS_K")
      run tests-gpu 240 "$python" -m pytest -v -m gpu tests/gpu -p no:cacheprovider "${only[@]}"; tests_ran=1 ;;
    bench) run bench-gpu 420 "$python" -m bench.gpu_bench --out "$out/bench-gpu.md" ;;
    heads) run head-bench 300 "$python" -m bench.head_bench --out "$out/head-bench.md" ;;
    lora)
      run lora-2 150 "$python" -m bench.lora_bench --pair 8b --adapters 2 --out "$out/lora-2.md"
      run lora-8 150 "$python" -m bench.lora_bench --pair 8b --adapters 8 --out "$out/lora-8.md"
      run lora-on-demand 120 "$python" -m bench.lora_bench --pair 8b --on-demand --out "$out/lora-on-demand.md" ;;
    orchestrators)
      run bench-gpu-1-orchestrator 300 "$python" -m bench.gpu_bench --served-only --prompts 4 \
        --launcher-arg=--orchestrator-instances=1 --out "$out/bench-gpu-1-orchestrator.md"
      run bench-gpu-2-orchestrators 300 "$python" -m bench.gpu_bench --served-only --prompts 4 \
        --launcher-arg=--orchestrator-instances=2 --out "$out/bench-gpu-2-orchestrators.md" ;;
    streams)
      for delay in 300 1000; do
        run "streams-draft-delay-$delay" 190 "$python" -m bench.gpu_bench --served-only --prompts 2 \
          "--launcher-arg=--set=draft_model.max_queue_delay_microseconds=$delay" --out "$out/streams-draft-delay-$delay.md"
      done
      run streams-both-delays 190 "$python" -m bench.gpu_bench --served-only --prompts 2 \
        --launcher-arg=--set=draft_model.max_queue_delay_microseconds=1000 \
        --launcher-arg=--set=target_model.max_queue_delay_microseconds=300 --out "$out/streams-both-delays.md" ;;
    prefix)
      run prefix-cache 200 "$python" -m bench.prefix_bench --pair gpu-8b --draft-model draft_model \
        --system-words 1500 --out "$out/prefix-cache.md"
      for chunk in 0 512; do
        run "prefill-chunk-$chunk" 170 "$python" -m bench.prefix_bench --pair gpu-8b --stall --seconds 30 \
          --long-every 1 --system-words 1500 --launcher-arg=--set \
          "--launcher-arg=speculative_decoding.prefill_chunk_tokens=$chunk" --out "$out/prefill-chunk-$chunk.md"
      done ;;
    overhead)
      run overhead-greedy 120 "$python" -m bench.round_overhead --device gpu --out "$out/overhead-greedy.md"
      run overhead-sampled 120 "$python" -m bench.round_overhead --device gpu --temperature 1 \
        --out "$out/overhead-sampled.md"
      run overhead-guided 120 "$python" -m bench.round_overhead --device gpu --regex '[a-z ]{64,}' \
        --out "$out/overhead-guided.md" ;;
    overhead8b)
      run overhead-8b 300 "$python" -m bench.round_overhead --device gpu --pair 8b \
        --launcher-arg=--max-num-draft-tokens=4 --out "$out/overhead-8b.md" ;;
    pipeline)  # named twice: on, off, off, on
      ab pipeline on 270 "" -- --launcher-arg=--set=target_model.pipelined_execute=true \
        --launcher-arg=--set=draft_model.pipelined_execute=true ;;
    load)
      run load-unlimited 270 "$python" -m bench.gpu_bench --served-only --prompts 2 --streams 8 16 32 \
        --out "$out/load-unlimited.md"
      run load-limit-8 270 "$python" -m bench.gpu_bench --served-only --prompts 2 --streams 8 16 32 \
        --launcher-arg=--set=speculative_decoding.max_drafting_sequences=8 --out "$out/load-limit-8.md" ;;
    mps) ab mps off 200 "--extra-k 5" -- --launcher-arg=--mps ;;  # a daemon of the server's own; named twice: off on on off
    maxk) ab maxk off 200 "--extra-k 5" -- --launcher-arg=--max-num-draft-tokens=16 ;;  # named twice: off on on off
    prompts)  # prompts in captured buckets (prefill_graph_rows=512) against eager prompts (0); twice: on off off on
      ab prompts on 200 "--extra-k 5" -- --launcher-arg=--set=target_model.prefill_graph_rows=512 \
        --launcher-arg=--set=draft_model.prefill_graph_rows=512 --off \
        --launcher-arg=--set=target_model.prefill_graph_rows=0 --launcher-arg=--set=draft_model.prefill_graph_rows=0 ;;
    profile)  # cProfile over the models' execute (SPECDEC_PROFILE_DIR): 8 target-only streams, then 1 stream
      run profile-8-streams 200 env SPECDEC_PROFILE_DIR="$out/profile-8-streams" "$python" -m bench.gpu_bench \
        --served-only --prompts 4 --settings K=0 --no-one-stream --streams 8 --out "$out/profile-8-streams.md"
      run profile-1-stream 200 env SPECDEC_PROFILE_DIR="$out/profile-1-stream" "$python" -m bench.gpu_bench \
        --served-only --prompts 4 --streams --out "$out/profile-1-stream.md"
      for dir in profile-8-streams profile-1-stream; do
        [ -d "$out/$dir" ] && "$python" -m specdec.triton.profiling "$out/$dir" > "$out/$dir.txt" 2>&1
      done ;;
    traces)  # a client's torch profile of the served models (/start_profile, /stop_profile): one stream at K=0
             # and K=4, each model's kernels by device time in traces.md, the traces in traces/ (~3 min)
      run traces 240 "$python" -m bench.gpu_bench --served-only --prompts 2 --max-tokens 64 --no-one-stream \
        --streams --traces "$out/traces" --out "$out/traces.md" ;;
    attention)
      run executor-attention 200 "$python" -m bench.executor_bench --modes graphs-mlp,graphs-mlp-sdpa \
        --out "$out/executor-attention.md"
      run tests-paged 150 "$python" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -k "paged or every_bucket or trees_replayed"
      ab attention on 150 "" -- --launcher-arg=--set=target_model.attention=paged \
        --launcher-arg=--set=draft_model.attention=paged --off --launcher-arg=--set=target_model.attention=sdpa \
        --launcher-arg=--set=draft_model.attention=sdpa
      run kernels-paged 120 "$python" -m bench.kernel_profile --attention paged --out "$out/kernels-paged.md" ;;
    ahead)  # target_model's greedy steps run ahead (the CUDA default) against not; named twice: on off off on
      ab ahead on 170 "" -- --launcher-arg=--set=target_model.run_ahead=on --off \
        --launcher-arg=--set=target_model.run_ahead=off
      run executor-ahead 150 "$python" -m bench.executor_bench --modes graphs-mlp --out "$out/executor-ahead.md" ;;
    fp8)  # FP8 weights against bf16: the GPU test (unless tests ran), the kernel's launches, then the served
          # rows with the fastest launch measured; named twice: on off off on
      [ -n "${tests_ran:-}" ] || run tests-fp8 120 "$python" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -k fp8
      if [ -z "${SPECDEC_FP8_KERNEL:-}" ]; then
        run fp8-kernel 200 "$python" -m bench.fp8_kernel_bench --out "$out/fp8-kernel.md"
        best=$(sed -n 's/^best: //p' "$out/fp8-kernel.log" 2>/dev/null | tail -1)
        [ -n "$best" ] && export SPECDEC_FP8_KERNEL=$best && echo "fp8: served with launch $best" >> "$out/summary.txt"
      fi
      ab fp8 on 200 "" -- --launcher-arg=--weights-dtype=fp8 ;;
    swift)  # the searched skip draft as the default draft against the 4-layer early exit; twice: on off off on
      ab swift on 220 "" -- --launcher-arg=--skip-draft=swift=auto --launcher-arg=--default-draft=swift ;;
    drafttrees)  # the draft model's token trees (draft_branches=2) against its chains, K=4 and 8; twice: on off off on
      ab drafttrees on 200 "--extra-k 8" -- --launcher-arg=--set=speculative_decoding.draft_branches=2 ;;
    drafts)  # every draft beside one K=0 on one server: the layer-skip draft model's chains and trees, the skip
             # set found on an H200 captured, and the pair's heads (issues 43, 44, 48)
      synthetic_heads
      # The skip draft is the random target less some layers: as unsure of its tokens as the draft model, whose
      # confidence stop gpu_bench turns off for the same reason; so are the heads (K drafted as asked, the drafts
      # compared at their own α). swift_found: the set the search found on an H200 (2026-12-04, 24 of 32 layers
      # skipped; searched, it ran eagerly at 0.36x), given as a list: captured in CUDA graphs; swift: searched
      # again, its graphs following the set it holds best (since 2026-12-04; the warm pass is its search); their
      # KV pools sized (two more full-size models)
      found=${DRAFTS_SKIP_SET:-1-5,7-17,19,22-25,27-29}
      [ -n "${GPU_SESSION_SMALL:-}" ] && found=1
      run drafts 330 "$python" -m bench.gpu_bench --served-only --prompts 4 --warm-passes 1 --streams --long-prompts \
        --launcher-arg=--skip-draft=swift_found="$found" --launcher-arg=--skip-draft=swift=auto \
        --launcher-arg=--draft-head=eagle1="$eagle1" \
        --launcher-arg=--draft-head=eagle3="$eagle3" --launcher-arg=--default-draft=draft_model \
        --launcher-arg=--set=speculative_decoding.draft_branches=2 --launcher-arg=--set=swift_found.draft_stop_below=0 \
        --launcher-arg=--set=swift_found.kv_pool_tokens=65536 --launcher-arg=--set=swift.draft_stop_below=0 \
        --launcher-arg=--set=swift.kv_pool_tokens=65536 --launcher-arg=--set=eagle1.draft_stop_below=0 \
        --launcher-arg=--set=eagle3.draft_stop_below=0 \
        --drafts draft_model:2 swift_found swift eagle1 eagle1:2 eagle3 "${small[@]}" --out "$out/drafts.md" ;;
    headround)  # a head's request that drafts nothing pays the target's features every round (+3.1 ms on an H200):
                # its rounds split, features handed over on the device (CUDA IPC) and through the host
      synthetic_heads
      pairflag=(--pair 8b --device gpu)
      [ -n "${GPU_SESSION_SMALL:-}" ] && pairflag=(--pair small --max-tokens 16 --repeats 1)
      for outputs in true false; do
        run "headround-device-outputs-$outputs" 200 "$python" -m bench.round_overhead "${pairflag[@]}" --draft eagle3 \
          --paused-draft --launcher-arg=--draft-head=eagle3="$eagle3" --launcher-arg=--max-num-draft-tokens=4 \
          --launcher-arg=--set=eagle3.draft_stop_below=0 --launcher-arg=--set=target_model.device_outputs=$outputs \
          --out "$out/headround-device-outputs-$outputs.md"
      done ;;
    hostedround)  # the head hosted in target_model against the same head called (issue 43: a round's machinery)
      synthetic_heads
      pairflag=(--pair 8b --device gpu)
      [ -n "${GPU_SESSION_SMALL:-}" ] && pairflag=(--pair small --max-tokens 16 --repeats 1)
      for hosted in called hosted hosted-noahead; do
        where=(--launcher-arg=--set=eagle1.draft_stop_below=0)
        [ "$hosted" != called ] && where=(--launcher-arg=--heads-in-target
                                          --launcher-arg=--set=target_model.hosted_stop_below=0)
        # run_ahead (auto: on, on CUDA) drafts and verifies a hosted greedy round before its call; off: not
        [ "$hosted" = hosted-noahead ] && where+=(--launcher-arg=--set=target_model.run_ahead=off)
        run "hostedround-$hosted" 200 "$python" -m bench.round_overhead "${pairflag[@]}" --draft eagle1 --branches 1 \
          --launcher-arg=--draft-head=eagle1="$eagle1" --launcher-arg=--max-num-draft-tokens=4 "${where[@]}" \
          --out "$out/hostedround-$hosted.md"
      done ;;
    openai)
      pairflag=(--pair 8b --device gpu --requests 8 --max-tokens 128)
      [ -n "${GPU_SESSION_SMALL:-}" ] && pairflag=(--pair small --requests 2 --max-tokens 16)
      run openai 300 "$python" -m bench.openai_gateway_bench "${pairflag[@]}" --concurrency 1 4 \
        --out "$out/openai.md" ;;
    kernels) run kernels 300 "$python" -m bench.kernel_profile --out "$out/kernels.md" ;;
    ksweep)
      for ks in "6 5" "8 7"; do
        read -r k extra <<< "$ks"
        run "ksweep-$k" 200 "$python" -m bench.gpu_bench --served-only --prompts 4 --k "$k" --extra-k "$extra" \
          --out "$out/ksweep-$k.md"
      done ;;
    executor) run executor 240 "$python" -m bench.executor_bench --modes graphs,graphs-mlp --reference \
        --out "$out/executor.md" ;;
    *) echo "unknown part: $part (tests, heads, drafts, headround, hostedround, bench, ahead, drafttrees, swift, fp8, attention, orchestrators, executor, streams, prefix, pipeline, load, overhead, overhead8b, openai, mps, ksweep, profile, traces, prompts, maxk, kernels, lora)" >&2; exit 2 ;;
  esac
done
