"""What a sandbox must give: every limit and isolation setting of a REPL (`SandboxLimits`, and `SandboxArguments`,
its fields as trainer-config fields), the environment allow-list, and `SandboxError`, raised when a host cannot
give them.

Threat model (docs/security.md): the limits bound what model code may consume (memory, processes, CPU, disk,
descriptors, output, message sizes) and choose how far it is isolated; the environment allow-list keeps every
variable of the trainer (tokens, keys) out of the sandbox unless passed on purpose.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ...fields import documented, mirror_field

# account; the range sits far above the uids distributions give to people and services.
DEFAULT_SANDBOX_UIDS = range(1_900_000_000, 1_900_000_000 + 65_536)

# Variables copied from the trainer's environment when set. Everything else is dropped.
ENV_ALLOWLIST = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ")

# Variables the sandbox always gets: a minimal PATH, a private HOME/TMPDIR, and single-threaded numeric
# libraries (each thread counts against the process limit, each malloc arena against the address space).
_FIXED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
}

ISOLATION_MODES = ("auto", "strict", "process")


class SandboxError(RuntimeError):
    """The sandbox could not be set up (missing isolation tool, unmapped uids, interpreter failed to start)."""


def sandbox_environment(home: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The complete environment of a sandboxed interpreter.

    Args:
        home: the sandbox's working directory, used as ``HOME`` and ``TMPDIR``.
        extra: variables to pass on purpose (e.g. a helper's configuration). Never put secrets here: model code
            can read and print every variable it gets.
    """
    env = dict(_FIXED_ENV)
    env.update({name: os.environ[name] for name in ENV_ALLOWLIST if name in os.environ})
    env.update(HOME=home, TMPDIR=home)
    for name, value in (extra or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"env must map str to str, got {name!r}: {value!r}")
        env[name] = value
    return env


@dataclass(frozen=True)
class SandboxLimits:
    """Every limit and isolation setting of a sandboxed REPL, in one place.

    `PythonREPL`, the judge's Python tools and the RLM engine all take one of these; the trainer configs expose
    each field as ``repl_<name>`` (see `SandboxArguments`). docs/security.md says what each backend enforces.
    """

    isolation: str = documented(
        "auto",
        "'auto': namespaces when the host allows them (no network, private file system and processes), else the "
        "process backend with a warning naming what is not isolated; 'strict': namespaces or refuse to start; "
        "'process': no namespaces.",
    )
    network: bool = documented(
        False,
        "Give model code the host's network. It then reaches every service the trainer can, including the "
        "unauthenticated endpoints of `trl vllm-serve` that replace the policy's weights. Namespaces only.",
    )
    timeout_s: float = documented(
        10.0,
        "Wall-clock limit of one cell, not counting the time it waits for query answers (the RLM scaffold's "
        "max_cell_query_time_s and the other max_cell_query* limits bound a cell's queries).",
    )
    startup_timeout_s: float = documented(30.0, "Time allowed for a REPL to start and load its context and helpers.")
    memory_mb: int = documented(
        1024,
        "Memory of one REPL: all its processes together with its /tmp, /dev/shm and memfd files (control group), "
        "and the address space of each process.",
    )
    max_processes: int = documented(32, "Processes and threads model code may create in one REPL.")
    cpus: float = documented(1.0, "CPU cores one REPL may use at once (control group quota).")
    cpu_time_s: float | None = documented(
        None, "CPU time of each process of a REPL over its life; None: 20 x timeout_s."
    )
    disk_mb: int = documented(
        256, "Writable space of one REPL: its home, /tmp and /dev/shm together; also the largest file."
    )
    max_open_files: int = documented(256, "Open file descriptors per process.")
    max_output_chars: int = documented(20_000, "Characters of a cell's output kept (the rest is counted in a note).")
    max_answer_chars: int = documented(100_000, "Longest final answer accepted; longer ones are cut and counted.")
    max_message_bytes: int = documented(64 * 2**20, "Largest message accepted from a REPL (a query or a result).")
    sandbox_uids: range = documented(
        DEFAULT_SANDBOX_UIDS, "Unprivileged uids leased to REPLs when the trainer is root."
    )

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}")
        if not isinstance(self.network, bool):
            raise TypeError(f"network must be True or False, got {self.network!r}")
        for name in ("timeout_s", "startup_timeout_s", "cpus"):
            _check_positive_number(name, getattr(self, name))
        if self.cpu_time_s is not None:
            _check_positive_number("cpu_time_s", self.cpu_time_s)
        minimums = {"memory_mb": 64, "max_processes": 0, "disk_mb": 1, "max_open_files": 16}
        minimums.update(max_output_chars=1, max_answer_chars=1, max_message_bytes=1024)
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                hint = " (the interpreter alone needs ~30 MB)" if name == "memory_mb" else ""
                raise ValueError(f"{name} must be an int >= {minimum}{hint}, got {value!r}")
        uids = self.sandbox_uids
        if not isinstance(uids, range) or len(uids) == 0 or uids.step != 1 or uids.start < 1000:
            raise ValueError(f"sandbox_uids must be a non-empty range of uids >= 1000 with step 1, got {uids!r}")

    @property
    def cpu_time_limit_s(self) -> float:
        return self.cpu_time_s if self.cpu_time_s is not None else 20 * self.timeout_s

    def with_overrides(self, **overrides: Any) -> SandboxLimits:
        """A copy with some fields changed; unknown names raise a `TypeError` that lists the valid ones."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"Unknown sandbox limit(s) {unknown}; valid: {[f.name for f in fields(self)]}")
        return replace(self, **overrides) if overrides else self


def _argument(name: str) -> Any:
    return mirror_field(SandboxLimits, name, "REPL sandbox")


@dataclass
class SandboxArguments:
    """The `SandboxLimits` fields as trainer-config fields (``repl_<name>``), so that each is one command-line flag
    or recipe key. Mixed into the configs of the trainers that run model or judge code."""

    repl_isolation: str = _argument("isolation")
    repl_network: bool = _argument("network")
    repl_timeout_s: float = _argument("timeout_s")
    repl_startup_timeout_s: float = _argument("startup_timeout_s")
    repl_memory_mb: int = _argument("memory_mb")
    repl_max_processes: int = _argument("max_processes")
    repl_cpus: float = _argument("cpus")
    repl_cpu_time_s: float | None = _argument("cpu_time_s")
    repl_disk_mb: int = _argument("disk_mb")
    repl_max_open_files: int = _argument("max_open_files")
    repl_max_output_chars: int = _argument("max_output_chars")
    repl_max_answer_chars: int = _argument("max_answer_chars")
    repl_max_message_bytes: int = _argument("max_message_bytes")

    def sandbox_limits(self) -> SandboxLimits:
        """The `SandboxLimits` these fields describe (raises the limit's own `ValueError` for a bad value)."""
        return SandboxLimits(**{f.name[len("repl_") :]: getattr(self, f.name) for f in fields(SandboxArguments)})


def _check_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
