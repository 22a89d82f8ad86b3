"""The sandbox's backend seam: the engine passes the backend its config selects (or the caller's own) to every REPL,
`PythonREPL` asks the backend instead of branching on its name, and the code sent into the sandbox is one
standard-library code object joined from `trl_ext.rlm.sandbox.child`."""

from __future__ import annotations

import ast
import marshal
from pathlib import Path

import pytest

from trl_ext.rlm import PythonREPL, RLMEngine, RLMScaffoldConfig, SandboxLimits, ScriptedGenerator
from trl_ext.rlm.sandbox import LaunchSpec, LocalBackend, SandboxBackend, SandboxProcess, UidLease, select_backend
from trl_ext.rlm.sandbox import child as child_code
from trl_ext.testing import build_tiny_tokenizer


class RecordingBackend(SandboxBackend):
    """The local process backend under another name, recording what the REPLs ask of it."""

    name = "recording"

    def __init__(self) -> None:
        self.local = LocalBackend(namespace=False)
        self.shared_dirs = self.local.shared_dirs
        self.started: list[LaunchSpec] = []

    def environment(self, home: str, extra):
        return {**self.local.environment(home, extra), "BACKEND": self.name}

    def prepare(self, root_dir: str, lease: UidLease | None) -> str:
        return self.local.prepare(root_dir, lease)

    def start(self, spec: LaunchSpec) -> SandboxProcess:
        self.started.append(spec)
        return self.local.start(spec)


def test_a_repl_runs_on_the_backend_it_is_given_and_asks_it_for_its_environment():
    backend = RecordingBackend()
    with PythonREPL("ctx", backend=backend, timeout_s=5) as repl:
        assert repl.isolation == "recording"
        assert repl.execute("import os; print(os.environ['BACKEND'], context)").stdout == "recording ctx\n"
        assert repl.execute("while True: pass").timed_out
        assert repl.execute("print(1)").restarted  # the restart goes through the same backend
    assert len(backend.started) == 2 and backend.started[0].limits.timeout_s == 5


def test_the_engine_passes_the_backend_its_config_selects_or_the_callers_own():
    tokenizer = build_tiny_tokenizer()
    action = "```repl\nimport os\nanswer = os.environ.get('BACKEND', 'local')\nFINAL_VAR('answer')\n```"
    policy = ScriptedGenerator(lambda prompt: action, tokenizer)
    config = RLMScaffoldConfig(max_turns=1, sandbox=SandboxLimits(timeout_s=5))
    default = RLMEngine(policy, tokenizer, config)
    assert default.sandbox_backend is select_backend(config.sandbox)
    assert [tree.final_answer for tree in default.run(["a"])] == ["local"]

    backend = RecordingBackend()
    engine = RLMEngine(policy, tokenizer, config, sandbox_backend=backend)
    assert [tree.final_answer for tree in engine.run(["a", "b"])] == ["recording", "recording"]
    assert len(backend.started) == 2
    with pytest.raises(TypeError, match="sandbox_backend must be a SandboxBackend, got str"):
        RLMEngine(policy, tokenizer, config, sandbox_backend="process")


def test_the_sandbox_code_is_one_standard_library_code_object():
    code = marshal.loads(child_code.server_code())
    assert code.co_filename == child_code.SERVER_FILENAME
    for module in child_code.MODULES:
        tree = ast.parse((Path(child_code.__file__).parent / f"{module}.py").read_text())
        assert not any(child_code._imports_trl_ext(statement) for statement in tree.body), module
        assert not any(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in tree.body)
    names = [
        child_code._defined_names(statement)
        for statement in ast.parse("def f(): pass\n_A, (_B, _C) = 1, (2, 3)\nimport os").body
    ]
    assert names == [["f"], ["_A", "_B", "_C"], []]
