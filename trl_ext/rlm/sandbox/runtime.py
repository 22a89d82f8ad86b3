"""What of the host's Python installation a sandbox may use: the interpreter's import directories, the host
paths the namespace backend binds read-only into a REPL's root file system, and the roots a process-backend REPL
may read beneath where the kernel has Landlock (`readable_roots`).

Threat model (docs/security.md, class 1): a sandbox imports from the interpreter's stdlib and site-packages only,
never from the trainer's ``sys.path`` (which may hold a project directory with secrets in it); a namespaced REPL
sees the system's programs and libraries and these directories, read-only, and nothing else of the host; a
process-backend REPL under Landlock reads only beneath its home and `readable_roots` (never the trainer's working
directory, the checkout, the run's output_dir or another REPL's home, wherever they lie).
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig


@functools.cache
def interpreter_import_paths() -> tuple[str, ...]:
    """The interpreter's stdlib, lib-dynload and site-packages directories, in import order."""
    paths = sysconfig.get_paths()
    candidates = [
        os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}{sys.version_info[1]}.zip"),
        paths["stdlib"],
        paths["platstdlib"],
        os.path.join(paths["stdlib"], "lib-dynload"),
        paths["purelib"],
        paths["platlib"],
        *site.getsitepackages(),
    ]
    ordered: list[str] = []
    for path in candidates:
        if os.path.isdir(path) and path not in ordered:
            ordered.append(path)
    return tuple(ordered)


# What the namespace backend shows of the host, read-only (when present): the system's programs and libraries and
# the few /etc files they read. The interpreter's own directories are added by `runtime_paths`.
RUNTIME_BIND_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/mime.types",
)
NAMESPACE_HOME = "/home/repl"


@functools.cache
def runtime_paths() -> tuple[str, ...]:
    """Host paths bound read-only into a namespaced REPL: the system paths above and the interpreter's own."""
    candidates = [*RUNTIME_BIND_PATHS, sys.base_prefix, *interpreter_import_paths()]
    chosen: list[str] = []
    for path in sorted({os.path.normpath(path) for path in candidates}, key=len):
        if path == "/" or any(path.startswith(parent.rstrip("/") + "/") for parent in chosen):
            continue  # already visible through a parent
        if os.path.lexists(path):
            chosen.append(path)
    return tuple(chosen)


# What a process-backend REPL may read beneath under Landlock (when present), besides its home and the Python
# installation (`readable_roots`): the system's programs, libraries, configuration and kernel interfaces, and the
# device files programs open (not all of /dev: /dev/shm and /dev/mqueue hold other processes' files).
SYSTEM_READ_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/sys", "/opt")
READABLE_DEVICES = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
)


@functools.cache
def readable_roots() -> tuple[str, ...]:
    """The directories (and a few files) a process-backend REPL may read, list and execute beneath where the kernel
    has Landlock, besides its own home: `SYSTEM_READ_ROOTS` and `READABLE_DEVICES`, the Python installation
    (``sys.prefix``, ``sys.base_prefix``, ``sys.exec_prefix``, ``sys.base_exec_prefix``, the interpreter's real
    directory) and its import directories (`interpreter_import_paths`: never the trainer's working directory, nor an editable
    install's checkout, which the sandbox does not import from), and what the system paths' symbolic links point to
    outside them (``/etc/resolv.conf`` -> ``/run/...``). Real paths (Landlock's rules hold inodes), existing ones
    only, none below another; never ``/``.
    """
    candidates = [
        *SYSTEM_READ_ROOTS,
        *READABLE_DEVICES,
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *interpreter_import_paths(),
    ]
    candidates += [path for path in RUNTIME_BIND_PATHS if os.path.islink(path)]  # their targets, by realpath below
    real = {os.path.realpath(path) for path in candidates if path and os.path.exists(path)}
    chosen: list[str] = []
    for path in sorted(real, key=len):
        if path == "/" or any(path.startswith(parent.rstrip("/") + "/") for parent in chosen):
            continue  # "/" would open everything; the others are visible through a parent
        chosen.append(path)
    return tuple(chosen)


def beneath(path: str, roots: tuple[str, ...] | list[str]) -> str | None:
    """The first of `roots` that `path` (made real) is or lies beneath, else None."""
    real = os.path.realpath(path)
    for root in roots:
        root = os.path.realpath(root)
        if real == root or real.startswith(root.rstrip("/") + "/"):
            return root
    return None
