"""Operating-system isolation for the REPL: who the sandboxed interpreter runs as, what it sees, how it dies.

`PythonREPL` (in `trl_ext.rlm.repl`) uses this package; it holds no REPL logic. The threat model and what each
backend guarantees are docs/security.md. One concern a module:

- `limits`: `SandboxLimits` (every limit and isolation setting), `SandboxArguments` (its fields as ``repl_<name>``
  trainer-config fields), the environment allow-list (no variable of the trainer reaches the sandbox unless listed
  or passed on purpose), `SandboxError`.
- `host`: what this host allows (`host_support`), the backend a `SandboxLimits` resolves to (`resolve_isolation`)
  and what its REPLs are isolated from (`isolation_report`).
- `identity`: private uids for REPLs of a root trainer (leased with an ``flock``), ``/proc`` scans of a uid's
  processes, killing them and removing their files.
- `cgroups`: `ControlGroups`, the memory, pids, freezer and cpu groups of one REPL.
- `runtime`: the interpreter's import directories and the host paths a namespaced REPL sees read-only.
- `backend`: the interface, `SandboxBackend`, `SandboxProcess`, `LaunchSpec`.
- `local`: `LocalBackend` (namespaces opt-in per `isolation`, a zygote, a supervisor per REPL), `select_backend`.
- `child`: the code that runs inside the sandbox (zygote, supervisor, confinement, seccomp, the server).

Nothing here is a substitute for a VM: a kernel exploit escapes all of it.
"""

from .backend import LaunchSpec, SandboxBackend, SandboxProcess, describe_exit
from .cgroups import ControlGroups
from .host import HostSupport, host_support, isolation_report, resolve_isolation
from .identity import (
    SHARED_WRITABLE_DIRS,
    UidLease,
    acquire_uid,
    count_tasks_of_uid,
    force_rmtree,
    kill_uid,
    processes_of_uid,
    remove_files_of_uid,
)
from .limits import (
    DEFAULT_SANDBOX_UIDS,
    ENV_ALLOWLIST,
    ISOLATION_MODES,
    SandboxArguments,
    SandboxError,
    SandboxLimits,
    sandbox_environment,
)
from .local import LocalBackend, LocalProcess, select_backend
from .runtime import NAMESPACE_HOME, RUNTIME_BIND_PATHS, interpreter_import_paths, runtime_paths

__all__ = [
    "DEFAULT_SANDBOX_UIDS",
    "ENV_ALLOWLIST",
    "ISOLATION_MODES",
    "NAMESPACE_HOME",
    "RUNTIME_BIND_PATHS",
    "SHARED_WRITABLE_DIRS",
    "ControlGroups",
    "HostSupport",
    "LaunchSpec",
    "LocalBackend",
    "LocalProcess",
    "SandboxArguments",
    "SandboxBackend",
    "SandboxError",
    "SandboxLimits",
    "SandboxProcess",
    "UidLease",
    "acquire_uid",
    "count_tasks_of_uid",
    "describe_exit",
    "force_rmtree",
    "host_support",
    "interpreter_import_paths",
    "isolation_report",
    "kill_uid",
    "processes_of_uid",
    "remove_files_of_uid",
    "resolve_isolation",
    "runtime_paths",
    "sandbox_environment",
    "select_backend",
]
