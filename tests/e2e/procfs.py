"""/proc, read independently of headroom: the process table, trees, PSS, start times, command
lines and environments the end-to-end tests of `headroom up` check its figures against."""

import os
import socket
import threading
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
BOOT = next(int(l.split()[1]) for l in open("/proc/stat") if l.startswith("btime"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_stats():
    """pid -> (ppid, pgrp, cmdline) for every live process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            fields = stat[stat.rindex(")") + 2:].split()
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        out[int(d)] = (int(fields[1]), int(fields[2]), cmd)
    return out


def tree(root: int):
    stats = all_stats()
    found, todo = [], [root]
    while todo:
        p = todo.pop()
        if p in stats and p not in found:
            found.append(p)
            todo.extend(c for c, (pp, _, _) in stats.items() if pp == p)
    return found


def pss_of_tree(root: int) -> int:
    total = 0
    for p in tree(root):
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def group_members(pgid: int):
    return [p for p, (_, g, _) in all_stats().items() if g == pgid]


def started_at(pid: int) -> float:
    """When the process started, in seconds since the epoch (from /proc/PID/stat)."""
    stat = open(f"/proc/{pid}/stat").read()
    ticks = int(stat[stat.rindex(")") + 2:].split()[19])
    return BOOT + ticks / CLK_TCK


def cmdline(pid: int):
    return [a.decode() for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") if a]


def environ(pid: int) -> dict:
    pairs = (a.decode(errors="replace").split("=", 1) for a in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in a)
    return dict(pairs)


class PssWatch:
    """Samples, at ~20 Hz from the moment it appears, the PSS of the process tree of `parent`'s
    first child whose command line contains `needle`; with `note`, also when a child whose
    command line contains it is first seen (`noted_at`)."""

    def __init__(self, parent: int, needle: str, note: str = None):
        self.parent, self.needle, self.note = parent, needle, note
        self.samples, self.root, self.noted_at = [], None, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            children = [(p, cmd) for p, (pp, _, cmd) in all_stats().items() if pp == self.parent]
            if self.root is None:
                found = [p for p, cmd in children if self.needle in cmd]
                self.root = found[0] if found else None
            if self.note and self.noted_at is None and any(self.note in cmd for _, cmd in children):
                self.noted_at = time.time()
            if self.root is not None:
                self.samples.append((time.time(), pss_of_tree(self.root)))
            time.sleep(0.05)
