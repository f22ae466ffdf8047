#!/usr/bin/env python3
"""What does a gateway add? One fast local upstream (nginx answering a fixed chat completion),
loaded with oha three ways: straight to it, through nginx as a reverse proxy (a second nginx
process with one worker, keep-alive to the upstream), and through `headroom serve` with one lane
(one worker thread, its default). At a fixed rate it reports latency p50/p99 and what each proxy
adds over the direct path; at full speed the requests per second each sustains; then the ratio
headroom / nginx. Each round measures the three paths one after another, in turn in opposite
orders (direct, nginx, headroom; then headroom, nginx, direct), so a busier moment of the box and
a drift across the run fall on the paths alike; the table shows the median over the rounds, and
the request-rate ratio is the median of the rounds' own ratios (a pair measured seconds apart,
not two medians taken at different moments). Then the targets:

  added p50   headroom <= max(1.5 x nginx's added p50, 0.060 ms)
  added p99   headroom <= 1.5 x nginx's added p99 (0.060 ms floor only when nginx's is <= 0: noise)
  max req/s   headroom >= 0.9 x nginx's

each printed with its ratio and PASS/FAIL. Run through bench/gateway-overhead.sh.
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
ANSWER = ('{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
          '"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],'
          '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')

NGINX_HEAD = """
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
"""

# The upstream: one nginx answering a fixed chat completion.
NGINX = NGINX_HEAD + """
  server {{
    listen 127.0.0.1:{upstream};
    location / {{ default_type application/json; return 200 '{answer}'; }}
  }}
}}
"""

# The reference proxy: a second nginx process, as a gateway is one in front of an engine. (Were
# it a server block of the upstream's own nginx, proxy and upstream would share one event loop
# and a proxied request would skip the wake-up of a second process that any real proxy pays.)
NGINX_PROXY = NGINX_HEAD + """
  upstream fast {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{proxy};
    location / {{ proxy_pass http://fast; proxy_http_version 1.1; proxy_set_header Connection ""; }}
  }}
}}
"""

HEADROOM = """
listen = "127.0.0.1:{port}"
{threads}
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
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=32, help="connections at full speed")
    ap.add_argument("--port-base", type=int, help="use this port and the next two (default: free ports)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of all three paths (median reported)")
    ap.add_argument("--worker-threads", type=int, help="headroom's worker_threads (default: its own)")
    args = ap.parse_args()

    prefix = tempfile.mkdtemp(prefix="headroom-overhead-")
    os.chmod(prefix, 0o755)  # nginx workers run as an unprivileged user
    if args.port_base:
        upstream, proxy, gateway = args.port_base, args.port_base + 1, args.port_base + 2
    else:
        upstream, proxy, gateway = free_port(), free_port(), free_port()
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    servers = []
    for name, text in (("upstream", NGINX), ("proxy", NGINX_PROXY)):
        d = pathlib.Path(prefix) / name
        d.mkdir()
        os.chmod(d, 0o755)
        conf = d / "nginx.conf"
        conf.write_text(text.format(prefix=d, upstream=upstream, proxy=proxy, answer=ANSWER))
        servers.append(subprocess.Popen([nginx_bin, "-c", str(conf), "-p", str(d)]))
    cfg = pathlib.Path(prefix) / "headroom.toml"
    threads = f"worker_threads = {args.worker_threads}" if args.worker_threads else ""
    cfg.write_text(HEADROOM.format(port=gateway, upstream=upstream, threads=threads))
    hr = subprocess.Popen([args.headroom, "serve", "--config", str(cfg)])
    try:
        targets = {
            "direct": f"http://127.0.0.1:{upstream}/v1/chat/completions",
            "nginx": f"http://127.0.0.1:{proxy}/v1/chat/completions",
            "headroom": f"http://127.0.0.1:{gateway}/v1/chat/completions",
        }
        for url in targets.values():
            wait_up(url)
        rounds = []
        for n in range(max(1, args.rounds)):
            order = list(targets.items()) if n % 2 == 0 else list(reversed(targets.items()))
            fixed = {k: oha(u, args.seconds, 16, args.rate) for k, u in order}
            full = {k: oha(u, args.seconds, args.concurrency, None) for k, u in order}
            rounds.append((fixed, full))
    finally:
        for p in (hr, *servers):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=20)
        shutil.rmtree(prefix, ignore_errors=True)
    report(args, rounds)


def added(fixed: dict, path: str, key: str) -> float:
    return fixed[path][key] - fixed["direct"][key]


def report(args, rounds: list) -> None:
    paths = ("direct", "nginx", "headroom")
    med = lambda xs: statistics.median(xs)
    print(f"fixed rate {args.rate}/s for {args.seconds}s (16 connections); full speed {args.concurrency} "
          f"connections; {len(rounds)} round(s), medians; load average {os.getloadavg()[0]:.2f}")
    print(f"{'path':<10} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'max req/s':>10} {'non-200':>8}")
    for k in paths:
        p50 = med([f[k]["p50_ms"] for f, _ in rounds])
        p99 = med([f[k]["p99_ms"] for f, _ in rounds])
        a50 = med([added(f, k, "p50_ms") for f, _ in rounds])
        a99 = med([added(f, k, "p99_ms") for f, _ in rounds])
        rps = med([m[k]["rps"] for _, m in rounds])
        bad = sum(f[k]["not_ok"] + m[k]["not_ok"] for f, m in rounds)
        print(f"{k:<10} {p50:>8.3f} {p99:>8.3f} {a50:>10.3f} {a99:>10.3f} {rps:>10.0f} {bad:>8}")
    if len(rounds) > 1:
        print("per round, headroom vs nginx added p50 / added p99 (ms), max req/s:")
        for n, (f, m) in enumerate(rounds, 1):
            print(f"  {n}: {added(f, 'headroom', 'p50_ms'):.3f} vs {added(f, 'nginx', 'p50_ms'):.3f} / "
                  f"{added(f, 'headroom', 'p99_ms'):.3f} vs {added(f, 'nginx', 'p99_ms'):.3f}, "
                  f"{m['headroom']['rps']:.0f} vs {m['nginx']['rps']:.0f} "
                  f"({m['headroom']['rps'] / max(m['nginx']['rps'], 1):.2f}x)")

    h50 = med([added(f, "headroom", "p50_ms") for f, _ in rounds])
    n50 = med([added(f, "nginx", "p50_ms") for f, _ in rounds])
    h99 = med([added(f, "headroom", "p99_ms") for f, _ in rounds])
    n99 = med([added(f, "nginx", "p99_ms") for f, _ in rounds])
    hr = med([m["headroom"]["rps"] for _, m in rounds])
    nr = med([m["nginx"]["rps"] for _, m in rounds])
    rps_ratio = med([m["headroom"]["rps"] / m["nginx"]["rps"] for _, m in rounds if m["nginx"]["rps"] > 0])
    floor = 0.060

    def ratio(h: float, n: float) -> str:
        # A proxy can come out faster than direct at a percentile (noise): no meaningful ratio then.
        return f"{h / n:.2f}x" if n > 0 else "n/a"

    checks = [
        ("added p50", ratio(h50, n50), h50 <= max(1.5 * n50, floor),
         f"{h50:.3f} ms <= max(1.5 x {n50:.3f}, {floor:.3f}) ms"),
        ("added p99", ratio(h99, n99), h99 <= (1.5 * n99 if n99 > 0 else floor),
         f"{h99:.3f} ms <= " + (f"1.5 x {n99:.3f} ms" if n99 > 0 else f"{floor:.3f} ms (nginx's added p99 <= 0)")),
        ("max req/s", f"{rps_ratio:.2f}x", rps_ratio >= 0.9,
         f"median of the rounds' ratios >= 0.9; medians {hr:.0f} vs {nr:.0f} req/s"),
    ]
    print("headroom / nginx:")
    for name, r, ok, why in checks:
        print(f"  {name:<10} {r:>7}  {'PASS' if ok else 'FAIL'}  ({why})")
    print("targets: " + ("all PASS" if all(ok for _, _, ok, _ in checks) else "FAIL"))

if __name__ == "__main__":
    main()
