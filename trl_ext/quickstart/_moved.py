"""The deprecated aliases of modules that moved into `trl_ext.quickstart` (``trl_ext.toy_task``,
``trl_ext.testing_server``): one warning and one attribute fallback for both."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_module(old: str, new: str) -> Callable[[str], Any]:
    """Warn that module ``old`` moved to ``new`` (a `DeprecationWarning` pointing at the importer) and return the
    module ``__getattr__`` that serves every other name of ``new`` (private ones included) from the old path.

    Call it once in the old module's body, after ``from <new> import *`` and ``from <new> import __all__``::

        __getattr__ = moved_module(__name__, "trl_ext.quickstart.toy_task")
    """
    target = importlib.import_module(new)
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in the next release).",
        DeprecationWarning,
        stacklevel=3,  # this function, the old module's body, then the importer (import machinery is skipped)
    )

    def __getattr__(name: str) -> Any:
        return getattr(target, name)

    return __getattr__
