"""End to end: `headroom up` with examples/cpu-box.up.toml protects audio under a text flood at
least as well as `headroom serve` with the hand-written examples/cpu-box.toml (the test version of
`bench/protection.sh --compare-up`, whose table is in docs/up.md).

The example runs in front of the engines scripts/backends.sh started (HEADROOM_LLAMA_URL,
HEADROOM_WHISPER_URL); `up` starts its own engines from the same packages on free ports. Each box
is measured alone (the other is not running, or idle): clips back to back with nothing else,
then the same clips under a flood of 16 streaming chats of 64 tokens. `up`'s audio must succeed
at least as often as the example's, its p95 under the flood must stay within 1.2 x the example's
(plus one second of slack for a loaded machine: a 2-core box shared with other work moves p95 by
that much between two runs of the same box), and every text request must end as a stream, a
preemption or a refusal with Retry-After (no hang, no error).

Run by scripts/test.sh (and so .ci/run) with the other e2e tests.
"""

import os
import pathlib
import sys
from types import SimpleNamespace

import httpx
import pytest

from test_up import require_backends

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import protection  # noqa: E402  (bench/protection.py: the flood, the clips, both boxes)

LLAMA = os.environ.get("HEADROOM_LLAMA_URL", "http://127.0.0.1:18080")
WHISPER = os.environ.get("HEADROOM_WHISPER_URL", "http://127.0.0.1:18081")
BIN = os.environ.get("HEADROOM_BIN", str(ROOT / "target" / "debug" / "headroom"))
SLACK_S = 1.0


def test_up_protects_audio_under_a_flood_at_least_as_well_as_the_example(tmp_path):
    require_backends()
    for url in (LLAMA, WHISPER):
        try:
            httpx.get(f"{url}/health", timeout=10).raise_for_status()
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"backend {url} is not up ({e}); run scripts/backends.sh install start")
    args = SimpleNamespace(clips=8, flood=16, max_tokens=64)
    example, base = protection.start_headroom(BIN, LLAMA, WHISPER)
    try:
        serve = protection.measure_box(base, args)
    finally:
        protection.stop(example)
    box, base, _ = protection.start_up(BIN, tmp_path, recalibrate=True)
    try:
        up = protection.measure_box(base, args)
    finally:
        protection.stop(box)
    derived = [l for l in (tmp_path / "up.log").read_text().splitlines() if "sequence(s)" in l or "beside [" in l]
    for name, m in (("serve + cpu-box.toml", serve), ("up + cpu-box.up.toml", up)):
        print(f"{name}: alone p95 {m['idle']['p95']:.2f} s; flood {m['flood']['ok']}/{m['flood']['clips']} ok, "
              f"p50 {m['flood']['p50']:.2f} s, p95 {m['flood']['p95']:.2f} s, failures {m['flood']['failures']}; "
              f"text {m['text']} (load {m['load']:.1f})")
    print("\n".join(derived))
    assert up["flood"]["ok"] >= serve["flood"]["ok"], (up["flood"], serve["flood"])
    assert up["flood"]["p95"] <= 1.2 * serve["flood"]["p95"] + SLACK_S, (up["flood"], serve["flood"])
    # Text is held while clips come back to back (a loaded 2-core box may complete none in either
    # box): every text request was streamed, stopped for audio, or refused with Retry-After.
    assert up["text"]["other"] == 0, up["text"]
