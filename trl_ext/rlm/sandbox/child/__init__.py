"""The code that runs inside the sandbox (outside the trainer's process): the zygote, each REPL's supervisor and its
server. The trainer never imports the modules below; `server_code` compiles them into the one code object the
local backend sends to its zygote.

How it gets there: the zygote starts as ``python -I -S -B -c BOOT <read fd> <socket fd>`` and receives the compiled
code (marshal) as its first message, which `BOOT` executes. So these modules are standard library only (plus
ctypes for the system calls Python lacks) and must not import `trl_ext` (the sandbox cannot see the project's
source tree); they import each other with relative imports, which `server_code` drops: once sent they share one
namespace, so no two of them may define the same name. Their names keep a leading underscore: nothing here is an
API.

Wire protocol (both directions): a 4-byte big-endian length, then the payload. Parent -> child payloads are
pickles (the parent is trusted); child -> parent payloads are UTF-8 JSON objects, so the parent never unpickles
anything produced by model-written code.

Modules, in the order they are joined: `syscalls` (ctypes and Linux constants), `wire` (framed messages),
`confine` (control groups, namespaces, rlimits, privileges, import paths), `seccomp` (the syscall filter),
`landlock` (the process backend's file-system and network rules),
`server` (the REPL itself), `supervisor`, `zygote`, and `main` (the life of one REPL, step by step).
"""

from __future__ import annotations

import ast
import functools
import marshal
from pathlib import Path

__all__ = ["BOOT", "MODULES", "SERVER_FILENAME", "server_code"]

MODULES = ("syscalls", "wire", "confine", "seccomp", "landlock", "server", "supervisor", "zygote", "main")
# The filename of the server's frames in tracebacks, which the server leaves out of what the model reads.
SERVER_FILENAME = "<sandbox>"
# The only code given on the command line: it reads the length-prefixed server code and runs it.
BOOT = (
    "import marshal,os,sys\n"
    "def _read(n):\n"
    "    data = b''\n"
    "    while len(data) < n:\n"
    "        chunk = os.read(int(sys.argv[1]), n - len(data))\n"
    "        if not chunk: os._exit(0)\n"
    "        data += chunk\n"
    "    return data\n"
    "exec(marshal.loads(_read(int.from_bytes(_read(4), 'big'))))\n"
)


@functools.cache
def server_code() -> bytes:
    """The modules of `MODULES` joined into one code object (marshal), compiled once per trainer process so that an
    interpreter start skips compiling it.

    Raises:
        RuntimeError: a module imports `trl_ext`, or two modules define the same name (a bug in this package).
    """
    body: list[ast.stmt] = []
    defined_in: dict[str, str] = {}
    for module in MODULES:
        path = Path(__file__).with_name(f"{module}.py")
        for statement in ast.parse(path.read_text(), str(path)).body:
            if isinstance(statement, ast.ImportFrom) and statement.level > 0:
                continue  # a sibling module: its names are in the joined namespace already
            if _imports_trl_ext(statement):
                raise RuntimeError(f"{path} imports trl_ext, which the sandbox cannot see; use the standard library")
            for name in _defined_names(statement):
                if name in defined_in:
                    raise RuntimeError(
                        f"{name} is defined in both child/{defined_in[name]}.py and child/{module}.py, which share "
                        "one namespace in the sandbox; rename one of them"
                    )
                defined_in[name] = module
            body.append(statement)
    return marshal.dumps(compile(ast.Module(body=body, type_ignores=[]), SERVER_FILENAME, "exec"))


def _imports_trl_ext(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Import):
        return any(alias.name.split(".")[0] == "trl_ext" for alias in statement.names)
    return isinstance(statement, ast.ImportFrom) and (statement.module or "").split(".")[0] == "trl_ext"


def _defined_names(statement: ast.stmt) -> list[str]:
    """The module-level names `statement` defines (functions, classes, assigned names; imports excluded)."""
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
        return [statement.name]
    targets = statement.targets if isinstance(statement, ast.Assign) else []
    if isinstance(statement, ast.AnnAssign):
        targets = [statement.target]
    return [node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)]
