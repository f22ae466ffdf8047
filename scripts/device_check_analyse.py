#!/usr/bin/env python3
"""Analysis half of scripts/device-check.sh: reads the sample file written by
`headroom top --record` and the step log written by the PyTorch allocator, and prints when each
step was seen and whether it was attributed to the allocating pid.

Usage: device_check_analyse.py SAMPLES.jsonl STEPS.jsonl LIMIT_MS
Exit 0 when every step was seen within LIMIT_MS and attributed to the pid, 1 otherwise.
"""
import json, sys
samples = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
events = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
limit = int(sys.argv[3])
GIB, MIB = 1 << 30, 1 << 20
ready = next(e for e in events if e["event"] == "ready")
pid = ready["pid"]

# One point per tick: the pid's memory summed over GPUs, and device used on every GPU.
ticks = {}
for s in samples:
    t = ticks.setdefault(s["ts_ms"], {"pid": 0, "seen": False, "used": 0})
    for p in s.get("processes", []):
        if p["pid"] == pid:
            t["pid"] += p["used_bytes"]
            t["seen"] = True
    t["used"] += s["used_bytes"]
times = sorted(ticks)
gaps = sorted(b - a for a, b in zip(times, times[1:]))
print(f"samples: {len(samples)} lines, {len(times)} ticks, median gap {gaps[len(gaps)//2] if gaps else 0} ms, "
      f"max gap {gaps[-1] if gaps else 0} ms")
all_pids = sorted({p["pid"] for s in samples for p in s.get("processes", [])})
if not any(ticks[t]["seen"] for t in times):
    print(f"pid {pid} never appears in the process lists (pids seen: {all_pids}); "
          "NVML may report host pids from inside a container. Falling back to device memory.")

def baseline(key):
    before = [ticks[t][key] for t in times if ready["ts_ms"] <= t < ready["ts_ms"] + 900]
    return min(before) if before else 0

base_pid, base_used = baseline("pid"), baseline("used")
ok = True
print(f"{'step':>4} {'target':>8} {'seen after':>11} {'pid MiB':>9} {'device +MiB':>12}  result")
for e in events:
    if e["event"] not in ("alloc", "free"):
        continue
    if e["event"] == "alloc":
        target = e["step"] * GIB
        hit = lambda t: ticks[t]["pid"] - base_pid >= target - 64 * MIB
        hit_dev = lambda t: ticks[t]["used"] - base_used >= target - 64 * MIB
        label = f"{e['step']} GiB"
    else:
        target = 0
        hit = lambda t: ticks[t]["pid"] - base_pid <= 64 * MIB
        hit_dev = lambda t: ticks[t]["used"] - base_used <= 256 * MIB
        label = "freed"
    later = [t for t in times if t >= e["start_ms"]]
    seen = next((t for t in later if hit(t)), None)
    seen_dev = next((t for t in later if hit_dev(t)), None)
    if seen is not None:
        lat, attributed, at = seen - e["start_ms"], True, seen
    elif seen_dev is not None:
        lat, attributed, at = seen_dev - e["start_ms"], False, seen_dev
    else:
        lat, attributed, at = None, False, None
    good = lat is not None and lat <= limit and attributed
    ok &= good
    pid_mib = (ticks[at]["pid"] - base_pid) / MIB if at else float("nan")
    dev_mib = (ticks[at]["used"] - base_used) / MIB if at else float("nan")
    why = "ok" if good else ("never seen" if lat is None else
                             (f"late (> {limit} ms)" if lat > limit else "not attributed to the pid"))
    print(f"{e['step']:>4} {label:>8} {str(lat) + ' ms' if lat is not None else '-':>11} "
          f"{pid_mib:>9.0f} {dev_mib:>12.0f}  {why}")
print("device-check:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
