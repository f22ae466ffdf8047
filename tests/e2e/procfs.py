"""/proc, read independently of headroom: the process table, trees, PSS, start times, command
lines and environments the end-to-end tests of `headroom up` check its figures against."""

import os
import socket

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
