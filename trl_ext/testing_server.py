"""Deprecated: moved to `trl_ext.quickstart.scripted_server`; this alias goes in the next release.

``import trl_ext.testing_server`` still works (every name, the same objects) and emits a `DeprecationWarning`;
import from ``trl_ext.quickstart.scripted_server`` instead.
"""

from trl_ext.quickstart._moved import moved_module
from trl_ext.quickstart.scripted_server import *  # noqa: F403
from trl_ext.quickstart.scripted_server import __all__  # noqa: F401

__getattr__ = moved_module(__name__, "trl_ext.quickstart.scripted_server")
