#!/usr/bin/env python3
"""What does `headroom up` itself cost while it runs the example box, and what does `serve` cost?

Starts `headroom up` with examples/cpu-box.up.toml (the real CPU engines of scripts/backends.sh),
copied into a temporary folder with absolute paths and the ports moved to --port-base, so a fresh
calibration is measured every time. While it runs:
  bring-up   up's own CPU from its start to "box ready", per second of wall time;
  warm-up    the same over the audio backend's warm-up (from "steady at" to "resident"), while
             the pool is sampled at the box's sample_interval (25 ms: 40 Hz);
  idle       up's CPU over --idle-seconds with the box ready and no traffic, and, over the same
             window, the CPU of `headroom serve` with examples/cpu-box.toml in front of the same
             engines (the hand-written gateway; no memory probe);
  threads    up's idle CPU by thread name (the memory feed, the runtime's workers, ...).
CPU is utime + stime from /proc/PID/stat (the process's own threads, not its children), as a
percentage of one core. With --before BIN the same is measured for a second binary (main's),
alternating with the first round by round, and the table shows both and their ratio. The
machine's load average is printed at the start and the end: the figures mean little on a busy
machine, so run it on a quiet one and compare the two binaries side by side.

Usage: bench/up-cost.sh [--before BIN] [--rounds N] [--idle-seconds S] [--port-base N]
                        [--sample-interval 25ms] [--json FILE]
"""

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOX = ROOT / "examples" / "cpu-box.up.toml"
SERVE = ROOT / "examples" / "cpu-box.toml"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(path: str) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    with open(path) as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()
    # After the name: state(0) ppid(1) ... utime(11) stime(12).
    return (int(fields[11]) + int(fields[12])) / TICK


def threads(pid: int) -> dict:
    """CPU seconds per thread name (threads of one name summed)."""
    out: dict = {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + cpu_seconds(str(task / "stat"))
        except OSError:
            continue
    return out


def box_copy(folder: pathlib.Path, base: int, interval: str) -> pathlib.Path:
    """The example box with absolute paths, its ports moved to base+80/+81/+82 and the gateway to
    base+2."""
    text = BOX.read_text()
    text = text.replace('"../', f'"{ROOT}/')
    text = re.sub(r"(?m)^port = 18281$", f"port = {base + 81}", text)
    text = re.sub(r"(?m)^port = 18280$", f"port = {base + 80}", text)
    text = re.sub(r"(?m)^port = 18282$", f"port = {base + 82}", text)
    text = re.sub(r'(?m)^listen = "127\.0\.0\.1:8280"$', f'listen = "127.0.0.1:{base + 2}"', text)
    text = re.sub(r'(?m)^sample_interval = "[^"]*"$', f'sample_interval = "{interval}"', text)
    for want in (f"port = {base + 81}", f"port = {base + 82}", f"port = {base + 80}", f":{base + 2}"):
        if want not in text:
            sys.exit(f"up_cost: the example box changed shape ({want!r} not written); fix box_copy")
    path = folder / "box.up.toml"
    path.write_text(text)
    return path


def serve_copy(folder: pathlib.Path, base: int) -> pathlib.Path:
    text = SERVE.read_text()
    text = text.replace("127.0.0.1:18081", f"127.0.0.1:{base + 81}")
    text = text.replace("127.0.0.1:18080", f"127.0.0.1:{base + 80}")
    text = re.sub(r'(?m)^listen = "[^"]*"$', f'listen = "127.0.0.1:{base + 3}"', text)
    path = folder / "serve.toml"
    path.write_text(text)
    return path


def wait_http(url: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {seconds:.0f} s")


class Up:
    """`headroom up` with its progress lines watched: CPU readings at the lines that matter."""

    def __init__(self, binary: str, box: pathlib.Path, logs: pathlib.Path):
        self.proc = subprocess.Popen(
            [binary, "up", "--config", str(box), "--log-dir", str(logs)],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        self.t0 = time.monotonic()
        self.marks: dict = {}
        self.lines: list = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _mark(self, key: str) -> None:
        try:
            self.marks[key] = (time.monotonic(), cpu_seconds(f"/proc/{self.proc.pid}/stat"))
        except OSError:
            pass

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if "] steady at" in line and "warm_from" not in self.marks:
                self._mark("warm_from")
            elif "] resident" in line and "warm_to" not in self.marks:
                self._mark("warm_to")
            elif "box ready" in line:
                self._mark("ready")
                self.ready.set()
        self.ready.set()

    def rate(self, a: str, b: str) -> float:
        (ta, ca), (tb, cb) = self.marks[a], self.marks[b]
        return 100.0 * (cb - ca) / max(tb - ta, 1e-9)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def one_round(binary: str, args, work: pathlib.Path) -> dict:
    folder = pathlib.Path(tempfile.mkdtemp(dir=work))
    box = box_copy(folder, args.port_base, args.sample_interval)
    up = Up(binary, box, folder / "logs")
    serve = None
    try:
        if not up.ready.wait(timeout=600) or "ready" not in up.marks:
            tail = "\n".join(up.lines[-15:])
            raise RuntimeError(f"{binary} up did not get ready:\n{tail}")
        up.marks["start"] = (up.t0, 0.0)
        serve = subprocess.Popen(
            [binary, "serve", "--config", str(serve_copy(folder, args.port_base))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http(f"http://127.0.0.1:{args.port_base + 3}/healthz", 30)
        time.sleep(args.settle_seconds)
        stat_up, stat_serve = f"/proc/{up.proc.pid}/stat", f"/proc/{serve.pid}/stat"
        t1, u1, s1, th1 = time.monotonic(), cpu_seconds(stat_up), cpu_seconds(stat_serve), threads(up.proc.pid)
        time.sleep(args.idle_seconds)
        t2, u2, s2, th2 = time.monotonic(), cpu_seconds(stat_up), cpu_seconds(stat_serve), threads(up.proc.pid)
        wall = t2 - t1
        return {
            "binary": binary,
            "bring_up_pct": up.rate("start", "ready"),
            "warmup_pct": up.rate("warm_from", "warm_to") if "warm_to" in up.marks else None,
            "idle_up_pct": 100.0 * (u2 - u1) / wall,
            "idle_serve_pct": 100.0 * (s2 - s1) / wall,
            "idle_threads_pct": {
                name: round(100.0 * (th2.get(name, 0.0) - th1.get(name, 0.0)) / wall, 2)
                for name in sorted(th2)
                if th2.get(name, 0.0) - th1.get(name, 0.0) > 0
            },
        }
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=30)
        up.stop()


def med(rows, key):
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--after", default=str(ROOT / "target" / "release" / "headroom"))
    p.add_argument("--before", help="a second binary to compare (e.g. main's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--settle-seconds", type=float, default=3.0)
    p.add_argument("--port-base", type=int, default=int(os.environ.get("HEADROOM_COST_PORT_BASE", "19200")))
    p.add_argument("--sample-interval", default="25ms")
    p.add_argument("--json")
    args = p.parse_args()
    binaries = [("after", args.after)] + ([("before", args.before)] if args.before else [])
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}  cores: {os.cpu_count()}")
    results: dict = {label: [] for label, _ in binaries}
    with tempfile.TemporaryDirectory(prefix="up-cost-") as work:
        for r in range(args.rounds):
            order = binaries if r % 2 == 0 else list(reversed(binaries))
            for label, binary in order:
                row = one_round(binary, args, pathlib.Path(work))
                results[label].append(row)
                print(
                    f"round {r + 1} {label:6}: up bring-up {row['bring_up_pct']:5.1f} %, warm-up "
                    f"{row['warmup_pct'] or float('nan'):5.1f} %, idle {row['idle_up_pct']:5.2f} %; "
                    f"serve idle {row['idle_serve_pct']:5.2f} %; threads {row['idle_threads_pct']}",
                    flush=True,
                )
    print(f"load average at end:   {open('/proc/loadavg').read().split()[:3]}")
    print()
    print(f"own CPU, % of one core per second of wall time (median of {args.rounds} rounds; sample_interval {args.sample_interval})")
    print(f"{'':8} {'bring-up':>9} {'warm-up':>9} {'up idle':>9} {'serve idle':>11}")
    for label, _ in binaries:
        rows = results[label]
        print(
            f"{label:8} {med(rows, 'bring_up_pct'):9.2f} {med(rows, 'warmup_pct'):9.2f} "
            f"{med(rows, 'idle_up_pct'):9.2f} {med(rows, 'idle_serve_pct'):11.2f}"
        )
    if args.before:
        a, b = results["after"], results["before"]
        ratio = lambda k: med(a, k) / med(b, k) if med(b, k) else float("nan")  # noqa: E731
        print(
            f"{'after/before':8} {ratio('bring_up_pct'):9.3f} {ratio('warmup_pct'):9.3f} "
            f"{ratio('idle_up_pct'):9.3f} {ratio('idle_serve_pct'):11.3f}"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
