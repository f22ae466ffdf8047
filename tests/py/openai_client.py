"""Drives the gateway with the official `openai` Python client (run by tests/it/serve.rs).

Usage: openai_client.py BASE_URL AUDIO_FILE
Streams a chat completion, posts a transcription, and checks that an overloaded lane surfaces as
the client's RateLimitError. Prints one JSON object with what it saw.
"""

import json
import sys

import openai


def main() -> int:
    base_url, audio_path = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused-on-loopback", max_retries=0, timeout=30)

    chunks = 0
    content = ""
    stream = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "say hello"}],
        stream=True,
    )
    for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content

    with open(audio_path, "rb") as f:
        transcript = client.audio.transcriptions.create(model="whisper-1", file=f)

    # Hold both text slots with slow streams, then a third request is refused with 429.
    slow = {"x-test-chunks": "50", "x-test-interval-ms": "20"}
    holders = [
        client.chat.completions.create(
            model="test-model",
            messages=[{"role": "user", "content": "hold"}],
            stream=True,
            extra_headers=slow,
        )
        for _ in range(2)
    ]
    rate_limited_status = None
    retry_after = None
    try:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "x"}])
    except openai.RateLimitError as e:
        rate_limited_status = e.status_code
        retry_after = e.response.headers.get("retry-after")
        code = e.body.get("code") if isinstance(e.body, dict) else None
        if code != "lane_saturated":
            print(f"unexpected error body: {e.body!r}", file=sys.stderr)
            return 1
    for h in holders:
        h.close()

    print(json.dumps({
        "chunks": chunks,
        "content": content,
        "transcript": transcript.text,
        "rate_limited_status": rate_limited_status,
        "retry_after": retry_after,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
