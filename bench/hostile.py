#!/usr/bin/env python3
"""Hostile-client benchmark for `headroom serve` (driven by bench/hostile.sh).

Runs one headroom binary against fake upstreams on 127.0.0.1 (asyncio, standard library only)
and hostile clients on raw sockets, with the gateway's default timeouts, and prints one line per
figure:

  slot_freed_s          a client asks for an endless stream and never reads (4 KiB receive
                        buffer): seconds until the lane's only slot is free again (lane
                        request_timeout 10 s; "never" = still held when the watch ended)
  slowloris_closed_s    200 connections sending a request head a byte a second: seconds until
                        the last one was closed by the gateway
  idle_closed_s         200 kept-alive connections idle after one request: seconds until the
                        last one was closed
  post_deliveries       one POST on a 2-replica lane whose upstreams read the request and close
                        without answering: how many times the request reached an upstream
  served_beside_hung    8 requests in a row on a 2-replica lane, one replica hung (reads and
                        never answers; request_timeout 2 s): how many were answered 200
  peak_rss_mib          20 concurrent uploads of 45 MiB (WAV) to a transcription lane: the
                        gateway's peak resident memory
  answered_at_fd_limit  gateway under `ulimit -n 1024`, 2,000 idle connections held: how many
                        of 20 new clients (health probes and chat requests, 5 s each) were
                        answered

Usage: hostile.py --headroom PATH [--watch SECONDS] [--json FILE]
"""

import argparse
import asyncio
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time


# ---------------------------------------------------------------- fake upstreams


async def read_request(reader):
    """Reads one HTTP/1.1 request (head and content-length body); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    body = b""
    remaining = length
    while remaining > 0:
        chunk = await reader.read(min(remaining, 1 << 20))
        if not chunk:
            return None
        remaining -= len(chunk)
        if len(body) < 4096:
            body += chunk[:4096]
    return method, path, body


def json_reply(obj, status="200 OK"):
    data = json.dumps(obj).encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


class Upstream:
    """One fake engine. kind: ok (answers), endless (SSE that never ends), closer (reads the
    request, closes), hung (reads the request, never answers)."""

    def __init__(self, kind):
        self.kind = kind
        self.deliveries = 0
        self.server = None
        self.port = None

    async def start(self):
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0, limit=1 << 20)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, reader, writer):
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    return
                method, path, body = req
                if path == "/health" or path == "/metrics":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    await writer.drain()
                    continue
                warm = b"warm-up" in body
                if warm and self.kind == "closer":
                    # Answered (after a moment, so warm-ups spread over the replicas): the
                    # gateway keeps the connection in its pool.
                    await asyncio.sleep(0.3)
                    writer.write(json_reply({"id": "w", "object": "chat.completion", "choices": []}))
                    await writer.drain()
                    continue
                self.deliveries += 1
                if self.kind == "closer":
                    return
                if self.kind == "hung":
                    await asyncio.sleep(3600)
                    return
                if self.kind == "endless":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                    )
                    event = b"data: " + b"x" * 65536 + b"\n\n"
                    chunk = b"%x\r\n" % len(event) + event + b"\r\n"
                    while True:
                        writer.write(chunk)
                        await writer.drain()
                if path.startswith("/v1/audio/"):
                    await asyncio.sleep(0.2)
                    writer.write(json_reply({"text": "ok"}))
                else:
                    writer.write(
                        json_reply(
                            {
                                "id": "x",
                                "object": "chat.completion",
                                "choices": [
                                    {
                                        "index": 0,
                                        "message": {"role": "assistant", "content": "ok"},
                                        "finish_reason": "stop",
                                    }
                                ],
                            }
                        )
                    )
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


# ---------------------------------------------------------------- the gateway


def lane(name, path, upstreams, **keys):
    """One [[lanes]] table: `name` serving `path` on `upstreams`, with `keys` as TOML values."""
    lines = [
        "[[lanes]]",
        f'name = "{name}"',
        f'paths = ["{path}"]',
        "upstreams = [" + ", ".join(f'"{u.url}"' for u in upstreams) + "]",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


class Gateway:
    """A `headroom serve` on a free port with these lanes (and `fd_limit` open files)."""

    def __init__(self, binary, lanes, fd_limit=None):
        toml = 'listen = "127.0.0.1:0"\n' + "".join(lanes)
        self.dir = tempfile.TemporaryDirectory(prefix="hostile-")
        path = os.path.join(self.dir.name, "serve.toml")
        with open(path, "w") as f:
            f.write(toml)
        if fd_limit:
            cmd = ["sh", "-c", f'ulimit -n {fd_limit} && exec "$0" serve --config "$1"', binary, path]
        else:
            cmd = [binary, "serve", "--config", path]
        self.stderr_path = os.path.join(self.dir.name, "stderr")
        self.stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr)
        line = self.proc.stdout.readline().decode().strip()
        if not line.startswith("listening on "):
            raise SystemExit(f"gateway did not start: {line!r}; {self.log()}")
        host, port = line.removeprefix("listening on ").rsplit(":", 1)
        self.addr = (host, int(port))
        self.base = f"http://{host}:{port}"

    def rss(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def fds(self):
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        except OSError:
            return 0

    def log(self):
        self.stderr.flush()
        with open(self.stderr_path) as f:
            return f.read()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


async def http(addr, method, path, body=b"", headers=(), timeout=5.0):
    """One request on a new connection; (status, body) or (None, error)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*addr), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return None, repr(e)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        for k, v in headers:
            head += f"{k}: {v}\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
        return status, data.split(b"\r\n\r\n", 1)[-1]
    except (OSError, asyncio.TimeoutError, ValueError, IndexError) as e:
        return None, repr(e)
    finally:
        writer.close()


CHAT = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
CHAT_PLAIN = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
JSON_CT = [("Content-Type", "application/json")]


async def lane_inflight(gw, lane):
    status, body = await http(gw.addr, "GET", "/admin/lanes")
    if status != 200:
        return None
    for l in json.loads(body)["lanes"]:
        if l["name"] == lane:
            return l["inflight"]
    return None


# ---------------------------------------------------------------- scenarios


async def timeouts(binary, watch):
    """Never-reading client, slowloris and idle connections, watched together."""
    endless = await Upstream("endless").start()
    ok = await Upstream("ok").start()
    gw = Gateway(
        binary,
        [lane("stream", "/v1/chat/completions", [endless], max_inflight=1, request_timeout="10s"), lane("plain", "/v1/completions", [ok], max_inflight=64)],
    )
    start = time.monotonic()
    # The never-reading client.
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(gw.addr)
    stalled.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(CHAT)}\r\n\r\n".encode()
        + CHAT
    )
    # Slowloris: a head a byte a second.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\n" + b"X-Pad: " + b"a" * 200
    closed = {"slowloris": [], "idle": []}

    async def slowloris():
        try:
            reader, writer = await asyncio.open_connection(*gw.addr)
        except OSError:
            return
        t0 = time.monotonic()
        for i in range(len(head)):
            if time.monotonic() - start > watch:
                writer.close()
                return
            try:
                writer.write(head[i : i + 1])
                await writer.drain()
                data = await asyncio.wait_for(reader.read(1), 1.0)
                if data == b"":
                    break
            except asyncio.TimeoutError:
                pass
            except OSError:
                break
        else:
            writer.close()
            return
        closed["slowloris"].append(time.monotonic() - t0)
        writer.close()

    async def idle():
        try:
            reader, writer = await asyncio.open_connection(*gw.addr)
        except OSError:
            return
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(CHAT_PLAIN)}\r\n\r\n".encode()
            + CHAT_PLAIN
        )
        await writer.drain()
        got = b""
        while b"\r\n\r\n" not in got:
            more = await reader.read(4096)
            if not more:
                return
            got += more
        t0 = time.monotonic()
        try:
            left = watch - (t0 - start)
            while left > 0:
                data = await asyncio.wait_for(reader.read(4096), left)
                if data == b"":
                    closed["idle"].append(time.monotonic() - t0)
                    break
                left = watch - (time.monotonic() - start)
        except (asyncio.TimeoutError, OSError):
            pass
        writer.close()

    async def slot():
        await asyncio.sleep(1.0)
        while time.monotonic() - start < watch:
            if await lane_inflight(gw, "stream") == 0:
                return time.monotonic() - start
            await asyncio.sleep(0.25)
        return None

    n = 200
    results = await asyncio.gather(slot(), *[slowloris() for _ in range(n)], *[idle() for _ in range(n)])
    freed = results[0]
    stalled.close()
    gw.stop()
    endless.server.close()
    ok.server.close()

    def last(times):
        if len(times) < n:
            return f"never ({n - len(times)} of {n} open at {watch:.0f} s)"
        return f"{max(times):.1f}"

    return {
        "slot_freed_s": f"{freed:.1f}" if freed is not None else f"never (held at {watch:.0f} s)",
        "slowloris_closed_s": last(closed["slowloris"]),
        "idle_closed_s": last(closed["idle"]),
    }


async def post_deliveries(binary):
    a, b = await Upstream("closer").start(), await Upstream("closer").start()
    gw = Gateway(
        binary,
        [lane("text", "/v1/chat/completions", [a, b], max_inflight=4)],
    )
    # Warm-ups the upstreams answer leave a kept-alive connection to each in the gateway's pool.
    warm = json.dumps({"model": "m", "messages": [{"role": "user", "content": "warm-up"}]}).encode()
    await asyncio.gather(
        *[http(gw.addr, "POST", "/v1/chat/completions", warm, JSON_CT, timeout=20) for _ in range(4)]
    )
    status, _ = await http(gw.addr, "POST", "/v1/chat/completions", CHAT_PLAIN, JSON_CT, timeout=20)
    await asyncio.sleep(0.5)
    gw.stop()
    return {
        "post_deliveries": f"{a.deliveries + b.deliveries} (A {a.deliveries}, B {b.deliveries}; answered {status})"
    }


async def hung_replica(binary, n=8):
    hung, ok = await Upstream("hung").start(), await Upstream("ok").start()
    gw = Gateway(
        binary,
        [lane("text", "/v1/chat/completions", [hung, ok], max_inflight=4, request_timeout="2s")],
    )
    served = 0
    for _ in range(n):
        status, _ = await http(gw.addr, "POST", "/v1/chat/completions", CHAT_PLAIN, JSON_CT, timeout=10)
        served += status == 200
    gw.stop()
    return {"served_beside_hung": f"{served} of {n}"}


def wav(seconds, rate=8000):
    frames = int(seconds * rate)
    data = bytes(frames * 2)
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack(
        "<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16
    ) + b"data" + struct.pack("<I", len(data))
    return header + data


async def upload_rss(binary, n=20):
    ok = await Upstream("ok").start()
    gw = Gateway(
        binary,
        [lane("audio", "/v1/audio/transcriptions", [ok], max_body_bytes="48MiB", max_inflight=1, max_queue=32, policy="queue", queue_timeout="120s", request_timeout="120s")],
    )
    boundary = "hostilebenchboundary"
    audio = wav(45 * 1048576 / 16000)
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
        "Content-Type: audio/wav\r\n\r\n"
    ).encode() + audio + f"\r\n--{boundary}--\r\n".encode()
    ct = [("Content-Type", f"multipart/form-data; boundary={boundary}")]
    before = gw.rss()
    peak = before
    done = False

    async def sample():
        nonlocal peak
        while not done:
            peak = max(peak, gw.rss())
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    results = await asyncio.gather(
        *[http(gw.addr, "POST", "/v1/audio/transcriptions", body, ct, timeout=180) for _ in range(n)]
    )
    done = True
    await sampler
    gw.stop()
    statuses = {}
    for status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    return {
        "peak_rss_mib": f"{peak / 1048576:.0f} (from {before / 1048576:.0f}; statuses {statuses})"
    }


async def at_fd_limit(binary, held_n=2000, new=20):
    ok = await Upstream("ok").start()
    gw = Gateway(
        binary,
        [lane("text", "/v1/chat/completions", [ok], max_inflight=16)],
        fd_limit=1024,
    )
    held = []

    async def hold():
        try:
            held.append(await asyncio.wait_for(asyncio.open_connection(*gw.addr), 5))
        except (OSError, asyncio.TimeoutError):
            pass

    await asyncio.gather(*[hold() for _ in range(held_n)])
    # Until the gateway has taken what it will take (its descriptor count stops growing).
    last, steady, until = -1, 0, time.monotonic() + 15
    while steady < 4 and time.monotonic() < until:
        await asyncio.sleep(0.25)
        now = gw.fds()
        steady = steady + 1 if now == last else 0
        last = now
    t0 = time.monotonic()
    failures = []

    async def one(i):
        if i % 2 == 0:
            status, _ = await http(gw.addr, "GET", "/healthz")
        else:
            status, _ = await http(gw.addr, "POST", "/v1/chat/completions", CHAT_PLAIN, JSON_CT)
        if status is None:
            failures.append((i, status, _))
        return status is not None

    answered = sum(await asyncio.gather(*[one(i) for i in range(new)]))
    took = time.monotonic() - t0
    for f in failures[:3]:
        print(f"#   new client {f[0]}: {f[1]} {f[2][:200]!r}", file=sys.stderr)
    for _, w in held:
        w.close()
    log = gw.log()
    gw.stop()
    said = sum(1 for l in log.splitlines() if "accept failed" in l or "open-file limit" in l)
    return {
        "answered_at_fd_limit": f"{answered} of {new} (in {took:.1f} s; {len(held)} held connections established, the gateway at {last} descriptors; {said} stderr line(s) about it)"
    }


async def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headroom", required=True)
    p.add_argument("--watch", type=float, default=90.0)
    p.add_argument("--json")
    p.add_argument("--only", help="run only the scenarios whose name contains this")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    figures = {}
    for name, run in [
        ("fd limit", lambda: at_fd_limit(args.headroom)),
        ("post deliveries", lambda: post_deliveries(args.headroom)),
        ("hung replica", lambda: hung_replica(args.headroom)),
        ("uploads", lambda: upload_rss(args.headroom)),
        ("timeouts", lambda: timeouts(args.headroom, args.watch)),
    ]:
        if args.only and args.only not in name:
            continue
        print(f"# {name} ...", file=sys.stderr, flush=True)
        got = await run()
        for k, v in got.items():
            print(f"{k:22} {v}", flush=True)
        figures.update(got)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
