"""Memory of a process tree, as the benchmarks measure it: RSS and PSS summed over a process and its descendants,
sampled in a thread (`PeakMemory`)."""

from __future__ import annotations

import threading
import time

import psutil


def tree_memory(process: psutil.Process) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) over ``process`` and its descendants, in bytes (PSS counts shared pages once)."""
    rss = pss = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for member in members:
        try:
            info = member.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += info.pss
    return rss, pss


class PeakMemory:
    """While open, samples every ``interval_s`` the PSS of each named process tree and of all of them at once;
    ``peaks_mb`` holds the peaks (MB): one per name, and ``"total"`` (the peak of the sum at one instant)."""

    def __init__(self, interval_s: float = 0.2, **pids: int) -> None:
        self.interval_s = interval_s
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peaks_mb: dict[str, float] = {name: 0.0 for name in [*pids, "total"]}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            total = 0.0
            for name, process in self.processes.items():
                pss_mb = tree_memory(process)[1] / 2**20
                self.peaks_mb[name] = max(self.peaks_mb[name], pss_mb)
                total += pss_mb
            self.peaks_mb["total"] = max(self.peaks_mb["total"], total)
            time.sleep(self.interval_s)
