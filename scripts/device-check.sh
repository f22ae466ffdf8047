#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU, PyTorch with CUDA, and python3.
#
# 1. Runs the probe once (`headroom top --once --format json`).
# 2. Records samples every 20 ms (`headroom top --record FILE --interval 20ms --duration D`).
# 3. Meanwhile a PyTorch process allocates 1 GiB every 0.5 s up to 8 GiB, holds it, then frees it.
# 4. Checks that each step was seen in the samples within 100 ms of the allocation call and that
#    the memory was attributed to that process's pid; prints a table. Exit 0 when every step
#    passes, 1 when one does not, 2 when the machine cannot run the check.
#
# Usage: scripts/device-check.sh            (artifacts go to $OUT if set, else a temp dir)
#        HEADROOM=path/to/headroom scripts/device-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT_DIR"
STEPS="${STEPS:-8}"
INTERVAL="${INTERVAL:-20ms}"
LIMIT_MS="${LIMIT_MS:-100}"

HEADROOM="${HEADROOM:-target/release/headroom}"
if [[ ! -x "$HEADROOM" ]]; then
  echo "== building headroom (release)"
  cargo build --release --locked --bin headroom
fi

echo "== probe"
if ! "$HEADROOM" top --once --format json > "$OUT_DIR/probe.json"; then
  echo "device-check: the probe cannot read a GPU here" >&2
  exit 2
fi
python3 - "$OUT_DIR/probe.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for g in doc["gpus"]:
    print(f"GPU {g['gpu']} {g['name']}: {g['used_bytes']/2**20:.0f}/{g['total_bytes']/2**20:.0f} MiB used, "
          f"{len(g['processes'])} processes")
PY

if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "device-check: python3 with a CUDA-enabled torch is required" >&2
  exit 2
fi

# Steps every 0.5 s, 1 s of baseline before, 1 s hold, free, 1 s after: about STEPS/2 + 5 s.
DURATION_MS=$(( (STEPS * 500) + 7000 ))
echo "== sampling every $INTERVAL for ${DURATION_MS} ms into $OUT_DIR/samples.jsonl"
rm -f "$OUT_DIR/samples.jsonl"
"$HEADROOM" top --record "$OUT_DIR/samples.jsonl" --interval "$INTERVAL" --duration "${DURATION_MS}ms" \
  > "$OUT_DIR/record.out" 2> "$OUT_DIR/record.err" &
RECORDER=$!
sleep 0.5

echo "== allocating $STEPS x 1 GiB with PyTorch"
CUDA_DEVICE_ORDER=PCI_BUS_ID python3 - "$STEPS" > "$OUT_DIR/steps.jsonl" <<'PY'
import json, os, sys, time
import torch
steps = int(sys.argv[1])
now = lambda: int(time.time() * 1000)
dev = torch.device("cuda:0")
torch.zeros(1, device=dev)          # create the CUDA context first; it is part of the baseline
torch.cuda.synchronize()
print(json.dumps({"event": "ready", "pid": os.getpid(), "ts_ms": now(),
                  "gpu_uuid": str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))}), flush=True)
time.sleep(1.0)
held = []
for k in range(1, steps + 1):
    start = now()
    t = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    t.fill_(1)
    torch.cuda.synchronize()
    held.append(t)
    print(json.dumps({"event": "alloc", "step": k, "start_ms": start, "done_ms": now()}), flush=True)
    time.sleep(0.5)
time.sleep(0.5)
start = now()
held.clear()
torch.cuda.synchronize()
torch.cuda.empty_cache()
torch.cuda.synchronize()
print(json.dumps({"event": "free", "step": steps + 1, "start_ms": start, "done_ms": now()}), flush=True)
time.sleep(1.0)
PY

wait "$RECORDER" || { echo "device-check: the recorder failed:"; cat "$OUT_DIR/record.err"; exit 2; }
cat "$OUT_DIR/record.err"

echo "== steps seen"
python3 scripts/device_check_analyse.py "$OUT_DIR/samples.jsonl" "$OUT_DIR/steps.jsonl" "$LIMIT_MS"
