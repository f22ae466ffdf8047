#!/usr/bin/env python3
"""Does a lane keep interactive audio predictable while text floods in?

Measures speech-to-text latency (p50/p95/p99 over N clips, one at a time) on this box, and what
text gets meanwhile, in one run:
  (a) idle: clients talk to the speech server directly, nothing else running;
  (t) text alone: the flood with audio idle, directly (what text completes when nothing competes);
  (b) text flood, clients talk to both engines directly;
  (c) the same flood through nginx as a plain reverse proxy (least_conn);
  (d) the same flood through `headroom serve` with examples/cpu-box.toml (preempt on);
then, at a realistic duty cycle (each clip followed by a gap of --gap seconds, as a speaker pauses
between utterances), (e) flood direct and (f) flood through headroom serve again.
The flood is F concurrent long generations, each client starting a new one as soon as its last
ends (after a 429 it waits Retry-After, capped at 2 s, and counts the rejection). For text, each
condition counts the requests streamed to [DONE], the tokens streamed (one content chunk = one
token, as llama.cpp streams them, preempted streams included) and both per second; "text share" is
the completed-requests rate as a fraction of (t), and tokens/s likewise.
Prints a table with the ratio of each condition to (a) and what happened to text requests.

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


def transcribe_latencies(url: str, clips: int, gap: float = 0.0) -> list:
    audio = FOX.read_bytes()
    out = []
    with httpx.Client(timeout=600) as c:
        for i in range(clips):
            if gap and i:
                time.sleep(gap)
            t = time.perf_counter()
            r = c.post(url, files={"file": ("fox.wav", audio, "audio/wav")}, data={"model": "whisper-1"})
            elapsed = time.perf_counter() - t
            if r.status_code != 200 or "lazy dog" not in r.json().get("text", "").lower():
                raise SystemExit(f"transcription failed: {r.status_code} {r.text[:200]}")
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


def start_headroom(binary: str, llama: str, whisper: str):
    port = free_port()
    text = (ROOT / "examples" / "cpu-box.toml").read_text()
    text = re.sub(r'^listen = ".*"$', f'listen = "127.0.0.1:{port}"', text, flags=re.M)
    text = text.replace("http://127.0.0.1:18080", llama).replace("http://127.0.0.1:18081", whisper)
    cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    cfg.write(text)
    cfg.close()
    proc = subprocess.Popen([binary, "serve", "--config", cfg.name], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_up(f"{base}/healthz")
    return proc, base


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama", default=os.environ.get("HEADROOM_LLAMA_URL", "http://127.0.0.1:18080"))
    ap.add_argument("--whisper", default=os.environ.get("HEADROOM_WHISPER_URL", "http://127.0.0.1:18081"))
    ap.add_argument("--headroom", default=str(ROOT / "target" / "release" / "headroom"))
    ap.add_argument("--clips", type=int, default=30)
    ap.add_argument("--flood", type=int, default=8, help="concurrent long generations")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--gap", type=float, default=4.0,
                    help="seconds between clips in the duty-cycle conditions (0 skips them)")
    ap.add_argument("--text-seconds", type=float, default=30.0, help="length of the text-alone condition")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    rows = []
    zero = {"served": 0, "preempted": 0, "rejected_429": 0, "http_503": 0, "other": 0, "tokens": 0}

    def record(name, lat, counts, seconds, watch, t0):
        counts = dict(counts)
        counts.update(watch.summary())
        counts["text_seconds"] = seconds
        row = {"condition": name, "seconds": time.time() - t0, **counts}
        if lat:
            row.update({"p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "p99": pct(lat, 0.99), "mean": statistics.mean(lat)})
        rows.append(row)
        audio = f"p50 {row['p50']:.3f}s p95 {row['p95']:.3f}s" if lat else "no audio"
        print(f"  {name}: {audio}, text {counts}", file=sys.stderr, flush=True)

    def run(name, audio_url, text_url, gateway=None, gap=0.0):
        t0 = time.time()
        with QueueWatch(args.llama, gateway) as watch:
            if text_url is None:
                lat = transcribe_latencies(audio_url, args.clips, gap)
                counts, seconds = zero, 0.0
            else:
                with Flood(text_url, args.flood, args.max_tokens) as flood:
                    lat = transcribe_latencies(audio_url, args.clips, gap)
                counts, seconds = flood.final, flood.seconds
        record(name, lat, counts, seconds, watch, t0)

    def text_alone(name, text_url):
        t0 = time.time()
        with QueueWatch(args.llama, None) as watch:
            with Flood(text_url, args.flood, args.max_tokens) as flood:
                time.sleep(args.text_seconds)
        record(name, [], flood.final, flood.seconds, watch, t0)

    print(f"protection benchmark: {args.clips} clips, flood of {args.flood} × {args.max_tokens} tokens, "
          f"duty-cycle gap {args.gap} s", file=sys.stderr)
    whisper = f"{args.whisper}/v1/audio/transcriptions"
    llama = f"{args.llama}/v1/chat/completions"
    run("(a) idle, direct", whisper, None)
    text_alone("(t) text alone, direct", llama)
    run("(b) flood, direct", whisper, llama)
    nginx, nbase = start_nginx(args.llama, args.whisper)
    try:
        run("(c) flood, nginx least_conn", f"{nbase}/v1/audio/transcriptions", f"{nbase}/v1/chat/completions")
    finally:
        stop(nginx)
    hr, hbase = start_headroom(args.headroom, args.llama, args.whisper)
    try:
        run("(d) flood, headroom serve", f"{hbase}/v1/audio/transcriptions", f"{hbase}/v1/chat/completions", hbase)
        if args.gap > 0:
            run(f"(f) gap {args.gap:g}s, headroom", f"{hbase}/v1/audio/transcriptions",
                f"{hbase}/v1/chat/completions", hbase, args.gap)
    finally:
        stop(hr)
    if args.gap > 0:
        run(f"(e) gap {args.gap:g}s, flood direct", whisper, llama, gap=args.gap)

    report(rows, args)


def report(rows: list, args) -> None:
    base = rows[0]
    text = next(r for r in rows if r["condition"].startswith("(t)"))
    rate = lambda r, k: r[k] / r["text_seconds"] if r["text_seconds"] else 0.0  # noqa: E731
    t_done, t_tok = rate(text, "served"), rate(text, "tokens")
    print()
    print(f"{'condition':<30} {'p50 s':>7} {'p95 s':>7} {'p99 s':>7} {'p95/(a)':>8} "
          f"{'done':>5} {'done/s':>7} {'tok/s':>7} {'share':>6} {'tok share':>9} "
          f"{'preempt':>8} {'429':>5} {'503':>5} {'other':>6} {'queued in engine':>17} {'queued in gateway':>18}")
    for r in rows:
        audio = (f"{r['p50']:>7.3f} {r['p95']:>7.3f} {r['p99']:>7.3f} {r['p95'] / base['p95']:>8.2f}"
                 if "p50" in r else f"{'-':>7} {'-':>7} {'-':>7} {'-':>8}")
        if r["text_seconds"]:
            share = f"{rate(r, 'served') / t_done:>6.2f}" if t_done else f"{'n/a':>6}"
            tshare = f"{rate(r, 'tokens') / t_tok:>9.2f}" if t_tok else f"{'n/a':>9}"
            textcols = f"{r['served']:>5} {rate(r, 'served'):>7.3f} {rate(r, 'tokens'):>7.1f} {share} {tshare}"
        else:
            textcols = f"{'-':>5} {'-':>7} {'-':>7} {'-':>6} {'-':>9}"
        print(f"{r['condition']:<30} {audio} {textcols} {r['preempted']:>8} {r['rejected_429']:>5} {r['http_503']:>5} "
              f"{r['other']:>6} {r['engine_queue_mean']:>8.1f} (max {r['engine_queue_max']:>2.0f}) "
              f"{r['gateway_queue_mean']:>9.1f} (max {r['gateway_queue_max']:>2.0f})")
    print("text during each condition: done = streamed to [DONE]; tok/s = content chunks streamed per second")
    print("(preempted streams included); share = done/s and tok share = tok/s as fractions of (t) text alone;")
    print("preempt = stopped by audio work; 429/503 = answered by the gateway (client waits Retry-After);")
    print("queued = waiting, sampled every 0.25 s")
    print()
    print(f"target (audio p95 <= 1.2 x idle with preempt on, text still completing; load average "
          f"{os.getloadavg()[0]:.2f}):")
    for r in rows:
        if "headroom" in r["condition"]:
            ratio = r["p95"] / base["p95"]
            share = rate(r, "served") / t_done if t_done else 0.0
            print(f"  {r['condition']:<28} p95 {ratio:.2f}x idle {'PASS' if ratio <= 1.2 else 'FAIL'}; "
                  f"text completes {share:.0%} of (t) ({rate(r, 'tokens') / t_tok if t_tok else 0:.0%} of its tokens/s)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))

if __name__ == "__main__":
    main()
