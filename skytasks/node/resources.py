"""What each rank uses, read on its node: CPU and resident memory from /proc, and on GPU nodes the
rank's GPU memory and its device's utilisation from `nvidia-smi`'s query mode.

Standard library only (the agent imports it). One sample reads two small /proc files per rank and,
on GPU nodes, runs `nvidia-smi` twice; the agent takes one every few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (its own, not its children's), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def with_descendants(pid: int) -> list[int]:
    """The process and every process below it: a script `run_script` started, DataLoader workers.
    (/proc/<pid>/task/<tid>/children, which every current Linux kernel has.)"""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def physical_gpu(device: str, visible: list[str]) -> str | None:
    """The GPU nvidia-smi knows (its index or UUID) behind a rank's "cuda:<i>"."""
    if not device.startswith("cuda:"):
        return None
    i = int(device.split(":", 1)[1])
    return visible[i] if i < len(visible) else None


@dataclass(frozen=True)
class GpuDevice:
    index: str  # as nvidia-smi numbers it (the physical index CUDA_VISIBLE_DEVICES names)
    uuid: str
    utilization: float | None  # percent
    memory_used: int  # bytes
    memory_total: int


def parse_gpu_query(text: str) -> list[GpuDevice]:
    """`nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total
    --format=csv,noheader,nounits`; "[N/A]" or "[Not Supported]" utilisation is None."""
    devices = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        util = None if parts[2].startswith("[") or not _is_number(parts[2]) else float(parts[2])
        devices.append(GpuDevice(parts[0], parts[1], util, _mib(parts[3]), _mib(parts[4])))
    return devices


def parse_compute_apps(text: str) -> dict[int, tuple[str, int]]:
    """`nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits`:
    {pid: (gpu uuid, bytes)}; a process on several GPUs keeps its largest."""
    apps: dict[int, tuple[str, int]] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        pid, used = int(parts[0]), _mib(parts[2])
        if pid not in apps or used > apps[pid][1]:
            apps[pid] = (parts[1], used)
    return apps


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _mib(text: str) -> int:
    return int(float(text) * 1024 * 1024) if _is_number(text) else 0


def _nvidia_smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


class Sampler:
    """Per-rank figures between two calls of `sample`: CPU percent over the interval, RSS now,
    and on GPU nodes the rank's GPU memory and its device's utilisation. A rank counts with every
    process below it (the script of `skytasks run`, DataLoader workers)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}  # pid -> (wall, cpu seconds)
        self.host_memory = host_memory_bytes()
        self.gpus = shutil.which("nvidia-smi") is not None

    def sample(self, ranks: dict[int, tuple[int, str | None]]) -> dict[int, dict[str, float]]:
        """`ranks`: rank -> (pid, the physical GPU index it uses or None)."""
        now = time.monotonic()
        devices: dict[str, GpuDevice] = {}
        apps: dict[int, tuple[str, int]] = {}
        if self.gpus and any(gpu is not None for _, gpu in ranks.values()):
            found = parse_gpu_query(_nvidia_smi("--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total"))
            # CUDA_VISIBLE_DEVICES names GPUs by index or by UUID: either finds the device
            devices = {**{d.index: d for d in found}, **{d.uuid: d for d in found}}
            apps = parse_compute_apps(_nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory"))
        out: dict[int, dict[str, float]] = {}
        for rank, (pid, gpu) in ranks.items():
            tree = with_descendants(pid)
            cpus = [cpu_seconds(p) for p in tree]
            if cpus[0] is None:
                continue  # gone between the listing and the read
            cpu = sum(c for c in cpus if c is not None)
            rss = sum(r for r in map(rss_bytes, tree) if r is not None)
            figures: dict[str, float] = {"rss": rss, "host_memory": self.host_memory}
            if pid in self._last:
                wall, before = self._last[pid]
                if now > wall:  # a child that ended takes its CPU time along: never below 0
                    figures["cpu"] = max(0.0, 100.0 * (cpu - before) / (now - wall))
            self._last[pid] = (now, cpu)
            device = devices.get(gpu) if gpu is not None else None
            if device is not None:
                figures["gpu_memory"] = sum(apps[p][1] for p in tree if p in apps)
                figures["gpu_memory_total"] = device.memory_total
                if device.utilization is not None:
                    figures["gpu_util"] = device.utilization
            out[rank] = figures
        return out
