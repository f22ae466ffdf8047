"""`headroom doctor --metrics` against the real llama.cpp server (scripts/backends.sh, 2 slots by
default): with more streams than slots, the doctor names the deferred queue with the figures the
server itself reports. Run by .ci/run through scripts/test.sh; fails (never skips) when the
server is not up.
"""

import asyncio
import json
import os
import pathlib
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMA = os.environ.get("HEADROOM_LLAMA_URL", "http://127.0.0.1:18080")
BIN = os.environ.get("HEADROOM_BIN", str(ROOT / "target" / "debug" / "headroom"))
STREAMS = 4


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def streams_then_doctor(n: int) -> tuple:
    """Opens `n` streaming completions, waits until the server defers some, runs the doctor,
    then closes every stream (llama.cpp stops a stream whose client left)."""
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"{LLAMA}/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    async with httpx.AsyncClient(timeout=None) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(n)]
        deferred = 0.0
        deadline = time.time() + 90
        while time.time() < deadline and deferred == 0:
            await asyncio.sleep(0.1)
            text = (await client.get(f"{LLAMA}/metrics", timeout=10)).text
            deferred = metric(text, "llamacpp:requests_deferred")
        proc = await asyncio.create_subprocess_exec(
            BIN, "doctor", "--metrics", f"{LLAMA}/metrics", "--interval", "1s", "--format", "json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return deferred, proc.returncode, out.decode(), err.decode()


def test_more_streams_than_slots_names_the_deferred_queue():
    try:
        httpx.get(f"{LLAMA}/metrics", timeout=10).raise_for_status()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"llama.cpp at {LLAMA} is not up with /metrics ({e}); run scripts/backends.sh start")
    slots = int(os.environ.get("HEADROOM_LLAMA_PARALLEL", "2"))
    deferred, rc, out, err = asyncio.run(streams_then_doctor(STREAMS))
    assert deferred > 0, "the server never deferred a request"
    assert rc == 0, err
    report = json.loads(out)
    endpoint = report["endpoints"][0]
    assert endpoint["source"] == "llama_cpp", report
    causes = [f["cause"] for f in endpoint["findings"]]
    assert "deferred_requests" in causes, report
    f = endpoint["findings"][causes.index("deferred_requests")]
    print(json.dumps(f, indent=2))
    # The doctor's figures are the server's: at most STREAMS - slots wait, and the slots are busy.
    assert 1 <= f["numbers"]["deferred"] <= STREAMS - slots, f
    assert f["numbers"]["processing"] == slots, f
    assert f"`max_inflight = {slots}`" in f["fix"], f["fix"]
    assert "--parallel" in f["fix"], f["fix"]
    # The closed streams leave the server (bounded wait), so later tests find free slots.
    deadline = time.time() + 60
    while time.time() < deadline:
        text = httpx.get(f"{LLAMA}/metrics", timeout=10).text
        if metric(text, "llamacpp:requests_processing") == 0 and metric(text, "llamacpp:requests_deferred") == 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("streams kept running after their clients left")
