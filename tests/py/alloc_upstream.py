"""A fake audio upstream for memory-admission tests: every POST to /v1/audio/transcriptions
really allocates (and touches) N MiB of host memory for T ms, frees it, then answers. It keeps
the largest sum of memory it ever held for jobs at once, so a test can check that the gateway
never let more in than the pool has room for.

Usage: python3 alloc_upstream.py --mib 300 --hold-ms 1000 [--alloc-delay-ms 300]
(prints "port N" once listening). --alloc-delay-ms waits before allocating, the way an engine
decodes and preprocesses before its memory grows: the window in which a reading cannot show a job
that was just admitted.
GET /stats -> {"max_concurrent_bytes", "current_bytes", "jobs", "max_concurrent_jobs"};
POST /reset clears the maxima; GET /health -> {"status": "ok"}.
A request header x-alloc-mib overrides --mib for that job.
"""

import argparse
import ctypes
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MIB = 1 << 20
lock = threading.Lock()
state = {"current_bytes": 0, "max_concurrent_bytes": 0, "jobs": 0, "current_jobs": 0,
         "max_concurrent_jobs": 0}


class Handler(BaseHTTPRequestHandler):
    # One write per response and no Nagle delay: latency tests measure the gateway, not this.
    disable_nagle_algorithm = True
    wbufsize = -1

    def log_message(self, *args):
        pass

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.answer(200, {"status": "ok"})
        elif self.path == "/stats":
            with lock:
                self.answer(200, dict(state))
        else:
            self.answer(404, {"error": "no such route"})

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        if self.path == "/reset":
            with lock:
                state["max_concurrent_bytes"] = state["current_bytes"]
                state["max_concurrent_jobs"] = state["current_jobs"]
                state["jobs"] = 0
            self.answer(200, {})
            return
        if not self.path.startswith("/v1/audio/"):
            self.answer(404, {"error": "no such route"})
            return
        size = int(float(self.headers.get("x-alloc-mib") or ARGS.mib) * MIB)
        time.sleep(ARGS.alloc_delay_ms / 1000.0)
        with lock:
            state["current_bytes"] += size
            state["current_jobs"] += 1
            state["jobs"] += 1
            state["max_concurrent_bytes"] = max(state["max_concurrent_bytes"],
                                                state["current_bytes"])
            state["max_concurrent_jobs"] = max(state["max_concurrent_jobs"],
                                               state["current_jobs"])
        try:
            # Fill (touch) every page, so the memory is really resident; ctypes drops the GIL
            # for the memset, so concurrent jobs allocate at the same time.
            block = bytearray(size)
            ctypes.memset((ctypes.c_char * size).from_buffer(block), 1, size)
            time.sleep(ARGS.hold_ms / 1000.0)
            del block
        finally:
            with lock:
                state["current_bytes"] -= size
                state["current_jobs"] -= 1
        self.answer(200, {"text": "ok"})


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=300)
    parser.add_argument("--hold-ms", type=int, default=1000)
    parser.add_argument("--alloc-delay-ms", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    ARGS = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler)
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
