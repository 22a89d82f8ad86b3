"""What of the host's Python installation a sandbox may use: the interpreter's import directories, and the host
paths the namespace backend binds read-only into a REPL's root file system.

Threat model (docs/security.md, class 1): a sandbox imports from the interpreter's stdlib and site-packages only,
never from the trainer's ``sys.path`` (which may hold a project directory with secrets in it); a namespaced REPL
sees the system's programs and libraries and these directories, read-only, and nothing else of the host.
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
