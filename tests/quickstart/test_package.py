"""The quickstart package's import surface: the old module paths still work (deprecated), and importing the package
(as the CLI does at start-up) loads no heavy library."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import trl_ext.quickstart.scripted_server as scripted_server
import trl_ext.quickstart.toy_task as toy_task


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        ("trl_ext.toy_task", toy_task, ["make_toy_dataset", "exact_match_reward", "ToyTeacher", "TOY_SYSTEM_PROMPT"]),
        ("trl_ext.testing_server", scripted_server, ["ScriptedChatServer", "TextReply", "Reply", "_Handler"]),
    ],
)
def test_old_module_paths_warn_and_give_the_moved_objects(old, new, names, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1 and f"{old} moved to {new.__name__}" in messages[0]
    for name in names:  # public and private names alike, the very same objects
        assert getattr(alias, name) is getattr(new, name)
    assert alias.__all__ == new.__all__ and all(hasattr(new, name) for name in new.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        alias.no_such_name  # noqa: B018


def test_importing_the_package_stays_light():
    """`trl-ext --help` imports `trl_ext.quickstart` (for METHODS): the package must not pull in the ML stack."""
    heavy = ("torch", "transformers", "trl", "datasets", "peft", "accelerate")
    code = (
        "import sys, trl_ext.cli, trl_ext.quickstart, trl_ext.quickstart.toy_task, trl_ext.quickstart.scripted_server;"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
