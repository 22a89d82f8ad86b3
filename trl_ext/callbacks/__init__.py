"""Training monitors (the loss's trust-region metric, entropy and KL, reward, an asynchronous run's staleness) and
the run-health plot (docs/monitoring.md).

- `trl_ext.callbacks.configs`: the monitors' settings (``*MonitorConfig``) and their validation.
- `trl_ext.callbacks.rules`: the rules as pure functions over metric series, one module a monitor.
- `trl_ext.callbacks.alerts`: the alert texts as data (meaning, what to check, message template).
- `trl_ext.callbacks.base`: `MonitorCallback`, the engine every monitor shares (episodes, actions, state).
- `trl_ext.callbacks.monitors`: the `TrainerCallback`s that feed the logs to the rules and act on the alerts.
- `trl_ext.callbacks.plotting`: `plot_run`, one PNG of a run's health.

Names resolve lazily: `plot_run` (and the ``trl-ext plot`` command) do not import transformers, and the monitors
do not import matplotlib.
"""

from importlib import import_module
from typing import Any

# public name -> module that defines it
_LAZY = {
    "ClipRateMonitor": "trl_ext.callbacks.monitors",
    "EntropyMonitor": "trl_ext.callbacks.monitors",
    "RewardMonitor": "trl_ext.callbacks.monitors",
    "StalenessMonitor": "trl_ext.callbacks.monitors",
    "MonitorCallback": "trl_ext.callbacks.base",
    "default_monitors": "trl_ext.callbacks.monitors",
    "add_monitors": "trl_ext.callbacks.monitors",
    "MonitorAlert": "trl_ext.callbacks.alerts",
    "ALERTS": "trl_ext.callbacks.alerts",
    "ClipRateMonitorConfig": "trl_ext.callbacks.configs",
    "EntropyMonitorConfig": "trl_ext.callbacks.configs",
    "RewardMonitorConfig": "trl_ext.callbacks.configs",
    "StalenessMonitorConfig": "trl_ext.callbacks.configs",
    "plot_run": "trl_ext.callbacks.plotting",
    "find_trainer_state": "trl_ext.callbacks.plotting",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_ext.callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
