"""Deprecated: moved to `trl_ext.quickstart.toy_task`; this alias goes in the next release.

``import trl_ext.toy_task`` still works (every name, the same objects) and emits a `DeprecationWarning`; import from
``trl_ext.quickstart.toy_task`` instead (reward paths in recipes: ``trl_ext.quickstart.toy_task:exact_match_reward``).
"""

from trl_ext.quickstart._moved import moved_module
from trl_ext.quickstart.toy_task import *  # noqa: F403
from trl_ext.quickstart.toy_task import __all__  # noqa: F401

__getattr__ = moved_module(__name__, "trl_ext.quickstart.toy_task")
