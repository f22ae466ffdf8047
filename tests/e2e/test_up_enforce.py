"""End to end: `headroom up` with `[memory] enforce = true` on this machine's real memory cgroups
(CI runs as root; the machines mount the cgroup v1 controllers, memory among them, and a cgroup2
tree). The backend is tests/py/alloc_upstream.py: a real process that allocates and touches what a
request asks for.

What is checked, each against this test's own reading of /proc and the cgroup's files:
  - the backend runs in the box's memory cgroup, whose limit is the capacity;
  - the pool's reading (headroom_gpu_memory_used_bytes) is the cgroup's usage less its inactive
    file cache, read here from memory.usage_in_bytes / memory.current and memory.stat;
  - a request that allocates past the limit gets the backend OOM-killed by the kernel: the count
    in the cgroup's own file, /admin/box, /metrics (headroom_box_oom_kills_total) and /ui agree,
    and the backend restarts with `last_exit` = `oom_killed`;
  - SIGTERM removes the cgroup; after kill -9 of `up` the next start removes the stale cgroup
    and kills what was left inside it;
  - where no memory controller is mounted, or the hierarchy is read-only, `up` exits 2 with one
    line that says what is missing (run in a private mount namespace, so the machine is untouched).

Run by scripts/test.sh (and so .ci/run) with the other e2e tests:  python -m pytest tests/e2e
"""

import pathlib
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from procfs import free_port
from test_up import BIN, Box as UpBox

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOG = ROOT / "tests" / "py" / "alloc_upstream.py"
MIB = 1024 * 1024
CAPACITY = 256 * MIB


def box_text(backend_port: int, port: int) -> str:
    return f"""
restart_backoff = "500ms"
[memory]
probe = "host"
capacity = "{CAPACITY // MIB}MiB"
margin = "16MiB"
enforce = true
sample_interval = "25ms"
[[backends]]
name = "hog"
role = "audio"
engine = "other"
command = "{sys.executable}"
args = ["{HOG}", "--port", "{{port}}", "--mib", "8", "--hold-ms", "100"]
port = {backend_port}
ready_timeout = "30s"
steady_window = "1s"
steady_timeout = "10s"
[serve]
listen = "127.0.0.1:{port}"
"""


class Box(UpBox):
    """test_up's running `up`, on a box file of one allocating backend."""

    def __init__(self, tmp: pathlib.Path, name: str):
        self.backend_port = free_port()
        self.port = free_port()
        self.path = tmp / f"{name}.up.toml"
        self.path.write_text(box_text(self.backend_port, self.port))
        self.logs = tmp / f"logs-{name}"
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, *args):
        return super().start("--recalibrate", "--log-dir", str(self.logs), *args)

    def wait_ready(self, timeout=90):
        return super().wait_ready(timeout)

    def stop(self, timeout=30):
        super().stop(timeout)

    def run_prefixed(self, prefix, timeout=60):
        """`up` run to its end under `prefix` (a command that execs the rest)."""
        done = subprocess.run([*prefix, BIN, "up", "--config", str(self.path), "--log-dir", str(self.logs)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
        return done.returncode, done.stderr.decode(errors="replace")


# ---- the cgroup, read here ----------------------------------------------------------------------

def memory_mount() -> tuple[str, str]:
    """(version, mount point) of the hierarchy holding the memory controller, from /proc/mounts."""
    mounts = [l.split() for l in open("/proc/mounts")]
    for dev, point, fstype, opts, *_ in mounts:
        if fstype == "cgroup2" and "memory" in open(f"{point}/cgroup.controllers").read().split():
            return "v2", point
    for dev, point, fstype, opts, *_ in mounts:
        if fstype == "cgroup" and "memory" in opts.split(","):
            return "v1", point
    pytest.fail("no memory cgroup controller is mounted here")


def read_int(path: pathlib.Path) -> int:
    return int(path.read_text().split()[0])


def stat_of(path: pathlib.Path, key: str) -> int:
    for line in path.read_text().splitlines():
        k, v = line.split()
        if k == key:
            return int(v)
    raise KeyError(key)


def working_set(cg: pathlib.Path, version: str) -> int:
    if version == "v2":
        return read_int(cg / "memory.current") - stat_of(cg / "memory.stat", "inactive_file")
    return read_int(cg / "memory.usage_in_bytes") - stat_of(cg / "memory.stat", "total_inactive_file")


def oom_kills(cg: pathlib.Path, version: str) -> int:
    return stat_of(cg / ("memory.events" if version == "v2" else "memory.oom_control"), "oom_kill")


def limit_of(cg: pathlib.Path, version: str) -> int:
    return read_int(cg / ("memory.max" if version == "v2" else "memory.limit_in_bytes"))


def cgroup_of(pid: int, version: str) -> str:
    for line in open(f"/proc/{pid}/cgroup"):
        hid, controllers, path = line.rstrip("\n").split(":", 2)
        if (version == "v2" and hid == "0") or (version == "v1" and "memory" in controllers.split(",")):
            return path
    return ""


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def gone(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except (FileNotFoundError, ProcessLookupError):  # the latter when it goes between open and read
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def wait_for(check, timeout=20, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"{what} not seen within {timeout} s")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("enforce")


@pytest.fixture(scope="module")
def running(tmp):
    version, mount = memory_mount()
    box = Box(tmp, "box")
    box.start()
    report = box.wait_ready()
    yield box, report, version, mount
    box.stop()


def test_the_backend_runs_in_the_box_cgroup_limited_to_the_capacity(running):
    box, report, version, mount = running
    e = report["enforce"]
    cg = pathlib.Path(e["cgroup"])
    assert e["version"] == version
    assert str(cg).startswith(mount + "/"), (cg, mount)
    assert cg.name.startswith(f"headroom-up-{box.proc.pid}-"), cg.name
    assert limit_of(cg, version) == CAPACITY
    pid = report["backends"][0]["pid"]
    assert cgroup_of(pid, version) == "/" + str(cg.relative_to(mount)), cgroup_of(pid, version)
    assert pid in [int(p) for p in (cg / "cgroup.procs").read_text().split()]
    # up itself stays outside: only the backends are limited.
    assert cgroup_of(box.proc.pid, version) != cgroup_of(pid, version)


def test_the_pools_reading_is_the_cgroups_working_set(running):
    box, report, version, _ = running
    cg = pathlib.Path(report["enforce"]["cgroup"])
    # Both sides move a little on an idle box (interpreter, page cache): the measurement is
    # retried until the pool's reading sits between two reads of the files around it.
    seen = []
    for _ in range(40):
        before = working_set(cg, version)
        reading = metric(box.base, 'headroom_gpu_memory_used_bytes')
        after = working_set(cg, version)
        seen.append((before, reading, after))
        if min(before, after) - MIB <= reading <= max(before, after) + MIB:
            break
        time.sleep(0.1)
    before, reading, after = seen[-1]
    assert min(before, after) - MIB <= reading <= max(before, after) + MIB, seen
    assert reading > 4 * MIB, "the backend's interpreter is in the reading"


def test_an_oom_kill_inside_the_box_is_counted_and_the_restart_says_so(running):
    box, report, version, _ = running
    cg = pathlib.Path(report["enforce"]["cgroup"])
    pid = report["backends"][0]["pid"]
    assert oom_kills(cg, version) == 0
    # Straight to the backend (the gateway's admission would refuse it): 400 MiB in a 256 MiB box.
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{box.backend_port}/v1/audio/transcriptions",
                   headers={"x-alloc-mib": "400"}, content=b"x", timeout=30)
    wait_for(lambda: gone(pid), what=f"backend {pid} killed")
    assert oom_kills(cg, version) == 1, "the kernel counted the kill in the cgroup"
    hog = wait_for(lambda: next((b for b in box.report()["backends"]
                                 if b["state"] == "ready" and b["restarts"] == 1), None),
                   what="the backend running again")
    assert hog["last_exit"] == "oom_killed", hog
    assert hog["pid"] != pid
    assert box.report()["enforce"]["oom_kills"] == 1
    assert metric(box.base, "headroom_box_oom_kills_total") == 1
    page = httpx.get(f"{box.base}/ui", timeout=5).text
    assert "OOM kills 1" in page and "oom_killed" in page, page[:2000]
    assert "killed by the kernel's OOM killer" in box.stderr_text()


def test_sigterm_removes_the_cgroup(tmp):
    box = Box(tmp, "stop")
    box.start()
    cg = pathlib.Path(box.wait_ready()["enforce"]["cgroup"])
    assert cg.is_dir()
    box.stop()
    assert box.proc.returncode == 0, box.stderr_text()
    assert not cg.exists(), box.stderr_text()


def test_after_kill_9_of_up_the_next_start_removes_its_cgroup_and_what_was_left_inside(tmp):
    first = Box(tmp, "crash")
    first.start()
    report = first.wait_ready()
    cg = pathlib.Path(report["enforce"]["cgroup"])
    version, _ = memory_mount()
    backend = report["backends"][0]["pid"]
    first.proc.kill()
    first.proc.wait(10)
    wait_for(lambda: gone(backend), what="the backend dying with up")
    assert cg.is_dir(), "nothing removes the cgroup of an up killed outright"
    # Something left inside, as a backend that left its process group would be.
    left = subprocess.Popen(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec sleep 600'])
    wait_for(lambda: str(left.pid) in (cg / "cgroup.procs").read_text().split(), what="leftover inside")
    # The same box file again (its ports are free: the backend died with up).
    second = first
    second.start()
    try:
        new = pathlib.Path(second.wait_ready()["enforce"]["cgroup"])
        assert not cg.exists(), second.stderr_text()
        assert left.wait(10) == -signal.SIGKILL
        assert new.is_dir() and new != cg
        err = second.stderr_text()
        assert f"removed the memory cgroup {cg}" in err and f"[{left.pid}]" in err, err
    finally:
        second.stop()
        if left.poll() is None:
            left.kill()
    assert not new.exists()


def in_private_mounts(script: str) -> list:
    """A prefix that runs `up` in a private mount namespace after `script` (the machine's own
    mounts are untouched)."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{script} && exec "$@"', "sh"]


def test_without_a_memory_controller_up_exits_2_with_one_line(tmp):
    version, mount = memory_mount()
    box = Box(tmp, "nocontroller")
    code, err = box.run_prefixed(in_private_mounts(f"umount {mount}"))
    lines = [l for l in err.splitlines() if l.startswith("headroom up:")]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "no memory cgroup controller is mounted" in lines[0], lines[0]
    assert "mount -t cgroup2" in lines[0], lines[0]
    assert "started pid" not in err


def test_a_read_only_hierarchy_is_one_line_and_exit_2(tmp):
    version, mount = memory_mount()
    box = Box(tmp, "readonly")
    code, err = box.run_prefixed(in_private_mounts(f"mount -o remount,bind,ro {mount}"))
    lines = [l for l in err.splitlines() if l.startswith("headroom up:")]
    assert code == 2, err
    assert len(lines) == 1 and "cannot create a memory cgroup" in lines[0], err
    assert "Read-only" in lines[0], lines[0]
