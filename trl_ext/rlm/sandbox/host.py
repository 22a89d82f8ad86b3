"""What isolation this host allows (probed once per trainer process), which backend a `SandboxLimits` gets here
(`resolve_isolation`), and what its REPLs are isolated from (`isolation_report`, written to the run info).

Threat model (docs/security.md, "Backends and hosts"): ``isolation="auto"`` falls back to the process backend
where the host gives no namespaces, with one loud warning naming what is left open; ``"strict"`` refuses to start
instead. The report is what a user reads to know what a run's REPLs could reach.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .limits import SandboxError, SandboxLimits
from .runtime import beneath, readable_roots, runtime_paths

logger = logging.getLogger(__name__)

_NAMESPACE_PROBE = r"""
import ctypes, os, sys, tempfile
libc = ctypes.CDLL(None, use_errno=True)
def check(result, what):
    if result != 0:
        raise SystemExit(f"{what}: {os.strerror(ctypes.get_errno())}")
user = os.geteuid() != 0
uid, gid = os.getuid(), os.getgid()
check(libc.unshare((0x10000000 if user else 0) | 0x20000000), "unshare(user, pid)")
if user:
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
pid = os.fork()
if pid:
    raise SystemExit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
check(libc.unshare(0x00020000 | 0x40000000 | 0x08000000 | 0x04000000), "unshare(mount, net, ipc, uts)")
check(libc.mount(None, b"/", None, 16384 | (1 << 18), None), "make / private")
root = sys.argv[1]
check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", 6, b"size=1m"), "mount tmpfs")
os.mkdir(os.path.join(root, "proc"))
check(libc.mount(b"proc", os.path.join(root, "proc").encode(), b"proc", 14, None), "mount proc")
"""


@dataclass(frozen=True)
class HostSupport:
    """What this host lets the sandbox use (probed once per trainer process by `host_support`).

    Attributes:
        namespaces: None when new user/PID/mount/network namespaces and the mounts the namespace backend needs
            work here, else why not.
        cgroup_dirs: control-group controller ("memory", "pids", "freezer", "cpu") -> the directory REPL groups
            are created in (cgroup v1, under the trainer's own group); empty when not writable.
        cgroups: None when memory, pids and freezer groups can be created, else why not.
        seccomp: None when the syscall filter can be installed (x86_64 Linux), else why not.
        as_root: the trainer runs as root (REPLs then get private uids).
        landlock_abi: the kernel's Landlock ABI version (0: none); the process backend applies it (>= 1: writes
            beneath the REPL's home only, reads there and beneath `readable_roots` only; >= 4: TCP too, >= 6:
            signals and abstract sockets too).
    """

    namespaces: str | None
    cgroup_dirs: Mapping[str, str]
    cgroups: str | None
    seccomp: str | None
    as_root: bool
    landlock_abi: int = 0


_host_lock = threading.Lock()
_host: HostSupport | None = None


def host_support(refresh: bool = False) -> HostSupport:
    """Probe (once) what isolation this host allows."""
    global _host
    with _host_lock:
        if _host is None or refresh:
            _host = HostSupport(
                namespaces=_probe_namespaces(),
                cgroup_dirs=(dirs := _probe_cgroups()),
                cgroups=None if {"memory", "pids", "freezer"} <= set(dirs) else _cgroup_problem(dirs),
                seccomp=_probe_seccomp(),
                as_root=os.geteuid() == 0,
                landlock_abi=_probe_landlock(),
            )
        return _host


# A RAM-backed folder every Linux host mounts (tmpfs): namespaced REPLs' folders go there (`memory_folder`).
MEMORY_FOLDER = "/dev/shm"


@functools.cache
def memory_folder() -> str | None:
    """`MEMORY_FOLDER` when it is a tmpfs this process can create folders in, else None (then REPL folders go to the
    temporary folder).

    A namespaced REPL's folder on the host holds only the mount point of its own root file system and its start-up
    log, a few bytes. Creating and removing them on a disk file system (ext4's inode allocator) costs more CPU than any
    other step of a REPL's start; on a tmpfs it costs next to nothing.
    """
    try:
        with open("/proc/self/mounts") as mounts:
            fstype = {fields[1]: fields[2] for fields in (line.split() for line in mounts) if len(fields) > 2}
    except OSError:
        return None
    if fstype.get(MEMORY_FOLDER) != "tmpfs" or not os.access(MEMORY_FOLDER, os.W_OK | os.X_OK):
        return None
    return MEMORY_FOLDER


def _probe_namespaces() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    root = tempfile.mkdtemp(prefix="trl_ext_probe_")
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _NAMESPACE_PROBE, root], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]


def _probe_landlock() -> int:
    """The kernel's Landlock ABI version (``landlock_create_ruleset`` with the version flag), 0 when it has none."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    result = ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1)
    return max(int(result), 0)


def _probe_seccomp() -> str | None:
    if os.uname().machine != "x86_64":
        return f"the syscall filter is written for x86_64, this is {os.uname().machine}"
    try:
        with open("/proc/self/status") as handle:
            if "Seccomp:" not in handle.read():
                return "the kernel has no seccomp support"
    except OSError as exc:
        return str(exc)
    return None


def _cgroup_problem(dirs: Mapping[str, str]) -> str:
    if os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        return "the host uses cgroup v2 only, which trl-ext does not drive yet"
    missing = sorted({"memory", "pids", "freezer"} - set(dirs))
    return f"no writable cgroup v1 {', '.join(missing)} controller(s) (needs root and /sys/fs/cgroup mounted rw)"


def _probe_cgroups() -> dict[str, str]:
    """Writable cgroup v1 directories for the controllers the sandbox uses, under the trainer's own groups."""
    if os.geteuid() != 0:
        return {}
    try:
        with open("/proc/self/mounts") as handle:
            mounts = [line.split() for line in handle]
        with open("/proc/self/cgroup") as handle:
            memberships = [line.rstrip("\n").split(":", 2) for line in handle]
    except OSError:
        return {}
    own = {}
    for _hierarchy, controllers, path in memberships:
        for controller in controllers.split(","):
            own[controller] = path
    dirs = {}
    for _source, mountpoint, fstype, options, *_ in mounts:
        if fstype != "cgroup":
            continue
        for controller in set(options.split(",")) & {"memory", "pids", "freezer", "cpu"}:
            if controller in own and controller not in dirs:
                base = os.path.join(mountpoint, own[controller].lstrip("/"))
                probe = os.path.join(base, f"trl_ext_probe_{os.getpid()}")
                try:
                    os.mkdir(probe)
                    os.rmdir(probe)
                except OSError:
                    continue
                dirs[controller] = base
    return dirs


def resolve_isolation(limits: SandboxLimits) -> str:
    """The backend `limits` gets on this host: ``"namespace"`` or ``"process"``.

    Raises:
        SandboxError: ``isolation="strict"`` and namespaces are not available (the message says why).
    """
    host = host_support()
    if limits.isolation == "process":
        if limits.network is False:
            if host.landlock_abi >= 4:
                _warn_once(
                    "process-network",
                    "isolation='process' takes TCP away from model code (Landlock) but not UDP or unix sockets.",
                )
            else:
                _warn_once("process-network", "isolation='process' cannot take the network away from model code.")
        return "process"
    if host.namespaces is None:
        return "namespace"
    if limits.isolation == "strict":
        raise SandboxError(
            f"isolation='strict' needs Linux namespaces, which this host does not allow ({host.namespaces}). Run "
            "as root or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; a "
            "container needs CAP_SYS_ADMIN or a seccomp profile that allows unshare), or set isolation='auto' to "
            "accept the process backend."
        )
    _warn_once(
        "auto-fallback",
        f"REPL sandbox: Linux namespaces are not available here ({host.namespaces}); falling back to the process "
        f"backend. NOT isolated: {'; '.join(isolation_report(limits)['open'])}. Set isolation='strict' to refuse "
        "to start instead (docs/security.md).",
    )
    return "process"


def isolation_report(limits: SandboxLimits) -> dict[str, Any]:
    """What the REPLs of `limits` get on this host: ``{"repl/isolation", "isolated", "open"}`` (for run info)."""
    host = host_support()
    backend = "process" if limits.isolation == "process" or host.namespaces is not None else "namespace"
    isolated = ["environment (allow-list)", "rlimits per process"]
    opened = []
    if host.as_root:
        isolated.append("private uid per REPL (other REPLs, the trainer's processes)")
    else:
        opened.append("REPLs share the trainer's uid: model code can signal and read the trainer's processes")
    if backend == "namespace":
        isolated += ["file system (runtime read-only, private home, /tmp, /dev/shm)", "PID namespace"]
        if limits.network:
            opened.append("the network (network=True: model code reaches the host's services)")
        else:
            isolated.append("network")
    else:
        if host.landlock_abi > 0:
            isolated.append(f"writes only beneath the REPL's home (Landlock ABI {host.landlock_abi})")
            isolated.append(
                "reads only beneath the REPL's home and the runtime (system directories, the Python installation: "
                "readable_roots), not the run's output_dir, the checkout or /tmp (Landlock)"
            )
            opened.append(
                "the runtime's directories to read (/usr, /etc, /opt, /proc, /sys, the Python installation): "
                "every world-readable file there, every process's /proc/<pid>/cmdline"
            )
        else:
            opened.append("the host file system to read (world-readable files: datasets, checkpoints, rollout trees)")
            opened.append("/tmp and /dev/shm are the host's to write (files of a closed REPL are deleted, not hidden)")
        if host.landlock_abi >= 4 and not limits.network:
            isolated.append("TCP connect and bind (Landlock)")
            opened.append("UDP and unix sockets of the host (not TCP)")
        else:
            opened.append("the network and local services (e.g. trl vllm-serve's weight-update endpoints)")
        if host.landlock_abi >= 6:
            isolated.append("signals and abstract unix sockets outside the REPL (Landlock scopes)")
    if host.cgroups is None:
        isolated.append("per-REPL memory, processes, CPU, freezing between cells (control groups)")
    else:
        opened.append(
            f"limits are per process, not per REPL ({host.cgroups}); REPLs are frozen with stop signals, which a "
            "process a cell started can dodge while a query is answered by leaving the server's process group"
        )
    if backend == "process":
        if host.landlock_abi > 0:
            isolated.append("disk_mb for the REPL's whole home (measured during and after each cell; stopped past it)")
        else:
            opened.append(
                "disk use is capped per file, not per REPL: the home is measured, but /tmp and /dev/shm are writable"
            )
        if not (host.namespaces is None and host.as_root):  # else each REPL gets SysV IPC and ptys of its own
            opened.append(
                "SysV IPC and ptys are the host's: concurrent REPLs can talk through SysV objects, and a REPL can "
                "take every pty while a cell runs"
            )
    if host.seccomp is None:
        isolated.append("no_new_privs and a syscall filter (namespaces, mount, ptrace, keyctl, bpf...)")
    else:
        isolated.append("no_new_privs")
        opened.append(f"no syscall filter ({host.seccomp})")
    return {"repl/isolation": backend, "isolated": isolated, "open": opened}


def repl_can_read(path: str, limits: SandboxLimits | None = None) -> bool:
    """Whether the sandbox lets model code in a REPL of `limits` (default: `SandboxLimits()`) on this host read
    `path` (file permissions aside, which still apply). A pure check, without a REPL or a warning.

    The namespace backend shows a REPL only its runtime (`runtime_paths`, read-only) and its own tmpfs; the process
    backend under Landlock lets it read only beneath its home and `readable_roots`; without Landlock, everything.
    A trainer asks it of its ``output_dir`` (rollout trees, ``rollout_state.json``, the weight index).
    """
    limits = limits or SandboxLimits()
    host = host_support()
    if limits.isolation != "process" and host.namespaces is None:
        return beneath(path, runtime_paths()) is not None
    if host.landlock_abi > 0:
        return beneath(path, readable_roots()) is not None
    return True


def run_exposure(limits: SandboxLimits, output_dir: str | None) -> list[str]:
    """What of a training run a REPL of `limits` on this host can reach, in words (empty: nothing): the run's
    `output_dir` (`repl_can_read`) and the served policy's endpoints over loopback TCP (the process backend without
    Landlock ABI 4, or ``network=True``), which with disk weight sync include vLLM's dev-mode endpoints
    (``POST /v1/load_lora_adapter``: model code could choose the weights it is sampled from)."""
    host = host_support()
    namespace = limits.isolation != "process" and host.namespaces is None
    exposed = []
    if output_dir is not None and repl_can_read(output_dir, limits):
        if namespace:
            where = "it lies in the runtime the namespace backend shows its REPLs"
        elif host.landlock_abi > 0:
            where = f"it lies beneath {beneath(output_dir, readable_roots())}, which REPLs may read (readable_roots)"
        else:
            where = "the process backend without Landlock leaves the whole host file system readable"
        exposed.append(
            f"output_dir {os.path.realpath(output_dir)} (rollout trees, rollout_state.json, the weight index): {where}"
        )
    if limits.network:
        exposed.append("the network (network=True): the served policy's endpoints, dev-mode weight loading included")
    elif not namespace and host.landlock_abi < 4:
        why = "no Landlock in this kernel" if host.landlock_abi == 0 else f"Landlock ABI {host.landlock_abi} < 4"
        exposed.append(
            f"loopback TCP ({why}): the served policy's endpoints, dev-mode weight loading "
            "(POST /v1/load_lora_adapter) included"
        )
    return exposed


def warn_run_exposure(limits: SandboxLimits, output_dir: str | None, trainer: str) -> list[str]:
    """Warn once, loudly, when REPLs of `limits` can reach the run of `trainer` (`run_exposure`), naming what and
    the fix; returns what is exposed."""
    exposed = run_exposure(limits, output_dir)
    if exposed:
        _warn_once(
            f"run-exposure:{trainer}:{exposed}",
            f"{trainer}: the REPL sandbox cannot keep model code from this run: it can reach "
            f"{'; '.join(exposed)}. Fix: isolation='strict' on a host with Linux namespaces, or, for the process "
            "backend, a kernel with Landlock ABI >= 4 (Linux 6.7+), network=False and an output_dir outside "
            f"the roots REPLs may read ({', '.join(readable_roots())}) (docs/security.md, 'Backends and hosts').",
        )
    return exposed


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
