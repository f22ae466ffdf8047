#!/usr/bin/env python3
"""How many instructions does `headroom serve` spend per proxied request? The same one-lane gateway
and fast nginx upstream as bench/gateway_overhead.py, the gateway run under valgrind's callgrind.
Its counters are zeroed once the gateway has answered a warm-up, then it proxies a fixed number of
chat completions on one keep-alive connection and its counters are dumped: the instructions it ran
(all threads), divided by the requests. Unlike a latency figure this one does not move with a busy
machine, so a change of a few per cent is visible.

The whole process also runs timers and background loops whose cost follows the wall clock (and
callgrind's slowness), not the requests: it moves by a few per cent between runs of one binary. So
the figure to compare is the connection task's inclusive cost (reading the request, admission,
the upstream exchange, writing the response), read with callgrind_annotate; the whole-process
figure is printed beside it.

Given two binaries (`--before` and `--after`), each is measured `--rounds` times in turn and the
median of each is printed with the ratio after / before. Run through bench/gateway-callgrind.sh.
"""

import argparse
import http.client
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import gateway_overhead as g

ROOT = pathlib.Path(__file__).resolve().parents[1]


def post(conn: http.client.HTTPConnection) -> None:
    conn.request("POST", "/v1/chat/completions", body=g.BODY, headers={"content-type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    if r.status != 200:
        raise SystemExit(f"gateway answered {r.status}: {body[:200]!r}")


def wait_answer(port: int, seconds: float = 120) -> None:
    end = time.time() + seconds
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            post(conn)
            conn.close()
            return
        except OSError:
            if time.time() > end:
                raise SystemExit(f"the gateway on port {port} did not answer under callgrind")
            time.sleep(0.5)


def task_ir(path: pathlib.Path, pattern: str) -> int:
    """The inclusive instructions of the function `pattern` matches (the connection task), read
    with callgrind_annotate."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
                         check=True, capture_output=True, text=True).stdout
    best = 0
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+\([^)]*\)\s+\S*?:(.*?) \[", line)
        if m and re.search(pattern, m.group(2)):
            best = max(best, int(m.group(1).replace(",", "")))
    if not best:
        raise SystemExit(f"no function matching {pattern!r} in {path}")
    return best


def total_ir(path: pathlib.Path) -> int:
    """The instruction total of a callgrind dump (its `totals:` or `summary:` line)."""
    text = path.read_text(errors="replace")
    m = re.search(r"^(?:totals|summary):\s+(\d+)", text, re.M)
    if not m:
        raise SystemExit(f"no instruction total in {path}")
    return int(m.group(1))


def measure(binary: str, upstream: int, requests: int, work: pathlib.Path, pattern: str) -> tuple:
    port = g.free_port()
    conf = work / f"headroom-{port}.toml"
    conf.write_text(g.HEADROOM.format(port=port, upstream=upstream, threads=""))
    out = work / f"callgrind-{port}.out"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", binary, "serve", "--config", str(conf)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_answer(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(50):  # warm: connections, pools, first-use allocations
            post(conn)
        subprocess.run(["callgrind_control", "--zero", str(proc.pid)], check=True, capture_output=True)
        for _ in range(requests):
            post(conn)
        conn.close()
        subprocess.run(["callgrind_control", "--dump=measured", str(proc.pid)], check=True, capture_output=True)
        end = time.time() + 60
        while True:  # the dump is written as OUT.1 (a numbered part); the final OUT only at exit
            dumps = [p for p in work.glob(f"callgrind-{port}.out.*") if p.stat().st_size > 0]
            if dumps and "totals:" in dumps[0].read_text(errors="replace"):
                return total_ir(dumps[0]) / requests, task_ir(dumps[0], pattern) / requests
            if time.time() > end:
                raise SystemExit("callgrind wrote no dump")
            time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", required=True, help="the reference binary")
    ap.add_argument("--after", default=str(ROOT / "target" / "release" / "headroom"))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--task", default=r"^headroom_server::listen::connection::\{\{closure\}\}$",
                    help="regex naming the per-connection task whose inclusive cost is counted")
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_control"):
        if not shutil.which(tool):
            raise SystemExit(f"gateway-callgrind: needs {tool} (Debian package valgrind)")
    work = pathlib.Path(tempfile.mkdtemp(prefix="headroom-callgrind-"))
    os.chmod(work, 0o755)
    upstream = g.free_port()
    (work / "nginx.conf").write_text(g.NGINX.format(prefix=work, upstream=upstream, proxy=0, answer=g.ANSWER))
    nginx = subprocess.Popen([shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(work / "nginx.conf"),
                              "-p", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        figures = {"before": [], "after": []}
        for _ in range(args.rounds):
            for name in ("before", "after"):
                total, task = measure(getattr(args, name), upstream, args.requests, work, args.task)
                figures[name].append((total, task))
                print(f"{name:6}  {total:10,.0f} instructions per request in all, {task:10,.0f} in the connection task",
                      flush=True)
        print(f"\nmedian of {args.rounds} rounds, {args.requests} requests each on one connection")
        for i, what in ((1, "connection task"), (0, "whole process")):
            b = statistics.median(f[i] for f in figures["before"])
            a = statistics.median(f[i] for f in figures["after"])
            print(f"{what:16} before {b:10,.0f}  after {a:10,.0f}  after / before = {a / b:.4f} ({(a / b - 1) * 100:+.2f} %)")
        print(f"before: {args.before}\nafter:  {args.after}")
    finally:
        nginx.terminate()
        nginx.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
