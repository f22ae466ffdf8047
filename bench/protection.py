#!/usr/bin/env python3
"""Does a lane keep interactive audio predictable while text floods in, and what does text get?

Measures speech-to-text latency (p50/p95 over N clips sent one after another) and, at the same
time, what a text flood gets, in repeated rounds against real CPU engines (llama.cpp for text,
faster-whisper-server for speech, both using every core, so they contend for the machine the
way two engines contend for one GPU). All conditions go through `headroom serve` with
examples/cpu-box.toml (yield_to + preempt) unless said otherwise:
  idle        audio alone, back to back (the reference for audio), and with --gap, audio alone
              with the same gap (the reference for the gap conditions: a clip after a pause
              starts on a cold machine, text or no text);
  text alone  the flood with audio idle (the reference for text);
  then, for each duty cycle -- back-to-back clips, and clips with a gap of --gap seconds after
  each (a speaker pausing between utterances) -- the flood with audio, preempt on and preempt off;
  with --baselines also the flood sent to both engines directly and through nginx (least_conn),
  back to back. With --text-engine vllm, text goes to vLLM on this CPU and preempt_mode = "pause"
  (vLLM's sleep level 0: scheduling paused, requests kept) is compared with abort and off.
Each round runs every condition once (in a rotated order, so a drift in the machine's load hits
all alike); the table shows the median of the rounds and the spread (min-max) across them.
The flood is F concurrent long generations, each client starting a new one as soon as its last
ends (after a 429/503 it waits Retry-After, capped at 2 s). For text, each condition counts the
requests streamed to [DONE] and the tokens streamed (one content chunk = one token, as llama.cpp
streams them, preempted streams included), both per second; "text share" is the
completed-requests rate as a fraction of the same round's text-alone rate, "tok share" likewise.

With --compare-up, the comparison of docs/up.md instead: `headroom up` with
examples/cpu-box.up.toml (its own engines, on free ports, from a copy of the box file) against
`headroom serve` with examples/cpu-box.toml in front of --llama/--whisper, under the same flood
and the same clips. Each round measures the example (audio alone, then the flood with audio),
then starts `up` (the first round measures its box, later rounds start from its kept figures),
measures it the same way and stops it, so neither box runs while the other is measured. The
table gives, per box, audio success, p50/p95 (failures count at the time they took) and p95
against each box's own idle clips, and the text requests completed.

Run through bench/protection.sh, which installs and starts the backends first.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOX = ROOT / "tests" / "data" / "audio" / "fox.wav"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


class Flood:
    """F clients each running long generations back to back."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = {"served": 0, "preempted": 0, "rejected_429": 0, "http_503": 0, "other": 0, "tokens": 0}
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def run(self) -> None:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper."}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        with httpx.Client(timeout=300) as c:
            while not self.stop.is_set():
                try:
                    with c.stream("POST", self.url, json=body) as r:
                        if r.status_code == 429:
                            r.read()
                            self.count("rejected_429")
                            wait = float(r.headers.get("retry-after", "1"))
                            self.stop.wait(min(wait, 2.0))
                            continue
                        if r.status_code == 503:
                            r.read()
                            self.count("http_503")
                            wait = float(r.headers.get("retry-after", "1"))
                            self.stop.wait(min(wait, 2.0))
                            continue
                        if r.status_code != 200:
                            r.read()
                            self.count("other")
                            self.stop.wait(0.5)
                            continue
                        last = ""
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                last = line
                                if '"content"' in line and streamed_token(line):
                                    self.count("tokens")
                            if self.stop.is_set():
                                break
                        else:
                            if last == "data: [DONE]":
                                self.count("served")
                            elif '"preempted"' in last:
                                self.count("preempted")
                                self.stop.wait(1.0)
                            else:
                                self.count("other")
                except httpx.HTTPError:
                    self.count("other")
                    self.stop.wait(0.5)

    def __enter__(self):
        for t in self.threads:
            t.start()
        time.sleep(3)  # let the flood reach steady state
        with self.lock:
            # Count only what happens while audio is measured.
            self.counts = {k: 0 for k in self.counts}
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.final = dict(self.counts)
        self.seconds = time.perf_counter() - self.started
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def streamed_token(line: str) -> bool:
    """Whether an SSE data line carries generated text (a non-empty `delta.content`)."""
    try:
        choices = json.loads(line[6:]).get("choices") or []
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") for c in choices if isinstance(c, dict))


class QueueWatch:
    """Samples how many text requests wait inside llama.cpp (`requests_deferred`) and, when a
    gateway is in front, in the gateway's text lane, every 0.25 s."""

    def __init__(self, llama: str, gateway: str | None):
        self.llama, self.gateway = llama, gateway
        self.engine, self.lane = [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=2) as c:
            while not self.stop.wait(0.25):
                try:
                    m = re.search(r"^llamacpp:requests_deferred (\S+)$", c.get(f"{self.llama}/metrics").text, re.M)
                    if m:
                        self.engine.append(float(m.group(1)))
                    if self.gateway:
                        lanes = c.get(f"{self.gateway}/admin/lanes").json()["lanes"]
                        self.lane.append(sum(l.get("queued", 0) for l in lanes if l["name"] == "text"))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=5)

    def summary(self) -> dict:
        avg = lambda xs: statistics.mean(xs) if xs else 0.0  # noqa: E731
        return {"engine_queue_mean": avg(self.engine), "engine_queue_max": max(self.engine, default=0),
                "gateway_queue_mean": avg(self.lane), "gateway_queue_max": max(self.lane, default=0)}


def transcribe_outcomes(url: str, clips: int, gap: float = 0.0) -> list:
    """Sends `clips` transcriptions one after another: (seconds, status, short error) each; a
    200 whose text is not the clip's counts as status 0."""
    audio = FOX.read_bytes()
    out = []
    with httpx.Client(timeout=600) as c:
        for i in range(clips):
            if gap and i:
                time.sleep(gap)
            t = time.perf_counter()
            r = c.post(url, files={"file": ("fox.wav", audio, "audio/wav")}, data={"model": "whisper-1"})
            elapsed = time.perf_counter() - t
            ok = r.status_code == 200 and "lazy dog" in r.json().get("text", "").lower()
            out.append((elapsed, r.status_code if ok or r.status_code != 200 else 0, "" if ok else r.text[:200]))
    return out


def transcribe_latencies(url: str, clips: int, gap: float = 0.0) -> list:
    out = []
    for elapsed, status, error in transcribe_outcomes(url, clips, gap):
        if status != 200:
            raise SystemExit(f"transcription failed: {status} {error}")
        out.append(elapsed)
    return out


def pct(xs: list, p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round((len(s) - 1) * p))]


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  client_max_body_size 50m;
  client_body_buffer_size 50m;
  upstream text {{ least_conn; server {llama}; }}
  upstream audio {{ least_conn; server {whisper}; }}
  server {{
    listen 127.0.0.1:{port};
    proxy_http_version 1.1;
    proxy_read_timeout 600s;
    proxy_buffering off;
    location /v1/chat/ {{ proxy_pass http://text; }}
    location /v1/completions {{ proxy_pass http://text; }}
    location /v1/audio/ {{ proxy_pass http://audio; }}
  }}
}}
"""


def start_nginx(llama: str, whisper: str):
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    prefix = tempfile.mkdtemp(prefix="headroom-nginx-")
    os.chmod(prefix, 0o755)  # nginx workers run as an unprivileged user
    port = free_port()
    conf = pathlib.Path(prefix) / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(prefix=prefix, port=port, llama=llama.removeprefix("http://"), whisper=whisper.removeprefix("http://"))
    )
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", prefix], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    time.sleep(0.5)
    return proc, base


def start_headroom(binary: str, text_url: str, whisper: str, mode: str = "abort", engine: str = "llamacpp"):
    """`headroom serve` with examples/cpu-box.toml on a free port; `mode` is the text lane's
    preemption: "abort" (preempt on, the example's), "pause" (preempt_mode = "pause", vLLM only)
    or "off" (preempt = false). With engine "vllm" the text lane reads vLLM's metrics instead."""
    port = free_port()
    text = (ROOT / "examples" / "cpu-box.toml").read_text()
    text = re.sub(r'^listen = ".*"$', f'listen = "127.0.0.1:{port}"', text, flags=re.M)
    text = text.replace("http://127.0.0.1:18080", text_url).replace("http://127.0.0.1:18081", whisper)
    replace = {"off": "preempt = false", "pause": 'preempt = true\npreempt_mode = "pause"'}.get(mode)
    if replace:
        text, n = re.subn(r"^preempt = true$", replace, text, flags=re.M)
        if n != 1:
            raise SystemExit("examples/cpu-box.toml has no `preempt = true` line to change")
        # What only stopping requests uses (abort) goes with it.
        text = re.sub(r"^preempt_(per_job|settle) = .*$", "", text, flags=re.M)
    if engine == "vllm":
        text, n = re.subn(r'^engine = "llamacpp"$', 'engine = "vllm"', text, flags=re.M)
        if n != 1:
            raise SystemExit('examples/cpu-box.toml has no `engine = "llamacpp"` line to change')
    cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    cfg.write(text)
    cfg.close()
    proc = subprocess.Popen([binary, "serve", "--config", cfg.name], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_up(f"{base}/healthz")
    return proc, base


def start_up(binary: str, workdir: pathlib.Path, recalibrate: bool):
    """`headroom up` with a copy of examples/cpu-box.up.toml in `workdir` (paths made absolute,
    every port a free one; the calibration file beside the copy). Returns (process, gateway base,
    its llama.cpp URL) once every backend is ready."""
    text = (ROOT / "examples" / "cpu-box.up.toml").read_text().replace('"../', f'"{ROOT}/')
    port, whisper, tts, llama = free_port(), free_port(), free_port(), free_port()
    text = re.sub(r'^listen = ".*"$', f'listen = "127.0.0.1:{port}"', text, flags=re.M)
    text = text.replace("port = 18281", f"port = {whisper}").replace("port = 18280", f"port = {llama}")
    text = text.replace("port = 18282", f"port = {tts}")
    box = workdir / "box.up.toml"
    box.write_text(text)
    args = [binary, "up", "--config", str(box), "--log-dir", str(workdir / "logs")]
    log = open(workdir / "up.log", "a")
    proc = subprocess.Popen(args + (["--recalibrate"] if recalibrate else []), stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"headroom up exited {proc.returncode}; see {workdir / 'up.log'}")
        try:
            r = httpx.get(f"{base}/admin/box", timeout=2)
            if r.status_code == 200 and all(b["state"] == "ready" for b in r.json()["backends"]):
                return proc, base, f"http://127.0.0.1:{llama}"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"headroom up was not ready in 600 s; see {workdir / 'up.log'}")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


ZERO = {"served": 0, "preempted": 0, "rejected_429": 0, "http_503": 0, "other": 0, "tokens": 0}


class Bench:
    """The conditions of one run; each returns one row (a dict) per call."""

    def __init__(self, args, fronts: dict):
        self.args, self.fronts = args, fronts

    def measure(self, front: str, audio: bool, text: bool, gap: float) -> dict:
        base, gateway = self.fronts[front]
        audio_url = f"{base[1]}/v1/audio/transcriptions"
        text_url = f"{base[0]}/v1/chat/completions"
        t0 = time.time()
        with QueueWatch(self.args.llama, gateway) as watch:
            if not text:
                lat, counts, seconds = transcribe_latencies(audio_url, self.args.clips, gap), ZERO, 0.0
            else:
                with Flood(text_url, self.args.flood, self.args.max_tokens) as flood:
                    if audio:
                        lat = transcribe_latencies(audio_url, self.args.clips, gap)
                    else:
                        lat = []
                        time.sleep(self.args.text_seconds)
                counts, seconds = flood.final, flood.seconds
        row = {**counts, **watch.summary(), "text_seconds": seconds, "seconds": time.time() - t0,
               "load": os.getloadavg()[0]}
        if seconds:
            row["done_per_s"] = counts["served"] / seconds
            row["tok_per_s"] = counts["tokens"] / seconds
        if lat:
            row.update({"p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "p99": pct(lat, 0.99),
                        "mean": statistics.mean(lat), "latencies": lat})
        return row


def modes(args) -> list:
    """The preemption settings compared: abort and off; with vLLM as the text engine also pause."""
    return ["abort", "off"] + (["pause"] if args.text_engine == "vllm" else [])


def idle_name(gap: float) -> str:
    return "idle" if not gap else f"idle, gap {gap:g}s"


def conditions(args) -> list:
    """(name, front, audio, text, gap) for every condition of one round."""
    out = [("idle", "abort", True, False, 0.0), ("text alone", "abort", False, True, 0.0)]
    duties = [("back to back", 0.0)] + ([(f"gap {args.gap:g}s", args.gap)] if args.gap > 0 else [])
    if args.gap > 0:
        # A clip after a pause starts on a cold machine (its threads parked, caches cold): the gap
        # conditions are held against clips with the same gap and no text.
        out.append((idle_name(args.gap), "abort", True, False, args.gap))
    label = {"abort": "preempt on", "off": "preempt off", "pause": "preempt pause"}
    for duty, gap in duties:
        for mode in modes(args):
            out.append((f"{duty}, {label[mode]}", mode, True, True, gap))
    if args.baselines:
        out.append(("back to back, direct", "direct", True, True, 0.0))
        out.append(("back to back, nginx", "nginx", True, True, 0.0))
    return out


def audio_summary(outcomes: list) -> dict:
    """Success and latency of one series of clips (a failure counts at the time it took)."""
    took = [e for e, _, _ in outcomes]
    failed = [(s, err) for _, s, err in outcomes if s != 200]
    return {"ok": len(outcomes) - len(failed), "clips": len(outcomes), "p50": pct(took, 0.5),
            "p95": pct(took, 0.95), "latencies": took, "failures": failed[:3]}


def measure_box(base: str, args) -> dict:
    """Clips alone, then clips under the flood, through one box's gateway."""
    audio_url, text_url = f"{base}/v1/audio/transcriptions", f"{base}/v1/chat/completions"
    idle = audio_summary(transcribe_outcomes(audio_url, args.clips))
    with Flood(text_url, args.flood, args.max_tokens) as flood:
        flooded = audio_summary(transcribe_outcomes(audio_url, args.clips))
    return {"idle": idle, "flood": flooded, "text": flood.final, "text_seconds": flood.seconds,
            "load": os.getloadavg()[0]}


def compare_up(args) -> list:
    """Rounds of the example box (serve + examples/cpu-box.toml in front of --llama/--whisper)
    and `up` with examples/cpu-box.up.toml, one box at a time, in alternating order."""
    example, example_base = start_headroom(args.headroom, args.llama, args.whisper)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="headroom-up-bench-"))
    rounds = []
    print(f"up against the example: {args.rounds} rounds, {args.clips} clips alone and {args.clips} under a "
          f"flood of {args.flood} x {args.max_tokens} tokens per box; load average {os.getloadavg()[0]:.2f} "
          f"at the start; up's files in {workdir}", file=sys.stderr)
    try:
        for r in range(args.rounds):
            row = {}
            for box in (["example", "up"] if r % 2 == 0 else ["up", "example"]):
                if box == "example":
                    row[box] = measure_box(example_base, args)
                else:
                    proc, base, _ = start_up(args.headroom, workdir, recalibrate=r == 0)
                    try:
                        row[box] = measure_box(base, args)
                    finally:
                        stop(proc)
                m = row[box]
                print(f"  round {r + 1} {box}: alone p95 {m['idle']['p95']:.2f}s; flood {m['flood']['ok']}/"
                      f"{m['flood']['clips']} ok, p50 {m['flood']['p50']:.2f}s p95 {m['flood']['p95']:.2f}s; text "
                      f"{m['text']['served']} done, {m['text']['rejected_429']} x 429, {m['text']['http_503']} x 503 "
                      f"(load {m['load']:.1f})", file=sys.stderr, flush=True)
            rounds.append(row)
    finally:
        stop(example)
    derived = [line.strip() for line in (workdir / "up.log").read_text().splitlines()
               if "sequence(s)" in line or "beside [" in line]
    report_compare(rounds, args, derived[-2:])
    return rounds


def report_compare(rounds: list, args, derived: list) -> None:
    print()
    print(f"up (examples/cpu-box.up.toml) against serve (examples/cpu-box.toml): median of {len(rounds)} rounds "
          f"(min-max); {args.clips} clips of {FOX.name} alone and under a flood of {args.flood} streams x "
          f"{args.max_tokens} tokens, per box and round")
    cols = ["box", "audio ok", "alone p95 s", "flood p50 s", "flood p95 s", "p95 / alone", "text done", "429", "503"]
    table = []
    for box in ("example", "up"):
        rows = [r[box] for r in rounds]
        ok = sum(m["flood"]["ok"] for m in rows)
        table.append([
            "serve + cpu-box.toml" if box == "example" else "up + cpu-box.up.toml",
            f"{ok}/{sum(m['flood']['clips'] for m in rows)}",
            spread([m["idle"]["p95"] for m in rows], ".2f"),
            spread([m["flood"]["p50"] for m in rows], ".2f"),
            spread([m["flood"]["p95"] for m in rows], ".2f"),
            spread([m["flood"]["p95"] / m["idle"]["p95"] for m in rows], ".2f"),
            spread([m["text"]["served"] for m in rows], ".0f"),
            spread([m["text"]["rejected_429"] for m in rows], ".0f"),
            spread([m["text"]["http_503"] for m in rows], ".0f"),
        ])
    widths = [max(len(str(row[i])) for row in table + [cols]) for i in range(len(cols))]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    ratio = statistics.median(r["up"]["flood"]["p95"] / r["example"]["flood"]["p95"] for r in rounds)
    ok = [sum(r[b]["flood"]["ok"] for r in rounds) for b in ("up", "example")]
    loads = [r[b]["load"] for r in rounds for b in r]
    print(f"target: up's audio success >= the example's ({ok[0]} vs {ok[1]}: {'PASS' if ok[0] >= ok[1] else 'FAIL'}); "
          f"up's flood p95 <= 1.2 x the example's ({ratio:.2f} x: {'PASS' if ratio <= 1.2 else 'FAIL'}); load "
          f"average {min(loads):.1f}-{max(loads):.1f} during the run")
    for line in derived:
        print(f"  {line}")
    for box in ("example", "up"):
        for r in rounds:
            for status, error in r[box]["flood"]["failures"]:
                print(f"  {box} failure: {status} {error}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama", default=os.environ.get("HEADROOM_LLAMA_URL", "http://127.0.0.1:18080"))
    ap.add_argument("--whisper", default=os.environ.get("HEADROOM_WHISPER_URL", "http://127.0.0.1:18081"))
    ap.add_argument("--headroom", default=str(ROOT / "target" / "release" / "headroom"))
    ap.add_argument("--clips", type=int, default=20, help="clips per condition and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the table shows their medians")
    ap.add_argument("--flood", type=int, default=8, help="concurrent long generations")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--gap", type=float, default=4.0,
                    help="seconds after each clip in the duty-cycle conditions (0 skips them)")
    ap.add_argument("--text-seconds", type=float, default=30.0, help="length of the text-alone condition")
    ap.add_argument("--baselines", action="store_true", help="also the flood direct and through nginx")
    ap.add_argument("--text-engine", choices=["llamacpp", "vllm"], default="llamacpp",
                    help="vllm: text goes to --vllm (started with VLLM_SERVER_DEV_MODE=1) and "
                         "preempt_mode = \"pause\" is compared too")
    ap.add_argument("--vllm", default=os.environ.get("HEADROOM_VLLM_URL", "http://127.0.0.1:18082"))
    ap.add_argument("--json", help="also write every round's rows here")
    ap.add_argument("--compare-up", action="store_true",
                    help="compare `headroom up` with examples/cpu-box.up.toml against the example box instead")
    args = ap.parse_args()
    if args.compare_up:
        rounds = compare_up(args)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rounds, indent=2))
        return

    procs = []
    text_url = args.vllm if args.text_engine == "vllm" else args.llama
    fronts = {"direct": ((text_url, args.whisper), None)}
    try:
        for mode in modes(args):
            proc, base = start_headroom(args.headroom, text_url, args.whisper, mode, args.text_engine)
            procs.append(proc)
            fronts[mode] = ((base, base), base)
        if args.baselines:
            proc, base = start_nginx(text_url, args.whisper)
            procs.append(proc)
            fronts["nginx"] = ((base, base), None)
        bench = Bench(args, fronts)
        conds = conditions(args)
        print(f"protection benchmark: {args.rounds} rounds x {len(conds)} conditions, {args.clips} clips each, "
              f"flood of {args.flood} x {args.max_tokens} tokens, gap {args.gap:g} s, load average "
              f"{os.getloadavg()[0]:.2f} at the start", file=sys.stderr)
        rounds = []
        for r in range(args.rounds):
            # Idle and text alone open every round (each round's references); the rest rotate.
            rest = conds[2:]
            k = r % len(rest) if rest else 0
            order = conds[:2] + rest[k:] + rest[:k]
            rows = {}
            for name, front, audio, text, gap in order:
                row = bench.measure(front, audio, text, gap)
                rows[name] = row
                audio_s = f"p50 {row['p50']:.3f}s p95 {row['p95']:.3f}s" if "p50" in row else "no audio"
                text_s = (f"text {row['served']} done, {row['tok_per_s']:.1f} tok/s, {row['preempted']} preempted, "
                          f"{row['rejected_429']} x 429" if row["text_seconds"] else "no text")
                print(f"  round {r + 1} {name}: {audio_s}; {text_s} (load {row['load']:.1f})",
                      file=sys.stderr, flush=True)
            rounds.append(rows)
    finally:
        for proc in procs:
            stop(proc)
    report(rounds, conds, args)


def name_of(rows: dict, row: dict) -> str:
    """The condition name of `row` within one round's `rows`."""
    return next(name for name, r in rows.items() if r is row)


def spread(values: list, fmt: str) -> str:
    """Median of the rounds with their min-max."""
    if not values:
        return "-"
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def report(rounds: list, conds: list, args) -> None:
    def per_round(name, f):
        out = []
        for rows in rounds:
            v = f(rows[name], rows)
            if v is not None:
                out.append(v)
        return out

    gaps = {name: gap for name, _, _, _, gap in conds}
    # Each condition against the idle clips of its own duty cycle (same round).
    audio_ratio = lambda key: lambda r, rows: (  # noqa: E731
        r[key] / rows[idle_name(gaps[name_of(rows, r)])][key] if key in r else None)

    def share(key):
        def f(r, rows):
            ref = rows["text alone"].get(key, 0.0)
            return r[key] / ref if key in r and ref else None
        return f

    print()
    print(f"audio latency and text throughput, median of {len(rounds)} rounds (min-max across rounds); "
          f"{args.clips} clips of {FOX.name} per condition and round")
    cols = ["condition", "audio p50 s", "audio p95 s", "p95 / idle", "text done/s", "done share",
            "tok/s", "tok share", "preempted", "429"]
    table = []
    for name, *_ in conds:
        table.append([
            name,
            spread(per_round(name, lambda r, _: r.get("p50")), ".3f"),
            spread(per_round(name, lambda r, _: r.get("p95")), ".3f"),
            spread(per_round(name, audio_ratio("p95")), ".2f") if not name.startswith("idle") else "1",
            spread(per_round(name, lambda r, _: r.get("done_per_s")), ".3f"),
            spread(per_round(name, share("done_per_s")), ".2f") if name != "text alone" else "1",
            spread(per_round(name, lambda r, _: r.get("tok_per_s")), ".1f"),
            spread(per_round(name, share("tok_per_s")), ".2f") if name != "text alone" else "1",
            spread(per_round(name, lambda r, _: r["preempted"] if r["text_seconds"] else None), ".0f"),
            spread(per_round(name, lambda r, _: r["rejected_429"] if r["text_seconds"] else None), ".0f"),
        ])
    widths = [max(len(str(row[i])) for row in table + [cols]) for i in range(len(cols))]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print("text: done = streamed to [DONE]; tok/s = content chunks streamed per second (preempted streams")
    print("included); share = as a fraction of the same round's text-alone figure; 429 = answered by the")
    print("gateway (the client waits Retry-After); p95 / idle = against the idle clips of the same duty cycle")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rounds, indent=2))
    loads = [r["load"] for rows in rounds for r in rows.values()]
    print()
    print(f"target: audio p95 <= 1.2 x idle with preempt on, text still completing (load average "
          f"{min(loads):.1f}-{max(loads):.1f} during the run):")
    for name, *_ in conds:
        if "preempt on" in name or "preempt pause" in name:
            ratios = per_round(name, audio_ratio("p95"))
            done = per_round(name, share("done_per_s"))
            tok = per_round(name, share("tok_per_s"))
            med = statistics.median(ratios)
            # A share is undefined where text alone completed nothing (long generations on a slow box).
            share_of = lambda xs: f"{statistics.median(xs):.0%}" if xs else "- (none completed alone)"  # noqa: E731
            print(f"  {name:<28} p95 {med:.2f} x idle {'PASS' if med <= 1.2 else 'FAIL'} "
                  f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}); text completes "
                  f"{share_of(done)} of text alone, {share_of(tok)} of its tokens/s")


if __name__ == "__main__":
    main()
