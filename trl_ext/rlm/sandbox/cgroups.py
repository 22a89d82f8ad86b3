"""The cgroup v1 control groups of one interpreter life: memory, pids, freezer (and cpu) for the whole REPL, and the
memory group all REPLs of a trainer's group share (`repl_memory_parent`).

Threat model (docs/security.md, class 4): limits per process do not add up (many children, memory in ``/dev/shm``
or a memfd, a thread burning CPU between cells); a control group limits all of a REPL's processes and its tmpfs and
memfd pages together, freezes it between cells and kills it as one (no process can leave its groups). REPLs each
within their `memory_mb` must not add up to more than the trainer's own memory group holds, which would make the
kernel kill the trainer: their memory groups sit in one group with a budget of its own.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping

from .limits import SandboxLimits

logger = logging.getLogger(__name__)

_cgroup_counter = itertools.count()

# The memory group, inside the trainer's own, that holds the memory groups of its REPLs (of every trainer process
# in that group: the ranks of one job share it). An operator may create it beforehand with a budget of their choice.
REPL_MEMORY_GROUP = "trl_ext_repls"
# The part of the trainer's memory limit the REPLs together may use when trl-ext creates that group.
REPL_SHARE_OF_TRAINER_MEMORY = 0.5


def repl_memory_budget(trainer_limit_bytes: int, ram_bytes: int, page_bytes: int = 4096) -> int | None:
    """The memory limit of `REPL_MEMORY_GROUP`: `REPL_SHARE_OF_TRAINER_MEMORY` of the trainer's memory limit (the
    trainer's group and its ancestors: ``hierarchical_memory_limit``), whole pages; None when the trainer's group
    is not limited below the machine's RAM (then the REPLs' own `memory_mb` and their OOM score protect it)."""
    if trainer_limit_bytes >= ram_bytes:
        return None
    return int(trainer_limit_bytes * REPL_SHARE_OF_TRAINER_MEMORY) // page_bytes * page_bytes


def repl_memory_parent(trainer_group: str) -> str:
    """The memory group REPL memory groups are created in: `REPL_MEMORY_GROUP` inside `trainer_group` (the cgroup
    v1 memory directory of the trainer's own group), created with `repl_memory_budget` as its limit (memory and
    memory+swap) unless it exists already (made by another trainer of the group, or by the operator with a budget
    of their own). So the REPLs' charge stays inside the trainer's group (its limit still holds them) but never
    takes more than the budget of it: the trainer keeps the rest.
    """
    path = os.path.join(trainer_group, REPL_MEMORY_GROUP)
    try:
        os.mkdir(path)
    except FileExistsError:
        return path
    try:
        with open(os.path.join(trainer_group, "memory.stat")) as handle:
            stats = dict(line.split() for line in handle if line.count(" ") == 1)
        page_bytes = os.sysconf("SC_PAGE_SIZE")
        ram_bytes = os.sysconf("SC_PHYS_PAGES") * page_bytes
        budget = repl_memory_budget(int(stats["hierarchical_memory_limit"]), ram_bytes, page_bytes)
        if budget is not None:
            for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):  # memory first: memsw >= memory
                if os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name), "w") as handle:
                        handle.write(str(budget))
    except BaseException:
        os.rmdir(path)  # never leave a group without its budget for the next REPL to find
        raise
    return path


class ControlGroups:
    """The cgroup v1 memory, pids, freezer (and cpu) groups of one interpreter life: the whole REPL, not each
    process, is limited, and it can be frozen between cells and killed as one."""

    def __init__(self, dirs: Mapping[str, str], limits: SandboxLimits) -> None:
        name = f"trl_ext_{os.getpid()}_{next(_cgroup_counter)}"
        self.paths: dict[str, str] = {}
        try:
            for controller, base in dirs.items():
                path = os.path.join(repl_memory_parent(base) if controller == "memory" else base, name)
                os.mkdir(path)
                self.paths[controller] = path
            memory = str(limits.memory_mb * 2**20)
            self._write("memory", "memory.limit_in_bytes", memory)
            if os.path.exists(os.path.join(self.paths["memory"], "memory.memsw.limit_in_bytes")):
                self._write("memory", "memory.memsw.limit_in_bytes", memory)  # no escape into swap
            self._write("pids", "pids.max", str(1 + limits.max_processes))
            if "cpu" in self.paths:
                self._write("cpu", "cpu.cfs_period_us", "100000")
                self._write("cpu", "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * 100_000))))
        except BaseException:
            self.remove()
            raise

    def _write(self, controller: str, name: str, value: str) -> None:
        with open(os.path.join(self.paths[controller], name), "w") as handle:
            handle.write(value)

    def _read(self, controller: str, name: str) -> str:
        with open(os.path.join(self.paths[controller], name)) as handle:
            return handle.read()

    def tasks(self) -> int:
        """Processes and threads in the group now."""
        return int(self._read("pids", "pids.current"))

    def freeze(self) -> None:
        self._write("freezer", "freezer.state", "FROZEN")

    def thaw(self) -> None:
        self._write("freezer", "freezer.state", "THAWED")

    def pids(self, controllers: Iterable[str] | None = None) -> set[int]:
        """The processes in the REPL's groups (of `controllers` only: its pids group holds them all, and is read
        faster than all four)."""
        found: set[int] = set()
        for controller in self.paths if controllers is None else set(controllers) & set(self.paths):
            try:
                found.update(int(line) for line in self._read(controller, "cgroup.procs").split())
            except OSError:
                continue
        return found

    def memory_peak_bytes(self) -> int:
        """Largest memory use of the REPL so far (all processes, tmpfs and memfd files, kernel memory)."""
        return int(self._read("memory", "memory.max_usage_in_bytes"))

    def out_of_memory(self) -> bool:
        """The kernel killed a process of the group for exceeding its memory limit."""
        if "memory" not in self.paths:
            return False
        try:
            for line in self._read("memory", "memory.oom_control").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1]) > 0
            return int(self._read("memory", "memory.failcnt")) > 0
        except (OSError, ValueError):
            return False

    def kill(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process of the groups (thawed first: a frozen task dies only once thawed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if "freezer" in self.paths:
                try:
                    self.thaw()
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Remove the (empty) groups; returns False when one is still busy after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for controller in list(self.paths):
            while True:
                try:
                    os.rmdir(self.paths[controller])
                except FileNotFoundError:
                    pass
                except OSError:
                    if time.monotonic() < deadline:
                        time.sleep(0.002)
                        continue
                    logger.warning("Could not remove the REPL control group %s", self.paths[controller])
                    return False
                del self.paths[controller]
                break
        return True
