"""End to end: `headroom up` with examples/cpu-box.up.toml, started again and again from the figures
it keeps (its calibration file), on the real faster-whisper-server and llama.cpp from
scripts/backends.sh. A box that serves its first start must serve every later one the same way.

One measured start, then three starts in a row from the kept figures (warm-up skipped); after each
start 10 transcriptions and 10 chats through the gateway, every one of which must succeed. Also
checked at each start, against the first start's figures read from /admin/lanes and the kept file:
  - the whisper lane's measured per-job need (the one `up` hands `serve`) stays within 10 % of the
    first start's (a need is what a job adds above the level the backend keeps between jobs,
    whatever the source of the figures: counting the kept level twice would add 100 MiB and more);
  - the need in force is the one `serve` learned from the previous start's real jobs where the
    calibration file keeps one (it moves between starts with the peaks caught: 51.5 and 69 MiB
    seen; a warm-up that caught Whisper before it kept all of its first job's memory measured
    72.6 MiB where real jobs showed 51.5 MiB), else the measured one, and always below the first
    start's peak less the level before any job (the need that counts the kept level twice);
  - the kept whisper figures are not replaced by figures measured another way (a start that skips
    the warm-up has no after-warm-up level to keep).

Run by scripts/test.sh (and so .ci/run) with the other e2e tests.
"""

import json
import time

import httpx
import pytest

from test_up import FOX, MIB, Box, backend, require_backends

STARTS = 4  # the measured one, then three from kept figures
JOBS = 10


def lane(base: str, name: str) -> dict:
    lanes = httpx.get(f"{base}/admin/lanes", timeout=5).json()["lanes"]
    return next(l for l in lanes if l["name"] == name)


def transcribe(base: str) -> httpx.Response:
    with open(FOX, "rb") as f:
        return httpx.post(f"{base}/v1/audio/transcriptions", files={"file": ("fox.wav", f, "audio/wav")},
                          data={"model": "whisper-1"}, timeout=60)


def chat(base: str) -> httpx.Response:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def held(box: Box) -> str:
    """For a failure's message: the pool's free figure over the next 2 s, then each backend's
    memory beside its kept figures (MiB): a refusal that a moment's reading caused shows as free
    memory coming back."""
    frees = []
    for _ in range(5):
        pool = (httpx.get(f"{box.base}/admin/lanes", timeout=5).json().get("memory") or [{}])[0]
        frees.append(f"{(pool.get('free_bytes') or 0) / MIB:.1f}")
        time.sleep(0.5)
    return f"free over 2 s: {', '.join(frees)} MiB; " + "; ".join(
        f"{b['name']} now {b['current_bytes'] / MIB:.1f} resident {b['resident_bytes'] / MIB:.1f} "
        f"peak {b['peak_bytes'] / MIB:.1f}" for b in box.report()["backends"])


def serve_every_request(box: Box, start: int) -> list:
    """10 transcriptions, then 10 chats; fails at the first that does not succeed."""
    took = []
    for i in range(JOBS):
        t0 = time.time()
        r = transcribe(box.base)
        took.append(time.time() - t0)
        assert r.status_code == 200, (
            f"start {start}, transcription {i + 1}/{JOBS}: {r.status_code} after {took[-1]:.1f} s: {r.text[:400]}\n"
            f"whisper lane: {json.dumps(lane(box.base, 'whisper').get('memory'))}\n"
            f"backends now: {held(box)}")
        assert "lazy dog" in r.json()["text"].lower(), r.text
    for i in range(JOBS):
        t0 = time.time()
        r = chat(box.base)
        assert r.status_code == 200, (
            f"start {start}, chat {i + 1}/{JOBS}: {r.status_code} after {time.time() - t0:.1f} s: {r.text[:400]}")
        assert r.json()["choices"][0]["message"]["content"] is not None
    return took


def test_three_starts_from_kept_figures_serve_every_request(tmp_path):
    require_backends()
    box = Box(tmp_path, "1GiB", name="restarts")
    calib = box.path.with_name("restarts.up.calibration.json")
    first_need, first_configured, first_kept = None, None, None
    for start in range(STARTS):
        box.start(*(["--recalibrate"] if start == 0 else []), "--log-dir", str(tmp_path / f"logs{start}"))
        try:
            box.wait_ready()
            memory = lane(box.base, "whisper")["memory"]
            need, configured = memory["bytes_per_job"], memory["configured_bytes_per_job"]
            figures = json.loads(calib.read_text())
            kept, learned = figures["backends"]["whisper"], figures.get("learned", {}).get("whisper")
            if start == 0:
                first_need, first_configured, first_kept = need, configured, kept
            else:
                assert "warm-up skipped" in box.stderr_text(), box.stderr_text()
            try:
                took = serve_every_request(box, start)
            except BaseException:
                print(f"headroom up's output (start {start}):\n{box.stderr_text()}")
                raise
            print(f"start {start}: whisper need {need / MIB:.1f} MiB (first {first_need / MIB:.1f}; measured "
                  f"{configured / MIB:.1f}, learned {learned['bytes_per_job'] / MIB if learned else 0:.1f}); kept resident "
                  f"{kept['resident_bytes'] / MIB:.1f} MiB peak {kept['peak_bytes'] / MIB:.1f} MiB; transcriptions "
                  f"{min(took):.2f}-{max(took):.2f} s")
            assert abs(configured - first_configured) <= 0.10 * first_configured, (start, configured, first_configured)
            if start > 0 and learned is not None and memory["learn"]:
                assert memory["learned"] is not None, memory
                assert memory["learned"]["bytes_per_job"] == learned["bytes_per_job"], (memory, learned)
                assert need == learned["bytes_per_job"], (start, need, learned)
            else:
                assert need == configured, (start, memory)
            double = first_kept["peak_bytes"] - first_kept["idle_bytes"]
            assert need < double, (start, need, double)
            # Kept figures are only replaced by figures measured the same way (a warm-up).
            assert kept["resident_bytes"] == first_kept["resident_bytes"], (kept, first_kept)
            assert kept["peak_bytes"] == first_kept["peak_bytes"], (kept, first_kept)
        finally:
            box.stop()
        assert box.proc.returncode == 0, box.stderr_text()
