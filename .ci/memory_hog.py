"""Hold a share of the machine's memory while CI runs, so a test that reserves a fraction of "free" memory fails here
and not first on a busy user's machine.

    python .ci/memory_hog.py FRACTION &     # e.g. 0.3: 30 % of MemTotal, touched page by page, held until killed
"""

from __future__ import annotations

import signal
import sys
import time


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def main() -> None:
    fraction = float(sys.argv[1])
    if not 0 < fraction < 0.8:
        raise SystemExit(f"FRACTION must be in (0, 0.8), got {fraction}")
    size = int(mem_total_bytes() * fraction)
    held = bytearray(size)
    for offset in range(0, size, 4096):  # write every page, so the memory is really taken
        held[offset] = 1
    print(f"memory hog: holding {size / 2**30:.1f} GiB ({fraction:.0%} of the machine)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
