"""The quickstart package's import surface: importing it, or the CLI, loads no heavy library."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_stays_light():
    """`trl-ext --help` and the quickstart package must not pull in the ML stack."""
    heavy = ("torch", "transformers", "trl", "datasets", "peft", "accelerate")
    code = (
        "import sys, trl_ext.cli, trl_ext.quickstart, trl_ext.quickstart.toy_task, trl_ext.quickstart.scripted_server;"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
