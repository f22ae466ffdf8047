"""End to end through `headroom serve` with `engine = "vllm"` in front of a real vLLM on this CPU.

Needs `scripts/backends.sh install vllm` and `start vllm` first (scripts/test.sh does both, once
for the whole session: vLLM takes minutes to start). The server's own settings are read from
.backends/run/vllm.env, which `start vllm` writes; it runs with `--max-num-seqs 1`, so a second
request waits inside vLLM. The gateway is started here, once, with a text lane that holds
admission while vLLM's own queue is longer than `engine_max_waiting = 0`.
"""

import json
import math
import os
import pathlib
import subprocess
import threading
import time

import httpx
import openai
import pytest
from gateway import read_token_events, start_serve, stop_serve, token_rate

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("HEADROOM_BIN", str(ROOT / "target" / "debug" / "headroom"))
ENV_FILE = pathlib.Path(os.environ.get("HEADROOM_VLLM_ENV", ROOT / ".backends" / "run" / "vllm.env"))
GIB = 1024**3


def read_env() -> dict:
    if not ENV_FILE.is_file():
        pytest.fail(f"{ENV_FILE} is missing: run scripts/backends.sh install vllm && scripts/backends.sh start vllm")
    pairs = (line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


@pytest.fixture(scope="session")
def vllm() -> dict:
    env = read_env()
    url = env["HEADROOM_VLLM_URL"]
    try:
        httpx.get(f"{url}/health", timeout=10).raise_for_status()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"vLLM at {url} is not up ({e}); run scripts/backends.sh start vllm")
    assert env["HEADROOM_VLLM_MAX_NUM_SEQS"] == "1", "these tests need a vLLM started with --max-num-seqs 1"
    return env


def gateway_config(port: int, upstream: str) -> str:
    return f"""
listen = "127.0.0.1:{port}"
scrape_interval = "200ms"

[[lanes]]
name = "text"
paths = ["/v1/chat/completions", "/v1/completions"]
upstreams = ["{upstream}"]
# More than vLLM runs at once (--max-num-seqs 1): the engine's own queue is what holds requests.
max_inflight = 3
max_queue = 4
queue_timeout = "120s"
request_timeout = "180s"
policy = "queue"
engine = "vllm"
engine_max_waiting = 0
engine_metrics_stale_after = "15s"
"""


@pytest.fixture(scope="session")
def gateway(vllm):
    # HEADROOM_E2E_VLLM_GATEWAY points the tests at another front (a plain reverse proxy, say) to
    # show what they catch.
    external = os.environ.get("HEADROOM_E2E_VLLM_GATEWAY")
    if external:
        yield external.rstrip("/")
        return
    proc, base, cfg = start_serve(BIN, lambda port: gateway_config(port, vllm["HEADROOM_VLLM_URL"]))
    yield base
    stop_serve(proc, cfg)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-loopback", max_retries=0, timeout=180)


def vllm_gauges(vllm) -> dict:
    """vLLM's own running / waiting / KV-usage gauges and its count of finished requests,
    straight from its /metrics."""
    text = httpx.get(f"{vllm['HEADROOM_VLLM_URL']}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                    "vllm:request_success_total"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def text_lane(base: str) -> dict:
    lanes = httpx.get(f"{base}/admin/lanes", timeout=10).json()["lanes"]
    return next(lane for lane in lanes if lane["name"] == "text")


def wait_for(what: str, pred, within: float, every: float = 0.05, detail=None, lost=None):
    """Polls `pred` until it is true; on a timeout fails, with `detail()` (the state that was
    seen) when given, or raises `SetupLost` when `lost()` says the precondition went away. A wait
    longer than a second is printed (pytest shows it with a failure), and so is the slowest poll:
    a gateway starved of the CPU answers late, and then few polls happen in the whole wait."""
    start = time.monotonic()
    deadline = start + within
    polls, slowest = 0, 0.0
    while True:
        before = time.monotonic()
        value = pred()
        polls, slowest = polls + 1, max(slowest, time.monotonic() - before)
        if value:
            if time.monotonic() - start > 1:
                print(f"{what}: seen after {time.monotonic() - start:.1f} s "
                      f"({polls} polls, the slowest {slowest:.2f} s)")
            return value
        if time.monotonic() > deadline:
            state = f"; {detail()}" if detail else ""
            seen = f" ({polls} polls, the slowest {slowest:.2f} s{state})"
            if lost and lost():
                raise SetupLost(f"{what} not seen within {within} s, and the setup was lost{seen}")
            pytest.fail(f"{what} not seen within {within} s{seen}")
        time.sleep(every)


def long_generation(max_tokens: int) -> dict:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
        "max_tokens": max_tokens,
        # vLLM's own sampling fields: generate exactly max_tokens, so the request surely runs on.
        "ignore_eos": True,
        "min_tokens": max_tokens,
        "temperature": 0,
    }


def test_openai_client_streams_a_chat_completion_from_vllm(gateway):
    stream = client(gateway).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks, text, finish, usage = 0, "", None, None
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert chunks >= 3
    assert text.strip()
    assert finish in ("stop", "length")
    assert usage is not None and 0 < usage.completion_tokens <= 24 and usage.prompt_tokens > 0


def test_the_raw_vllm_stream_ends_with_usage_then_done(gateway):
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Say yes."}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] > 0 and chunks[-1]["choices"] == []


# The gateway's gauges of what it read from an engine (beside them it also publishes the time of
# the last good scrape, which says nothing about the names it reads).
LOAD_GAUGES = {
    "headroom_upstream_requests_waiting",
    "headroom_upstream_requests_running",
    "headroom_upstream_kv_cache_usage",
}


def test_the_gateway_reads_the_metric_names_this_vllm_exposes(vllm, gateway):
    text = httpx.get(f"{vllm['HEADROOM_VLLM_URL']}/metrics", timeout=10).text
    live = sorted({line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
                   if line.startswith("vllm:")})
    print("vLLM exposes:", " ".join(n for n in live if not n.endswith(("_bucket", "_created", "_sum", "_count")))) 
    # The gateway publishes what it read from each upstream; a gauge exists only once its vLLM
    # metric was found under the name the gateway looks for.
    upstream = vllm["HEADROOM_VLLM_URL"]

    def gateway_gauges():
        mine = {}
        for line in httpx.get(f"{gateway}/metrics", timeout=10).text.splitlines():
            if line.startswith("headroom_upstream_") and f'upstream="{upstream}"' in line:
                mine[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
        load = {k: v for k, v in mine.items() if k in LOAD_GAUGES}
        return load if len(load) == 3 else None

    mine = wait_for("the gateway's three vLLM gauges", gateway_gauges, 10)
    assert set(mine) == LOAD_GAUGES
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert name in live, f"{name} not exposed by this vLLM: {live}"
    # This vLLM has only the current KV name; the older one is a fallback the gateway keeps.
    assert "vllm:gpu_cache_usage_perc" not in live
    snap = text_lane(gateway)["upstreams"][0]
    assert snap["metrics_age_seconds"] is not None and snap["metrics_age_seconds"] < 5


def vllm_rate(url: str) -> float:
    """vLLM's generation rate through `url`, in tokens per second, from one timed request."""
    t0 = time.monotonic()
    r = httpx.post(url, json=long_generation(32), timeout=180)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"] / max(elapsed, 1e-3)


def tokens_for(rate: float, seconds: float, lo: int, hi: int) -> int:
    n = max(lo, min(hi, math.ceil(rate * seconds)))
    print(f"vLLM generates {rate:.0f} tokens/s: the first request asks for {n} tokens")
    return n


class SetupLost(Exception):
    """The scenario's precondition went away before its assertion could be made (not a verdict
    on the gateway): the long first request ended before the hold was set up."""


def test_engine_load_follows_vllm_and_holds_admission_while_vllm_queues(vllm, gateway):
    url = f"{gateway}/v1/chat/completions"
    # The first request must outlast the waits that set the hold up (each follows a 200 ms scrape,
    # and each read of vLLM's /metrics took up to 1.2 s on a busy box). 200 tokens ended before the
    # hold was seen on a fast CI machine, and so did 150 tokens chosen from a measured 15 tokens/s
    # (CI22): one timed request undercounts the rate (prefill, a cold path), so the faster of two is
    # taken, and the first request asks for about 30 s of tokens: at least 150, and at most 440
    # (prompt, chat template and 440 fit the 512-token context). A box at 8 tokens/s then holds the
    # third about 33 s, well inside the gateway's 120 s queue.
    rate = max(vllm_rate(url), vllm_rate(url))
    first_tokens = tokens_for(rate, seconds=30, lo=150, hi=440)
    # The 512-token context caps the first at about 26 s on a fast box. If it still ended before the
    # third request was sent (CI23 saw the third go straight through, the cause not recorded), the
    # setup is retried once: a gateway that lets the third go while vLLM queues fails either way,
    # as vLLM then has finished nothing when the third is not held.
    for attempt in (1, 2):
        try:
            return hold_scenario(vllm, gateway, url, first_tokens)
        except SetupLost as lost:
            print(f"attempt {attempt}: {lost}")
    pytest.fail("the first request ended before the hold could be set up, twice")


def hold_scenario(vllm, gateway, url: str, first_tokens: int):
    results: dict = {}

    def send(name: str, max_tokens: int) -> threading.Thread:
        def run():
            r = httpx.post(url, json=long_generation(max_tokens), timeout=180)
            results[name] = (r.status_code, r.json())

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def state() -> str:
        return f"gateway lane {text_lane(gateway)}; vLLM {vllm_gauges(vllm)}; answers {results}"

    # The gateway's reading of vLLM lags by a scrape: it still said running 1 for 0.1-0.2 s after
    # the timed requests had ended (more on a loaded box). Taken for the first request, that stale
    # 1 let the second go before the first reached vLLM (CI, stop 22): the short second ran first,
    # so vLLM's queue held the long first for a second or two, and then nothing waited. So wait
    # until the gateway reads vLLM idle, and then for the first to be in flight and running. An
    # attempt after a lost one so also waits for what the lost one sent to be answered.
    def idle() -> bool:
        lane = text_lane(gateway)
        u = lane["upstreams"][0]
        return lane["inflight"] == 0 and lane["queued"] == 0 and u["running"] == 0 and not u["waiting"]

    wait_for("the gateway idle, and reading vLLM idle, after the requests before", idle, 60, detail=state)
    finished_at_start = vllm_gauges(vllm)["vllm:request_success_total"]

    def first_ended() -> bool:
        # Nothing else can finish first: the second waits behind the first in vLLM.
        return "first" in results or vllm_gauges(vllm)["vllm:request_success_total"] > finished_at_start

    began = time.monotonic()
    first = send("first", first_tokens)
    wait_for("vLLM running the first request, as the gateway reads it",
             lambda: (lane := text_lane(gateway))["inflight"] >= 1 and (lane["upstreams"][0]["running"] or 0) >= 1,
             60, detail=state, lost=first_ended)
    second = send("second", 24)
    up = wait_for("vLLM's waiting ≥ 1, as the gateway reads it",
                  lambda: (u := text_lane(gateway)["upstreams"][0])["waiting"] and u["waiting"] >= 1 and u, 30,
                  detail=state, lost=first_ended)
    assert up["running"] == 1, up
    # engine_max_waiting = 0: the third is held in the gateway's queue while vLLM has a queue. It
    # goes at once: every wait in between eats into the first request's run.
    third = send("third", 24)
    held = wait_for("the gateway queueing the third request", lambda: text_lane(gateway)["queued"] >= 1, 10,
                    detail=state, lost=first_ended)
    assert held
    print(f"the hold set up {time.monotonic() - began:.1f} s after the first request was sent")
    # The checks below read while the hold lasts, with no wait of their own: CI24's box stalled
    # the test for 13 s or more inside one poll (a 10 s wait for the KV figure returned after
    # 22.9 s), and by then the first request had ended and vLLM's KV gauge was back at 0.
    # Each sample: gateway queued, gateway inflight, vLLM waiting, and the KV-cache usage as the
    # gateway reads it and as vLLM reports it.
    samples, ended = [], None
    while len(samples) < 10:
        if "first" in results:
            ended = f"the first request's answer arrived: {results['first'][0]}"
            break
        lane, own = text_lane(gateway), vllm_gauges(vllm)
        if lane["queued"] < 1 or lane["inflight"] < 2 or own["vllm:num_requests_waiting"] < 1:
            # The hold is over only once the first request has ended in vLLM (its client may not
            # have read the last bytes yet): the second runs, vLLM's queue empties, the gateway
            # lets the third go, and vLLM may queue it, all between two samples on a loaded box.
            # vLLM's own count of finished requests since the first was sent tells that end from a
            # gateway that let the third go while vLLM still had the second waiting.
            ended = (f"gateway inflight {lane['inflight']}, queued {lane['queued']}; vLLM waiting "
                     f"{own['vllm:num_requests_waiting']}, running {own['vllm:num_requests_running']}, "
                     f"finished {own['vllm:request_success_total'] - finished_at_start:.0f} since the first was sent")
            assert own["vllm:request_success_total"] > finished_at_start, f"the hold ended early: {ended}"
            break
        samples.append((lane["queued"], lane["inflight"], own["vllm:num_requests_waiting"],
                        lane["upstreams"][0]["kv_cache_usage"], own["vllm:kv_cache_usage_perc"]))
        time.sleep(0.1)
    print("held while the first ran (gateway queued, gateway inflight, vLLM waiting, KV gateway, "
          "KV vLLM):", samples[:5], "…")
    if not samples:
        # The first request ended (its answer arrived, or vLLM finished it) before one sample.
        raise SetupLost(f"the first request ended before the hold could be sampled ({ended})")
    assert all(q == 1 and i == 2 and w == 1 for q, i, w, _, _ in samples), samples
    # The running sequence holds KV blocks: the gateway's figure follows vLLM's above zero.
    assert any(g is not None and 0 < g < 0.5 and v > 0 for _, _, _, g, v in samples), samples
    for t in (first, second, third):
        t.join(timeout=180)
    for name in ("first", "second", "third"):
        status, body = results[name]
        assert status == 200, (name, body)
        assert body["choices"][0]["message"]["content"]
    assert results["first"][1]["usage"]["completion_tokens"] == first_tokens
    snap = text_lane(gateway)
    assert snap["queued"] == 0 and snap["inflight"] == 0


def test_a_client_that_leaves_mid_stream_ends_the_vllm_request(vllm, gateway):
    body = dict(long_generation(400), stream=True)
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", f"{gateway}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            stream = r.iter_lines()
            # Over at least 0.25 s of events (a measurement; the assertion below is unchanged).
            seen, stamps = read_token_events(stream, 6, 40)
            running = vllm_gauges(vllm)["vllm:num_requests_running"]
            assert running == 1, f"the generation should be running in vLLM: {running}, {seen}"
        # Leaving the block closes the connection mid-stream.
    left = time.monotonic()
    # Not stopped, vLLM would generate the rest of the 400 tokens at the rate just seen: the
    # running count must drop long before that (a small part of it, at most 5 s: a loaded 2-core
    # box stalls for a second or more).
    rate = token_rate(stamps)
    rest = (400 - len(stamps)) / rate
    limit = min(5.0, rest / 4)
    assert limit >= 1.0, f"generation too fast ({rate:.0f} tokens/s) to tell an abort from the end"
    while True:
        running = vllm_gauges(vllm)["vllm:num_requests_running"]
        if running == 0:
            break
        waited = time.monotonic() - left
        assert waited < limit, (f"vLLM still runs the request {waited:.1f} s after the client left "
                                f"(the rest takes about {rest:.0f} s at {rate:.0f} tokens/s)")
        time.sleep(0.05)
    print(f"vLLM's running count back to 0 {time.monotonic() - left:.2f} s after the client left "
          f"(the rest would have taken about {rest:.0f} s at {rate:.0f} tokens/s)")


def test_a_too_long_prompt_gets_vllms_400_in_openai_shape(vllm, gateway):
    limit = int(vllm["HEADROOM_VLLM_MAX_MODEL_LEN"])
    words = "lighthouse " * (limit + 50)
    messages = [{"role": "user", "content": words}]
    r = httpx.post(f"{gateway}/v1/chat/completions",
                   json={"model": "smollm2", "messages": messages, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    # vLLM's own wording, with its limit, reaches the client; its numeric code becomes a string.
    assert f"maximum context length is {limit} tokens" in err["message"], err
    assert isinstance(err["code"], str)
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway).chat.completions.create(model="smollm2", messages=messages, max_tokens=4)
    assert f"maximum context length is {limit} tokens" in str(caught.value)


def test_doctor_reports_the_kv_cache_vllm_logged_and_it_matches_the_configuration(vllm):
    log = vllm["HEADROOM_VLLM_LOG"]
    out = subprocess.run([BIN, "doctor", log, "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["findings"] == [], doc["findings"]
    startup = doc["startup"]
    configured_gib = float(vllm["HEADROOM_VLLM_KV_GIB"])
    configured_len = int(vllm["HEADROOM_VLLM_MAX_MODEL_LEN"])
    assert startup["kv_cache_gib"] == pytest.approx(configured_gib)
    assert startup["max_model_len"] == configured_len
    # Tokens that fit the configured space, from the model's own shape: K and V for every layer,
    # float32. vLLM rounds down to whole blocks.
    cfg = json.loads((pathlib.Path(vllm["HEADROOM_VLLM_MODEL_DIR"]) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    fits = configured_gib * GIB / per_token
    tokens = startup["kv_tokens"]
    print(f"doctor: {tokens} KV tokens in {startup['kv_cache_gib']} GiB; the model's shape gives {fits:.0f}")
    assert fits - 256 <= tokens <= fits, (tokens, fits)
    assert startup["max_concurrency"] == pytest.approx(tokens / configured_len, rel=0.01)
    table = subprocess.run([BIN, "doctor", log], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert f"{tokens}" in table.stdout.replace(",", "") or f"{tokens:,}" in table.stdout, table.stdout
    assert math.isfinite(startup["kv_bytes_per_token"]) and startup["kv_bytes_per_token"] == pytest.approx(
        per_token, rel=0.01)


class SlowSpeech:
    """A speech server on 127.0.0.1 that answers each transcription after `hold` seconds (the
    audio side of this test: what matters is how long an audio job runs, not its text)."""

    def __init__(self, hold: float):
        import http.server

        hold_s = hold
        # When each job began and ended here (time.monotonic(), the test's own clock).
        self.jobs = jobs = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # /health
                self._answer(b'{"status":"ok"}')

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                began = time.monotonic()
                time.sleep(hold_s)
                jobs.append((began, time.monotonic()))
                self._answer(b'{"text":"the quick brown fox"}')

            def _answer(self, body: bytes):
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def pausing_gateway(port: int, text: str, audio: str, mode: str) -> str:
    return f"""
listen = "127.0.0.1:{port}"

[[lanes]]
name = "audio"
paths = ["/v1/audio/transcriptions"]
upstreams = ["{audio}"]
max_inflight = 1
max_queue = 4
priority = 10
policy = "queue"

[[lanes]]
name = "text"
paths = ["/v1/chat/completions"]
upstreams = ["{text}"]
max_inflight = 1
request_timeout = "180s"
yield_to = ["audio"]
max_yield = "30s"
preempt = true
preempt_mode = "{mode}"
"""


def is_sleeping(vllm) -> bool:
    r = httpx.get(f"{vllm['HEADROOM_VLLM_URL']}/is_sleeping", timeout=10)
    assert r.status_code == 200, (
        f"vLLM answered {r.status_code} to /is_sleeping: start it with VLLM_SERVER_DEV_MODE=1 "
        "(scripts/backends.sh start vllm does)")
    return r.json()["is_sleeping"]


# How long the gateway's pause call may take to reach vLLM's scheduler on a loaded 2-core box.
PAUSE_LATENCY = 1.0


def test_preempt_mode_pause_freezes_the_vllm_request_while_audio_runs_and_it_completes(vllm):
    hold = 3.0
    speech = SlowSpeech(hold)
    proc, base, cfg = start_serve(BIN, lambda port: pausing_gateway(port, vllm["HEADROOM_VLLM_URL"], speech.url, "pause"))
    try:
        assert not is_sleeping(vllm)
        stamps, lines = [], []

        def stream():
            body = dict(long_generation(120), stream=True)
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=180) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line:  # the blank line that ends each event
                        continue
                    lines.append(line)
                    if '"content":"' in line:
                        stamps.append(time.monotonic())

        text = threading.Thread(target=stream)
        text.start()
        wait_for("the text stream to run", lambda: len(stamps) >= 5, 120)
        sent = time.monotonic()
        fox = (ROOT / "tests" / "data" / "audio" / "fox.wav").read_bytes()
        audio = httpx.post(f"{base}/v1/audio/transcriptions", files={"file": ("fox.wav", fox, "audio/wav")},
                           data={"model": "whisper-1"}, timeout=60)
        came = time.monotonic()
        assert audio.status_code == 200, audio.text
        assert not is_sleeping(vllm), "vLLM was left paused after the audio job"
        text.join(timeout=180)
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        # The whole generation arrived (no preemption: vLLM kept the request, frozen) ...
        assert not any("preempted" in line for line in lines), lines[-3:]
        assert any('"finish_reason":"length"' in line for line in lines), lines[-3:]
        assert len(stamps) >= 100, len(stamps)
        # ... with a gap as long as the audio job, and none produced while it ran. The pause is
        # asked for when the gate admits the job and is not awaited by it (audio is never held
        # for text), so a loaded box may still stream a token or two just after the job begins:
        # the window starts PAUSE_LATENCY after the speech server took the job. Unpaused, vLLM
        # streams several tokens a second, so the window still tells a pause from none.
        assert len(speech.jobs) == 1, speech.jobs
        began, ended = speech.jobs[0]
        assert sent <= began and ended <= came
        during = [t for t in stamps if began + PAUSE_LATENCY < t < ended - 0.2]
        gap = max(b - a for a, b in zip(stamps, stamps[1:]))
        print(f"pause: largest gap between tokens {gap:.2f} s while a {hold:.1f} s audio job ran "
              f"({len(during)} tokens inside it)")
        assert not during, f"{len(during)} tokens streamed while vLLM should have been paused"
        assert gap >= hold - PAUSE_LATENCY - 0.2, gap
    finally:
        stop_serve(proc, cfg)
        speech.close()
        if is_sleeping(vllm):  # never leave the shared vLLM paused for the next tests
            httpx.post(f"{vllm['HEADROOM_VLLM_URL']}/wake_up?tags=scheduling", timeout=10)
