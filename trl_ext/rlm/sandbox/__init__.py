"""Operating-system isolation for the REPL: who the sandboxed interpreter runs as, what it sees, how it dies.

`PythonREPL` (in `trl_ext.rlm.repl`) uses this package; it holds no REPL logic. The threat model and what each
backend guarantees are docs/security.md. One concern a module:

- `limits`: `SandboxLimits` (every limit and isolation setting), `SandboxArguments` (its fields as ``repl_<name>``
  trainer-config fields), the environment allow-list (no variable of the trainer reaches the sandbox unless listed
  or passed on purpose), `SandboxError`.
- `host`: what this host allows (`host_support`), the backend a `SandboxLimits` resolves to (`resolve_isolation`),
  what its REPLs are isolated from (`isolation_report`), whether they may read a path (`repl_can_read`) and what
  of a training run they can reach (`run_exposure`, `warn_run_exposure`).
- `disk`: the process backend's disk budget, measured from outside (`measure_home`).
- `identity`: private uids for REPLs of a root trainer (leased with an ``flock``), ``/proc`` scans of a uid's
  processes, killing them and removing their files.
- `cgroups`: `ControlGroups`, the memory, pids, freezer and cpu groups of one REPL.
- `runtime`: the interpreter's import directories, the host paths a namespaced REPL sees read-only, and the roots a
  process-backend REPL may read beneath under Landlock (`readable_roots`).
- `backend`: the interface, `SandboxBackend`, `SandboxProcess`, `LaunchSpec`.
- `local`: `LocalBackend` (namespaces opt-in per `isolation`, a zygote, a supervisor per REPL), `select_backend`.
- `child`: the code that runs inside the sandbox (zygote, supervisor, confinement, seccomp, the server).

Nothing here is a substitute for a VM: a kernel exploit escapes all of it.
"""

from .backend import LaunchSpec, SandboxBackend, SandboxProcess, describe_exit
from .cgroups import ControlGroups
from .disk import DiskUsage, disk_file_limit, measure_home
from .host import (
    HostSupport,
    host_support,
    isolation_report,
    repl_can_read,
    resolve_isolation,
    run_exposure,
    warn_run_exposure,
)
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
from .runtime import (
    NAMESPACE_HOME,
    RUNTIME_BIND_PATHS,
    SYSTEM_READ_ROOTS,
    interpreter_import_paths,
    readable_roots,
    runtime_paths,
)

__all__ = [
    "DEFAULT_SANDBOX_UIDS",
    "ENV_ALLOWLIST",
    "ISOLATION_MODES",
    "NAMESPACE_HOME",
    "RUNTIME_BIND_PATHS",
    "SHARED_WRITABLE_DIRS",
    "SYSTEM_READ_ROOTS",
    "ControlGroups",
    "DiskUsage",
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
    "disk_file_limit",
    "force_rmtree",
    "host_support",
    "interpreter_import_paths",
    "isolation_report",
    "kill_uid",
    "measure_home",
    "processes_of_uid",
    "readable_roots",
    "remove_files_of_uid",
    "repl_can_read",
    "resolve_isolation",
    "run_exposure",
    "runtime_paths",
    "sandbox_environment",
    "select_backend",
    "warn_run_exposure",
]
