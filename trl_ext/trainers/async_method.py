"""`AsyncMethodTrainer`: how the asynchronous method trainers (stepwise RLM, judge credit, RLMT) are built.

Each of them is `ExtAsyncGRPOTrainer` with its own rollout worker (a `ThreadedRolloutWorker`, a thread of this
process) in place of TRL's spawned one. What they share when they are built lives here: the config check (and the
default config), the refusal of TRL's ``tools`` / ``environment_factory``, the dataset's ``prompt`` column, the
tokenizer, the worker built unless one is passed, the served policy given to it once TRL knows how it syncs the
weights, and the collator TRL's dataloader is built with. A method's trainer keeps what is its own: its config class
and messages (class attributes), its worker's construction (`build_rollout_worker`) and the hooks it needs.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from transformers import AutoTokenizer

from .async_worker import callable_reward_funcs, groups_per_run, install_served_generator
from .ext_async_grpo import ExtAsyncGRPOTrainer
from .local_policy import pair_local_policy

__all__ = ["AsyncMethodTrainer"]


class AsyncMethodTrainer(ExtAsyncGRPOTrainer):
    """`ExtAsyncGRPOTrainer` with a trl-ext method's own rollout worker: the construction the method trainers share.

    Arguments as `ExtAsyncGRPOTrainer`'s (``generator``: a `trl_ext.rlm.Generator` the method's worker samples with
    instead of the served policy, e.g. `LocalPolicy`; tests use a scripted one), plus ``rollout_worker`` (a worker to
    use instead of the method's). Construction, in order: ``args`` checked (`config_class`; ``None`` gets the default config when the
    method has one), TRL's ``tools`` / ``environment_factory`` refused (`tools_error`), the ``prompt`` column checked
    (`dataset_error`), `method_inputs`, `set_up_method`, the tokenizer (``AutoTokenizer`` of ``model`` unless
    ``processing_class`` is given), `build_rollout_worker` (unless ``rollout_worker`` is given), TRL's
    ``__init__``, the served policy for the method's own worker (`served_generator_options`), `finish_set_up`.

    A subclass sets the class attributes and implements `build_rollout_worker`; the other hooks are optional.
    """

    # The method's config class; the TypeError when args is not one ("{got}": the type passed).
    config_class: ClassVar[type]
    config_error: ClassVar[str]
    # args=None gets config_class("<model's last path part>-<suffix>"); None: args is required.
    default_output_suffix: ClassVar[str | None] = None
    # The ValueError for tools= / environment_factory= ("{name}": which); None: they go to TRL.
    tools_error: ClassVar[str | None] = None
    # The ValueError for a train_dataset without a "prompt" column.
    dataset_error: ClassVar[str]

    def __init__(
        self,
        model: str,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        *,
        generator: Any = None,
        rollout_worker: Any = None,
        **kwargs: Any,
    ) -> None:
        if args is None and self.default_output_suffix is not None:
            args = self.config_class(f"{model.rstrip('/').split('/')[-1]}-{self.default_output_suffix}")
        if not isinstance(args, self.config_class):
            raise TypeError(self.config_error.format(got=type(args).__name__))
        if self.tools_error is not None:
            for name in ("tools", "environment_factory"):
                if kwargs.get(name) is not None:
                    raise ValueError(self.tools_error.format(name=name))
        if train_dataset is None or "prompt" not in (getattr(train_dataset, "column_names", None) or []):
            raise ValueError(self.dataset_error)
        generator, kwargs["weight_transfer"] = pair_local_policy(generator, kwargs.get("weight_transfer"))
        train_dataset, funcs = self.method_inputs(args, train_dataset, reward_funcs, rollout_worker, kwargs)
        self.set_up_method(args)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model)
        self._own_worker = rollout_worker is None
        if rollout_worker is None:
            rollout_worker = self.build_rollout_worker(
                args,
                dict(
                    dataset=train_dataset,
                    reward_funcs=funcs,
                    tokenizer=processing_class,
                    generator=generator,  # None: the served policy, given below once TRL knows how it syncs
                    num_generations=args.num_generations,
                    groups_per_run=groups_per_run(args),
                    scale_rewards=args.scale_rewards,
                    reward_weights=args.reward_weights,
                    queue_maxsize=args.queue_maxsize,
                    chat_template_kwargs=args.chat_template_kwargs,
                ),
            )
        super().__init__(
            model,
            funcs,
            args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            rollout_worker=rollout_worker,
            generator=generator,
            **kwargs,
        )
        install_served_generator(self, generator, **self.served_generator_options())
        self.finish_set_up()

    # ------------------------------------------------------------------------------------------ what a method writes
    def build_rollout_worker(self, args: Any, worker_kwargs: dict[str, Any]) -> Any:
        """The method's rollout worker (TRL's ``RolloutWorkerProtocol``), or None where this process runs no
        rollouts (TRL runs them on the main process only). ``worker_kwargs``: what every method's worker takes
        (``dataset``, ``reward_funcs``, ``tokenizer``, ``generator``, ``num_generations``, ``groups_per_run``,
        ``scale_rewards``, ``reward_weights``, ``queue_maxsize``, ``chat_template_kwargs``), from the trainer's
        arguments and ``args``."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_rollout_worker.")

    def method_inputs(
        self, args: Any, train_dataset: Any, reward_funcs: Any, rollout_worker: Any, trainer_kwargs: dict[str, Any]
    ) -> tuple[Any, list[Any]]:
        """The dataset the worker samples from and the reward functions as a list: by default the dataset as
        given and ``reward_funcs``, which must be callables when the worker is the method's own."""
        return train_dataset, callable_reward_funcs(type(self).__name__, reward_funcs, rollout_worker)

    def set_up_method(self, args: Any) -> None:
        """What the method sets up before its worker is built (and also when a worker is passed)."""

    def served_generator_options(self) -> dict[str, Any]:
        """Keyword arguments of `install_served_generator` (``group_requests``, ``generation_kwargs``)."""
        return {}

    def finish_set_up(self) -> None:
        """What the method does once TRL's trainer is built (the model loaded, the served policy given)."""

    def train_collation(self) -> contextlib.AbstractContextManager:
        """The context TRL's dataloader is built in, to give its collator the method's per-sample values; by
        default none (TRL's collator as it is)."""
        return contextlib.nullcontext()

    def get_train_dataloader(self):
        """TRL's dataloader, built in `train_collation`."""
        with self.train_collation():
            return super().get_train_dataloader()
