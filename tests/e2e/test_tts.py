"""Speech synthesis end to end: the official `openai` client's `audio.speech` through `headroom
serve` in front of the piper speech server (scripts/tts_server.py), whole and streamed, and the
round trip through Whisper.

Needs `scripts/backends.sh install start` (piper on HEADROOM_TTS_URL, faster-whisper-server on
HEADROOM_WHISPER_URL). Run by scripts/test.sh.
"""

import os
import struct
import threading
import time

import httpx
import openai
import pytest
from gateway import start_serve, stop_serve

TTS = os.environ.get("HEADROOM_TTS_URL", "http://127.0.0.1:18083")
WHISPER = os.environ.get("HEADROOM_WHISPER_URL", "http://127.0.0.1:18081")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("HEADROOM_BIN", os.path.join(ROOT, "target", "debug", "headroom"))

FOX = "The quick brown fox jumps over the lazy dog."
# Three sentences: piper synthesises one at a time, and the server sends each as it is made.
NARRATION = (
    "The lighthouse keeper climbed the stairs at dusk. "
    "He wound the clockwork that turned the great lens, one slow turn after another. "
    "Far out at sea, a fishing boat saw the beam and turned for home."
)


def config(port: int) -> str:
    return f"""
listen = "127.0.0.1:{port}"
[[lanes]]
name = "speech"
paths = ["/v1/audio/speech"]
upstreams = ["{TTS}"]
max_inflight = 1
max_queue = 4
queue_timeout = "60s"
request_timeout = "120s"
policy = "queue"
max_input_chars = 500
[[lanes]]
name = "stt"
paths = ["/v1/audio/transcriptions"]
upstreams = ["{WHISPER}"]
max_inflight = 1
max_queue = 4
queue_timeout = "60s"
request_timeout = "120s"
policy = "queue"
"""


@pytest.fixture(scope="module")
def gateway():
    for url in (TTS, WHISPER):
        try:
            httpx.get(f"{url}/health", timeout=10).raise_for_status()
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"backend {url} is not up ({e}); run scripts/backends.sh install start")
    proc, base, cfg = start_serve(BIN, config)
    yield base
    stop_serve(proc, cfg)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-loopback", max_retries=0, timeout=120)


def wav_seconds(data: bytes) -> float:
    """Seconds of 16-bit PCM in a WAV, read from its fmt chunk; a streamed WAV's sizes are
    0xFFFFFFFF, so the data is what follows the data chunk's header."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", data[:16]
    at, rate = 12, None
    while at + 8 <= len(data):
        cid, size = data[at:at + 4], struct.unpack("<I", data[at + 4:at + 8])[0]
        if cid == b"fmt ":
            channels, rate = struct.unpack("<HI", data[at + 10:at + 16])
            assert channels == 1
        elif cid == b"data":
            return (len(data) - at - 8) / (rate * 2)
        at += 8 + size
    raise AssertionError("no data chunk")


def test_the_openai_client_gets_whole_speech_that_whisper_understands(gateway):
    c = client(gateway)
    audio = c.audio.speech.create(model="piper", voice="alloy", input=FOX, response_format="wav")
    data = audio.content
    seconds = wav_seconds(data)
    # 44 characters of English: about 3 s spoken (piper's voice: 2.5-3.5 s).
    assert 1.5 < seconds < 6.0, seconds
    text = c.audio.transcriptions.create(model="whisper-1", file=("speech.wav", data)).text
    assert "lazy dog" in text.lower(), text


def test_the_openai_client_streams_speech_sentence_by_sentence(gateway):
    times, sizes = [], []
    start = time.monotonic()
    with client(gateway).audio.speech.with_streaming_response.create(
        model="piper", voice="alloy", input=NARRATION, response_format="pcm"
    ) as r:
        assert r.headers["content-type"] == "audio/pcm"
        assert r.headers["x-headroom-lane"] == "speech"
        for chunk in r.iter_bytes():
            times.append(time.monotonic() - start)
            sizes.append(len(chunk))
    total = sum(sizes)
    # Raw 16-bit mono at 24 kHz: three sentences are several seconds of audio.
    assert total % 2 == 0
    seconds = total / 2 / 24_000
    assert 6.0 < seconds < 20.0, seconds
    # The first sentence arrived while the rest were still being made.
    assert len(times) >= 2, sizes
    assert times[0] < 0.8 * times[-1], times


def test_health_answers_while_a_narration_is_synthesised(gateway):
    done = threading.Event()

    def narrate():
        try:
            client(gateway).audio.speech.create(
                model="piper", voice="alloy", input=NARRATION * 2, response_format="wav"
            ).content
        finally:
            done.set()

    t = threading.Thread(target=narrate)
    t.start()
    time.sleep(0.3)
    started = time.monotonic()
    assert httpx.get(f"{TTS}/health", timeout=10).status_code == 200
    waited = time.monotonic() - started
    t.join()
    assert waited < 2.0, waited


def test_bad_speech_requests_get_openai_shaped_errors(gateway):
    c = client(gateway)
    # Refused by the gateway: over the lane's max_input_chars.
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.speech.create(model="piper", voice="alloy", input="word " * 120)
    assert e.value.body["code"] == "input_too_long"
    # Refused by the speech server: a format it does not write, passed through in OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.speech.create(model="piper", voice="alloy", input=FOX, response_format="mp3")
    assert e.value.body["code"] == "unsupported_value"
    assert e.value.body["param"] == "response_format"
    # And the gateway is still serving.
    assert wav_seconds(c.audio.speech.create(model="piper", voice="alloy", input="Yes.",
                                             response_format="wav").content) > 0.2
