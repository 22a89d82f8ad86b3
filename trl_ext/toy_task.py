"""Deprecated: moved to `trl_ext.quickstart.toy_task`; this alias goes in the next release.

``import trl_ext.toy_task`` still works (every name, the same objects) and emits a `DeprecationWarning`; import from
``trl_ext.quickstart.toy_task`` instead (reward paths in recipes: ``trl_ext.quickstart.toy_task:exact_match_reward``).
"""

import warnings
from typing import Any

from trl_ext.quickstart import toy_task as _moved
from trl_ext.quickstart.toy_task import *  # noqa: F403
from trl_ext.quickstart.toy_task import __all__  # noqa: F401

warnings.warn(
    "trl_ext.toy_task moved to trl_ext.quickstart.toy_task; import it from there (the old path goes in the next "
    "release).",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
