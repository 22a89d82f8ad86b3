"""Deprecated: moved to `trl_ext.quickstart.scripted_server`; this alias goes in the next release.

``import trl_ext.testing_server`` still works (every name, the same objects) and emits a `DeprecationWarning`;
import from ``trl_ext.quickstart.scripted_server`` instead.
"""

import warnings
from typing import Any

from trl_ext.quickstart import scripted_server as _moved
from trl_ext.quickstart.scripted_server import *  # noqa: F403
from trl_ext.quickstart.scripted_server import __all__  # noqa: F401

warnings.warn(
    "trl_ext.testing_server moved to trl_ext.quickstart.scripted_server; import it from there (the old path goes in "
    "the next release).",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
