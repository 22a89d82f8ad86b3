"""`tests/spawn_targets.py`, the module of the tests' spawn children's targets, imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "trl", "transformers", "accelerate", "peft", "openai", "datasets", "trl_ext")


def test_a_spawn_child_imports_only_the_standard_library_for_its_target():
    """What a spawned child imports to unpickle its target (``tests``, then ``tests.spawn_targets``), in a fresh
    interpreter: a heavy import there costs every child 15-25 s on a loaded host, more than a stop waits for it."""
    code = (
        "import sys, tests.spawn_targets;"
        f"print(sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r})))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
