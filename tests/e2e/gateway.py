"""The headroom processes the end-to-end tests start: `headroom serve` on a free port with a config
the test writes, waited for on /healthz; any of them stopped with SIGTERM, then SIGKILL."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from procfs import free_port


def start_serve(bin_path: str, config):
    """`headroom serve` with `config(port)` on a free port: (process, base URL, config path)."""
    port = free_port()
    cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    cfg.write(config(port))
    cfg.close()
    proc = subprocess.Popen([bin_path, "serve", "--config", cfg.name], stdout=sys.stderr, stderr=sys.stderr)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base, cfg.name
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            os.unlink(cfg.name)
            pytest.fail("headroom serve did not come up")
        time.sleep(0.1)


def terminate(proc, timeout: float) -> None:
    """SIGTERM, then SIGKILL if the process has not ended within `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_serve(proc, cfg_path: str) -> None:
    terminate(proc, 15)
    os.unlink(cfg_path)


def read_token_events(lines, min_events: int, max_events: int, span: float = 0.25):
    """Reads a chat stream's lines until it has seen at least `min_events` content events over
    at least `span` seconds (or `max_events` of them). Returns (lines seen, event times).

    The rate is read over a span, not a count: on a loaded box an engine's output handler falls
    behind and several events arrive in one burst, which would read as thousands of tokens per
    second. The caller keeps the iterator alive; the stream stays open."""
    seen, stamps = [], []
    for line in lines:
        seen.append(line)
        if '"content":"' in line:
            stamps.append(time.monotonic())
            if len(stamps) >= min_events and (stamps[-1] - stamps[0] >= span or len(stamps) >= max_events):
                break
    return seen, stamps


def token_rate(stamps) -> float:
    """Events per second over the times read by `read_token_events`."""
    return (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-3)
