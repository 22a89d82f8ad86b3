"""`trl_ext.callback_order`: a callback that asks to run before the loggers is moved right after DefaultFlowCallback,
in its order, whatever it is (the trainers know no monitor)."""

from types import SimpleNamespace

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from trl_ext.callback_order import put_before_loggers_where_asked


class Reporter(TrainerCallback):  # stands for WandbCallback / TrackioCallback
    pass


class Early(TrainerCallback):
    runs_before_loggers = True


def test_callbacks_that_ask_go_right_after_the_flow_callback_in_their_order():
    first, second, reporter, other = Early(), Early(), Reporter(), TrainerCallback()
    handler = CallbackHandler([DefaultFlowCallback(), reporter, first, other, second], None, None, None, None)
    put_before_loggers_where_asked(SimpleNamespace(callback_handler=handler))
    assert handler.callbacks[1:] == [first, second, reporter, other]
    put_before_loggers_where_asked(SimpleNamespace(callback_handler=handler))  # idempotent
    assert handler.callbacks[1:] == [first, second, reporter, other]
