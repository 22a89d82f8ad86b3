"""Callbacks that must run before the loggers: the one rule of where they go in a trainer's callback list.

`transformers.Trainer` calls its callbacks in order and puts the reporting integrations (wandb, trackio, tensorboard,
...) before the ones passed as ``callbacks=``. A callback that adds keys to a log (a monitor's
``monitor/alerts/<rule>``) must run ahead of them, or those keys reach no tracker. Such a callback says so with a
class attribute ``runs_before_loggers = True`` (the trl-ext monitors do); `put_before_loggers` moves callbacks right
after `DefaultFlowCallback`. The trl-ext trainers call `put_before_loggers_where_asked` once built, so a monitor passed
as ``callbacks=`` is in place without the trainers knowing any monitor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.trainer_callback import DefaultFlowCallback

__all__ = ["put_before_loggers", "put_before_loggers_where_asked"]


def put_before_loggers(handler: Any, callbacks: Sequence[Any]) -> None:
    """Move (or insert) ``callbacks``, in their order, right after the handler's `DefaultFlowCallback` (first when
    it has none), ahead of the loggers."""
    handler.callbacks = [cb for cb in handler.callbacks if not any(cb is moved for moved in callbacks)]
    flow = [index for index, cb in enumerate(handler.callbacks) if isinstance(cb, DefaultFlowCallback)]
    position = flow[-1] + 1 if flow else 0
    handler.callbacks[position:position] = list(callbacks)


def put_before_loggers_where_asked(trainer: Any) -> None:
    """Put the trainer's callbacks that set ``runs_before_loggers`` ahead of the loggers (`put_before_loggers`)."""
    handler = trainer.callback_handler
    early = [cb for cb in handler.callbacks if getattr(cb, "runs_before_loggers", False)]
    if early:
        put_before_loggers(handler, early)
