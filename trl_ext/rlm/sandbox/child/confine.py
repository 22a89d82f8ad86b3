"""Inside the sandbox: confining the REPL before it runs model code: the first choice of the kernel's OOM killer,
control groups, namespaces and a root file system showing only the runtime (its ``/proc`` read-only), rlimits, the
privilege drop (private uid, or no capabilities in a user namespace), and imports from the interpreter's
directories only.

Threat model (docs/security.md, classes 1, 2, 4 and 7): each step takes something away from model code for good;
`trl_ext.rlm.sandbox.child.main` runs them in order, while the process still has the privileges to.
"""

import os
import resource
import sys

from .syscalls import (
    _CLONE_NEWIPC,
    _CLONE_NEWNET,
    _CLONE_NEWNS,
    _CLONE_NEWUTS,
    _MNT_DETACH,
    _MS_BIND,
    _MS_NODEV,
    _MS_NOEXEC,
    _MS_NOSUID,
    _MS_PRIVATE,
    _MS_RDONLY,
    _MS_REC,
    _MS_REMOUNT,
    _SYS_CAPSET,
    _SYS_PIVOT_ROOT,
    _c,
    _check,
    _write_file,
)

_PATH_ALIASES = {}  # "/proc/self/fd/<n>" -> the import directory it stands for, for tracebacks
_OOM_SCORE_ADJ_MAX = 1000  # the kernel's OOM killer picks a process with this score before any process without


def _volunteer_as_oom_victim():
    """Make this process, and every process it will start, the kernel OOM killer's first choice.

    The score is inherited by every fork, so the supervisor, the server and anything model code starts all carry
    it: when memory runs out, in a control group that also holds the trainer or on the whole machine, a REPL
    process dies, never the trainer (class 4). Written by a root process (root trainers), the score also becomes
    the lowest one the process and its children may set without ``CAP_SYS_RESOURCE``, which model code never has;
    in a user namespace (non-root trainers) the sandbox's ``/proc`` is read-only, so there is no file to lower it
    through either (`_enter_namespaces`).
    """
    _write_file("/proc/self/oom_score_adj", str(_OOM_SCORE_ADJ_MAX))


def _join_cgroups(paths):
    """Move this process into the REPL's control groups, before it starts anything: its children and threads inherit
    them. It has one thread here, so writing ``0`` (itself) to ``tasks`` moves the whole process; that write skips the
    kernel's global thread-group lock that a write to ``cgroup.procs`` takes, whose first taker waits a full RCU
    grace period (8-20 ms a start, measured on a 2-core host, against 0.3 ms)."""
    for path in paths:
        _write_file(os.path.join(path, "tasks"), "0")


def _enter_namespaces(config):
    """New mount, IPC, UTS (and network) namespaces with a root file system that shows only the runtime."""
    flags = _CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS | (0 if config["network"] else _CLONE_NEWNET)
    _check(_c().unshare(flags), "unshare")
    mount = _c().mount
    _check(mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    root = config["rootfs"]
    options = f"size={config['disk_mb']}m,nr_inodes={max(1024, config['disk_mb'] * 64)},mode=0755"
    _check(mount(b"tmpfs", root.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()), "mount tmpfs")

    def inside(path):
        return os.path.join(root, path.lstrip("/"))

    def bind(source, writable=False):
        target = inside(source)
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _check(mount(source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None), f"bind {source}")
        if not writable:
            flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID
            _check(mount(None, target.encode(), None, flags | _MS_NODEV, None), f"read-only {source}")

    for path in config["bind_paths"]:
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(path), inside(path))
        elif os.path.exists(path):
            bind(path)
    for name in ("null", "zero", "full", "random", "urandom"):
        bind(f"/dev/{name}", writable=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, inside(f"/dev/{name}"))
    for path in ("/tmp", "/dev/shm"):
        os.makedirs(inside(path), exist_ok=True)
        os.chmod(inside(path), 0o1777)
    home = inside(config["home"])
    os.makedirs(home, exist_ok=True)
    os.makedirs(inside("/proc"), exist_ok=True)
    if config["uid"] is not None:
        os.chown(home, config["uid"], config["gid"])
    os.chmod(home, 0o700)
    # This process is PID 1 of the new PID namespace, so this /proc shows only the sandbox. It is mounted while the
    # host's /proc is still in view: inside a user namespace the kernel allows a proc mount only then. Read-only:
    # model code must not write its processes' settings there (it would lower its OOM score first).
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY
    _check(mount(b"proc", inside("/proc").encode(), b"proc", flags, None), "mount /proc")
    os.chdir(root)
    _check(_c().syscall(_SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_c().umount2(b".", _MNT_DETACH), "detach the old root")
    os.chdir("/")


def _drop_capabilities():
    """Clear every capability (the root of a user namespace has them all inside it)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(_c().syscall(_SYS_CAPSET[os.uname().machine], header, data), "capset")


def _open_import_dirs(paths):
    opened = []
    for path in paths:
        try:
            opened.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
        except OSError:
            continue
    return opened


def _apply_limits(limits):
    for name, value in limits.items():
        if value is not None:
            resource.setrlimit(getattr(resource, name), (value, value))


def _drop_privileges(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise RuntimeError("privilege drop failed")


def _rewrite_import_paths(opened):
    """Use /proc/self/fd/<n> for import directories the (new) uid cannot traverse by name."""
    mapping = {}
    for path, fd in opened:
        if os.access(path, os.R_OK | os.X_OK):
            os.close(fd)
        else:
            mapping[path] = f"/proc/self/fd/{fd}"
            _PATH_ALIASES[mapping[path]] = path

    def remap(entry):
        for path, replacement in mapping.items():
            if entry == path or entry.startswith(path + os.sep):
                return replacement + entry[len(path) :]
        return entry

    sys.path[:] = [remap(path) for path, _ in opened]
    for module in list(sys.modules.values()):
        package_path = getattr(module, "__path__", None)
        if isinstance(package_path, list):
            package_path[:] = [remap(entry) for entry in package_path]
    sys.path_importer_cache.clear()
