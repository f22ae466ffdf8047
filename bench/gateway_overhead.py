#!/usr/bin/env python3
"""What does a gateway add? One fast local upstream (nginx answering a fixed chat completion),
loaded with oha three ways: straight to it, through nginx as a reverse proxy, and through
`headroom serve` with one lane. At a fixed rate it reports latency p50/p99 and what each proxy
adds over the direct path; at full speed the requests per second each sustains; then the ratio
headroom / nginx. Run through bench/gateway-overhead.sh.
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
ANSWER = ('{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
          '"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],'
          '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')

NGINX = """
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  upstream fast {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{upstream};
    location / {{ default_type application/json; return 200 '{answer}'; }}
  }}
  server {{
    listen 127.0.0.1:{proxy};
    location / {{ proxy_pass http://fast; proxy_http_version 1.1; proxy_set_header Connection ""; }}
  }}
}}
"""

HEADROOM = """
listen = "127.0.0.1:{port}"
[[lanes]]
name = "text"
paths = ["/v1/chat/completions", "/v1/completions"]
upstreams = ["http://127.0.0.1:{upstream}"]
max_inflight = 256
max_queue = 1024
queue_timeout = "5s"
request_timeout = "60s"
policy = "queue"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str) -> None:
    for _ in range(300):
        try:
            req = urllib.request.Request(url, data=BODY.encode(), headers={"content-type": "application/json"})
            urllib.request.urlopen(req, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not answer")


def oha(url: str, seconds: int, concurrency: int, rate: int | None) -> dict:
    cmd = ["oha", "--no-tui", "--output-format", "json", "-z", f"{seconds}s", "-c", str(concurrency),
           "-m", "POST", "-H", "content-type: application/json", "-d", BODY, url]
    if rate:
        cmd[1:1] = ["-q", str(rate), "--latency-correction"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    data = json.loads(out)
    codes = data.get("statusCodeDistribution", {})
    return {
        "rps": data["summary"]["requestsPerSec"],
        "p50_ms": data["latencyPercentiles"]["p50"] * 1e3,
        "p99_ms": data["latencyPercentiles"]["p99"] * 1e3,
        "ok": codes.get("200", 0),
        "not_ok": sum(v for k, v in codes.items() if k != "200"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--headroom", default=str(ROOT / "target" / "release" / "headroom"))
    ap.add_argument("--rate", type=int, default=500, help="fixed request rate per second")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=32, help="connections at full speed")
    args = ap.parse_args()

    prefix = tempfile.mkdtemp(prefix="headroom-overhead-")
    os.chmod(prefix, 0o755)  # nginx workers run as an unprivileged user
    upstream, proxy, gateway = free_port(), free_port(), free_port()
    conf = pathlib.Path(prefix) / "nginx.conf"
    conf.write_text(NGINX.format(prefix=prefix, upstream=upstream, proxy=proxy, answer=ANSWER))
    cfg = pathlib.Path(prefix) / "headroom.toml"
    cfg.write_text(HEADROOM.format(port=gateway, upstream=upstream))
    nginx = subprocess.Popen([shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(conf), "-p", prefix])
    hr = subprocess.Popen([args.headroom, "serve", "--config", str(cfg)])
    try:
        targets = {
            "direct": f"http://127.0.0.1:{upstream}/v1/chat/completions",
            "nginx": f"http://127.0.0.1:{proxy}/v1/chat/completions",
            "headroom": f"http://127.0.0.1:{gateway}/v1/chat/completions",
        }
        for url in targets.values():
            wait_up(url)
        fixed = {k: oha(u, args.seconds, 16, args.rate) for k, u in targets.items()}
        full = {k: oha(u, args.seconds, args.concurrency, None) for k, u in targets.items()}
    finally:
        for p in (hr, nginx):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=20)

    print(f"fixed rate {args.rate}/s for {args.seconds}s (16 connections); full speed {args.concurrency} connections")
    print(f"{'path':<10} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'max req/s':>10} {'non-200':>8}")
    d = fixed["direct"]
    for k in ("direct", "nginx", "headroom"):
        f, m = fixed[k], full[k]
        print(f"{k:<10} {f['p50_ms']:>8.3f} {f['p99_ms']:>8.3f} {f['p50_ms'] - d['p50_ms']:>10.3f} "
              f"{f['p99_ms'] - d['p99_ms']:>10.3f} {m['rps']:>10.0f} {f['not_ok'] + m['not_ok']:>8}")
    n, h = fixed["nginx"], fixed["headroom"]

    def ratio(key: str) -> str:
        hn, nn = h[key] - d[key], n[key] - d[key]
        # A proxy can come out faster than direct at a percentile (noise): no meaningful ratio then.
        return f"{hn / nn:.2f}x" if hn > 0 and nn > 0 else f"n/a (added {hn:+.3f} vs {nn:+.3f} ms)"

    print(f"headroom / nginx: added p50 {ratio('p50_ms')}, added p99 {ratio('p99_ms')}, "
          f"max req/s {full['headroom']['rps'] / full['nginx']['rps']:.2f}x")


if __name__ == "__main__":
    main()
