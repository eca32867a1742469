"""What a rank used over a call, from its agent's samples: peak and mean host memory (RSS), mean
CPU, and on GPUs peak GPU memory and mean utilisation; and the warnings a person wants to see once
(an idle GPU, a device or host close to full). Pure: the tests feed it scripted samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IDLE_GPU_PERCENT = 10.0
IDLE_GPU_SECONDS = 60.0
FULL_FRACTION = 0.9
MB = 1024 * 1024


@dataclass
class RankUsage:
    rank: int
    samples: int = 0
    rss_peak: float = 0.0
    rss_sum: float = 0.0
    cpu_sum: float = 0.0
    cpu_samples: int = 0
    gpu_memory_peak: float | None = None
    gpu_util_sum: float = 0.0
    gpu_util_samples: int = 0
    latest: dict[str, float] = field(default_factory=dict)
    own_cpu_percent: float | None = None  # from the rank's own getrusage at the call's end (`add_own`)
    _idle_since: float | None = None
    _warned: set[str] = field(default_factory=set)

    def add(self, figures: dict[str, float], now: float) -> list[str]:
        """Take one sample; the warnings it raises for the first time."""
        self.samples += 1
        self.latest = dict(figures)
        rss = figures.get("rss", 0.0)
        self.rss_peak, self.rss_sum = max(self.rss_peak, rss), self.rss_sum + rss
        if "cpu" in figures:
            self.cpu_sum, self.cpu_samples = self.cpu_sum + figures["cpu"], self.cpu_samples + 1
        if "gpu_memory" in figures:
            self.gpu_memory_peak = max(self.gpu_memory_peak or 0.0, figures["gpu_memory"])
        if "gpu_util" in figures:
            self.gpu_util_sum, self.gpu_util_samples = self.gpu_util_sum + figures["gpu_util"], self.gpu_util_samples + 1
        return self._warnings(figures, now)

    def add_own(self, used: dict[str, float], seconds: float) -> None:
        """The rank's own figures for a call (peak RSS, CPU seconds): a call shorter than the
        sampling interval has no samples, and still says what it used."""
        self.rss_peak = max(self.rss_peak, used.get("peak_rss", 0.0))
        if seconds > 0 and "cpu_seconds" in used:
            self.own_cpu_percent = 100.0 * used["cpu_seconds"] / seconds

    def _warnings(self, f: dict[str, float], now: float) -> list[str]:
        said = []
        if "gpu_util" in f:
            if f["gpu_util"] < IDLE_GPU_PERCENT:
                self._idle_since = now if self._idle_since is None else self._idle_since
                if now - self._idle_since >= IDLE_GPU_SECONDS:
                    said += self._once("idle", f"rank {self.rank}: its GPU has been under {IDLE_GPU_PERCENT:g}% busy for "
                                               f"{now - self._idle_since:.0f}s while the rank ran (a data loader or "
                                               f"host-to-device copies are the usual cause)")
            else:
                self._idle_since = None
        total = f.get("gpu_memory_total")
        if total and f.get("gpu_memory", 0) > FULL_FRACTION * total:
            said += self._once("gpu_full", f"rank {self.rank}: GPU memory at {f['gpu_memory'] / MB:.0f} of "
                                           f"{total / MB:.0f} MB (over {FULL_FRACTION:.0%}); the next allocation "
                                           f"may fail with CUDA out of memory")
        host = f.get("host_memory")
        if host and f.get("rss", 0) > FULL_FRACTION * host:
            said += self._once("host_full", f"rank {self.rank}: host memory at {f['rss'] / MB:.0f} of {host / MB:.0f} "
                                            f"MB of its node (over {FULL_FRACTION:.0%})")
        return said

    def _once(self, kind: str, line: str) -> list[str]:
        if kind in self._warned:
            return []
        self._warned.add(kind)
        return [line]

    def columns(self) -> dict[str, str]:
        """The rank table's columns; GPU columns only where the rank had a GPU (absent, not zero)."""
        if not self.samples and not self.rss_peak:
            return {}
        if self.cpu_samples:
            cpu = f"{self.cpu_sum / self.cpu_samples:.0f}"
        else:
            cpu = f"{self.own_cpu_percent:.0f}" if self.own_cpu_percent is not None else "n/a"
        cols = {"peak RSS MB": f"{self.rss_peak / MB:.0f}",
                "mean RSS MB": f"{self.rss_sum / self.samples / MB:.0f}" if self.samples else "n/a", "mean CPU %": cpu}
        if self.gpu_memory_peak is not None:
            cols["peak GPU MB"] = f"{self.gpu_memory_peak / MB:.0f}"
        if self.gpu_util_samples:
            cols["mean GPU %"] = f"{self.gpu_util_sum / self.gpu_util_samples:.0f}"
        return cols

    def summary(self) -> str:
        """What the rank used over the call, in words ("peak RSS 345 MB, mean CPU 89%"), or ''."""
        units = {"peak RSS MB": ("peak RSS", " MB"), "mean RSS MB": ("mean RSS", " MB"), "mean CPU %": ("mean CPU", "%"),
                 "peak GPU MB": ("peak GPU memory", " MB"), "mean GPU %": ("mean GPU", "%")}
        return ", ".join(f"{units[k][0]} {v}{units[k][1]}" for k, v in self.columns().items() if v != "n/a")

    def line(self) -> str:
        """The latest figures in one line (console, the live resources table)."""
        f = self.latest
        parts = [f"RSS {f.get('rss', 0) / MB:.0f} MB"]
        if "cpu" in f:
            parts.append(f"CPU {f['cpu']:.0f}%")
        if "gpu_memory" in f:
            parts.append(f"GPU mem {f['gpu_memory'] / MB:.0f} MB")
        if "gpu_util" in f:
            parts.append(f"GPU {f['gpu_util']:.0f}%")
        return ", ".join(parts)
