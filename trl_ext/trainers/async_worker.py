"""The one rollout worker of every asynchronous method trainer (docs/async.md), and the trainers' set-up of it.

- `RolloutWorker`: TRL's ``RolloutWorkerProtocol`` in a thread of the trainer process: the sample and metrics
  queues, the loop over the dataset's prompts (``groups_per_run`` at a time, cycling), the policy-version tracking,
  error counting (``max_consecutive_errors``), the heartbeat, the staleness gate, the resume position, `check_health`
  and `stop`; the reward functions called as `GRPOTrainer` calls them and a group sampled and scored
  (`trl_ext.rollouts.RolloutRuntime`). What a run samples is its method's (`trl_ext.rollouts.RolloutMethod`:
  `GRPOGroups`, `JudgeCredit`, `RLMT`, `StepwiseRLM`), written once in the method's package.
- `callable_reward_funcs`, `groups_per_run`, `install_served_generator`: the trainers' shared set-up (the served policy is chosen once TRL knows how it syncs the weights).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..advantages import SCALE_REWARDS, scored_advantages
from ..rlm.generators import Completion, Generator
from ..rollouts import (
    GRPOGroups,
    RolloutMethod,
    ScoredGroup,
    as_completions,
    checked_reward_weights,
    population_std,
    reward_func_names,
    reward_table,
)
from ..serving.served_policy import ServedPolicyGenerator
from .async_seam import RolloutSample, served_policy_names, to_rollout_sample

logger = logging.getLogger(__name__)

__all__ = [
    "RolloutWorker",
    "StalenessGate",
    "callable_reward_funcs",
    "groups_per_run",
    "install_served_generator",
]

RUN_MARKS_KEPT = 4096  # completed runs remembered for `RolloutWorker.resume_state`
GATE_POLL_S = 0.02  # how often a worker waiting for room (`StalenessGate`) looks again
METRICS_QUEUE_SIZE = 4096  # metric dicts kept for the trainer; past that they are dropped, never blocking rollouts
# Dataset columns not passed to the reward functions (TRL's rule): the worker passes its own values under these names.
_RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")
STOP_WAIT_S = 60  # how long `stop` waits for the run in flight


class StalenessGate:
    """When a rollout worker may start a run: only while the run's samples will be trained within ``max_staleness``
    policy versions of the version it starts at (prime-rl's ``async_level``, counted in samples).

    The trainer takes samples from the buffer in order and publishes a new version every ``samples_per_version``
    samples. At a version that has taken ``c`` samples so far, with ``q`` samples queued, a run of ``r`` samples
    started now has its last sample trained at ``ceil((c + q + r) / samples_per_version) - 1`` versions later: the
    run may start when ``c + q + r <= (max_staleness + 1) * samples_per_version``, with ``r`` the last run's size.
    It always may when nothing is queued (else the trainer would wait for ever), or before any size is known.

    ``samples_per_version`` is the trainer's figure when its batches hold a fixed count of samples; otherwise (a token
    budget) the samples taken between the last two versions. ``max_staleness=None``: no gate (fill the buffer).
    """

    def __init__(self, max_staleness: int | None = None, samples_per_version: int = 0) -> None:
        self.max_staleness = max_staleness
        self.samples_per_version = samples_per_version  # 0: measured
        self.measured_per_version = 0
        self.last_run_samples = 0
        self._consumed_at_version: int | None = None

    def new_version(self, consumed: int) -> None:
        """The trainer published a version when ``consumed`` samples had been taken from the buffer in all."""
        if self._consumed_at_version is not None and consumed > self._consumed_at_version:
            self.measured_per_version = consumed - self._consumed_at_version
        self._consumed_at_version = consumed

    def room(self, consumed: int, queued: int) -> bool:
        """Whether a run may start now, ``consumed`` samples taken in all and ``queued`` waiting (class docstring)."""
        per_version = self.samples_per_version or self.measured_per_version
        if self.max_staleness is None or queued == 0 or per_version <= 0 or self.last_run_samples <= 0:
            return True
        taken_this_version = consumed - (self._consumed_at_version or 0)
        return taken_this_version + queued + self.last_run_samples <= (self.max_staleness + 1) * per_version


class _Heartbeat:
    """A `Generator` wrapper that ticks the worker's heartbeat around every call (a long call is not a hang)."""

    def __init__(self, inner: Generator, tick: Callable[[], None]):
        self.inner, self.tick = inner, tick

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        self.tick()
        try:
            return self.inner.generate(prompts)
        finally:
            self.tick()


class RolloutWorker:
    """A method's rollouts for TRL's asynchronous trainer (``rollout_worker=``), in a thread of the trainer process.

    Each run takes ``groups_per_run`` dataset rows and asks the method for their samples
    (``method.rollout(rows, self, version)``, `trl_ext.rollouts.RolloutMethod`), tagged with the policy version live
    when the run started. A failing run (the sampler, a reward function, the method) is logged with its traceback,
    counted in ``<method.metric_prefix>/worker_errors_total`` and retried with the next rows;
    ``max_consecutive_errors`` failures in a row stop the thread, and `check_health` (called by the trainer while it
    waits for samples) then raises with the cause.

    Args:
        method: what a run samples (`trl_ext.rollouts.RolloutMethod`; default `GRPOGroups`, plain GRPO groups); its
            ``close`` is called once the thread has ended.
        dataset: rows with a ``prompt`` (a string, or chat messages); every other column is passed to the reward
            functions as TRL does.
        reward_funcs: TRL reward functions (``prompts``, ``completions``, ``completion_ids`` and the dataset columns
            as keyword lists); a completion's reward is the sum of theirs weighted by ``reward_weights``, a None
            skipped (`summed_rewards`).
        tokenizer: the policy's tokenizer (with a chat template).
        generator: the policy's sampler (`trl_ext.rlm.Generator`: token-id prompts in, ids and log-probs out);
            when it has ``update_model_version`` (`ServedPolicyGenerator`), each new version is forwarded to it.
        num_generations: rollouts per prompt (one group).
        groups_per_run: prompts sampled together in one run.
        scale_rewards: ``"group"`` or ``"none"`` (`trl_ext.advantages.group_advantages`, `GRPOTrainer`'s).
        reward_weights: one weight per reward function, in their order, as TRL's ``reward_weights`` (None: all 1).
        queue_maxsize: bound of ``rollout_buffer`` (0: unbounded).
        max_consecutive_errors: failed runs in a row that stop the worker.
        chat_template_kwargs: for ``apply_chat_template``.
        step: the trainer's global step (`RolloutRuntime.step`).

    Attributes:
        rollout_buffer, metrics_queue: what TRL's trainer drains (``RolloutWorkerProtocol``).
        model_version: the version last published by the trainer.
        errors: failed runs so far; groups: groups scored so far.
    """

    def __init__(
        self,
        *,
        method: RolloutMethod | None = None,
        dataset: Any,
        reward_funcs: Sequence[Callable[..., Any]],
        tokenizer: Any,
        generator: Any = None,
        num_generations: int = 8,
        groups_per_run: int = 1,
        scale_rewards: str = "group",
        reward_weights: Sequence[float] | None = None,
        queue_maxsize: int = 0,
        max_consecutive_errors: int = 3,
        chat_template_kwargs: dict[str, Any] | None = None,
        step: Callable[[], int] = lambda: 0,
    ) -> None:
        self.method = GRPOGroups() if method is None else method
        self.worker_name = self.method.name  # "The <worker_name> rollout worker ..."
        if len(dataset) == 0:
            raise ValueError(f"The {self.worker_name} rollout worker needs a non-empty dataset of prompts.")
        if not reward_funcs or not all(callable(func) for func in reward_funcs):
            raise TypeError("reward_funcs must be one or more callables (TRL's reward-function interface).")
        if num_generations < 1 or groups_per_run < 1 or max_consecutive_errors < 1:
            raise ValueError("num_generations, groups_per_run and max_consecutive_errors must be >= 1.")
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"scale_rewards={scale_rewards!r}: the rollout worker scores one group at a time; set 'group' (divide "
                "by the group's std) or 'none' (Dr. GRPO)."
            )
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs)
        self.reward_func_names = reward_func_names(self.reward_funcs)
        self.reward_weights = checked_reward_weights(reward_weights, self.reward_func_names)
        self.scale_rewards = scale_rewards
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.tokenizer = tokenizer
        self.generator = generator
        self.num_generations = num_generations
        self.groups_per_run = groups_per_run
        self.max_consecutive_errors = max_consecutive_errors
        self.step = step
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=METRICS_QUEUE_SIZE)
        self.model_version = 0
        self.errors = 0
        self.groups = 0
        self._run_marks: collections.deque[tuple[int, int]] = collections.deque(maxlen=RUN_MARKS_KEPT)
        self.rows_taken = 0  # dataset rows handed to runs so far (cycling): the next run starts at this position
        self._rows = self._cycle(0)
        self.staleness = StalenessGate()
        self._samples_put = 0  # samples put into the buffer so far (the gate's count of what the trainer took)
        self._resumed_from = (0, 0)  # (rows, groups) a resumed worker started at (`restore_state`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._heartbeat = time.time()
        self._event_loop: asyncio.AbstractEventLoop | None = None  # for async reward functions, one per worker

    # ------------------------------------------------------------------------------ one run
    def rollout(self, rows: Sequence[dict[str, Any]]) -> list[RolloutSample]:
        """One run: the method's samples of ``num_generations`` rollouts of each of ``rows``, as TRL's samples, tagged
        with the policy version live when the run started (a tree spans versions: tagged with its oldest, TRL's
        ``max_staleness`` bounds every one of its turns)."""
        version = self.model_version
        samples = self.method.rollout(rows, self, version)
        return [to_rollout_sample(sample, version, weighted=self.method.weighted) for sample in samples]

    def _on_thread_exit(self) -> None:
        """Run in the thread as it ends (close what the runs opened there: the async reward functions' loop)."""
        if self._event_loop is not None:
            self._event_loop.close()
            self._event_loop = None

    # ------------------------------------------------------------------------------ RolloutWorkerProtocol
    def start(self) -> None:
        """Start the rollout thread (once; TRL calls it when training begins)."""
        if self._thread is not None:
            return
        self._heartbeat = time.time()
        name = f"{self.worker_name.lower()}-rollout-worker"
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop and wait for the run in flight."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_S)
            if self._thread.is_alive():
                logger.warning(
                    "The %s rollout worker did not stop within %d s (%s).",
                    self.worker_name,
                    STOP_WAIT_S,
                    self.method.in_flight,
                )
                return
        self.method.close()

    def update_model_version(self, model_version: int) -> None:
        """Record the version the trainer published and forward it to the generator (when it tracks versions)."""
        self.model_version = int(model_version)
        self.staleness.new_version(self._samples_consumed())
        update = getattr(self.generator, "update_model_version", None)
        if callable(update):
            update(self.model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise when the thread stopped on an error (with the cause), or has not ticked for ``stale_after_s``."""
        name = self.worker_name
        if self._failure is not None:
            raise RuntimeError(
                f"The {name} rollout worker stopped: {type(self._failure).__name__}: {self._failure}"
            ) from self._failure
        if self._thread is None:
            raise RuntimeError(
                f"The {name} rollout worker was never started (start() is called when training begins)."
            )
        if not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError(f"The {name} rollout worker thread ended without an error; no more samples will come.")
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(
                f"The {name} rollout worker made no progress for {age:.0f} s (> heartbeat_stale_after_s="
                f"{stale_after_s:.0f}){self.method.stale_advice}."
            )

    # ------------------------------------------------------------------------------ the rollout loop
    def _main(self) -> None:
        try:
            self._run_loop()
        except BaseException as error:  # noqa: BLE001  (kept for check_health, which re-raises it with the cause)
            self._failure = error
            logger.error("The %s rollout worker stopped: %s: %s", self.worker_name, type(error).__name__, error)
        finally:
            self._on_thread_exit()

    def _run_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            waited = self._wait_for_room()
            if waited is None:
                return
            rows = [next(self._rows) for _ in range(self.groups_per_run)]
            try:
                samples = self.rollout(rows)
            except Exception as error:
                failures += 1
                self.errors += 1
                self.push_metrics({f"{self.method.metric_prefix}/worker_errors_total": 1.0})
                logger.exception("%s rollout run failed (%d in a row): %s", self._title, failures, error)
                if failures >= self.max_consecutive_errors:
                    raise RuntimeError(
                        f"{failures} {self.worker_name} rollout runs failed in a row; the last with "
                        f"{type(error).__name__}: {error}"
                    ) from error
                continue
            failures = 0
            self._run_marks.append((self.groups, self.rows_taken))
            self.staleness.last_run_samples = len(samples)
            if self.staleness.max_staleness is not None:
                self.push_metrics({f"{self.method.metric_prefix}/staleness_wait_s": waited})
            for sample in samples:
                if not self._put(sample):
                    return

    @property
    def _title(self) -> str:
        return self.worker_name[:1].upper() + self.worker_name[1:]

    def _put(self, sample: Any) -> bool:
        while not self._stop.is_set():
            try:
                sample.enqueued_at = time.time()
                self.rollout_buffer.put(sample, timeout=0.5)
                self._samples_put += 1
                self._heartbeat = time.time()
                return True
            except queue.Full:
                self._heartbeat = time.time()  # waiting on the trainer is not a hang
        return False

    def _cycle(self, start: int) -> Iterator[dict[str, Any]]:
        """The dataset's rows from position ``start`` on, cycling; `rows_taken` counts the rows handed out."""
        self.rows_taken = start
        while True:
            row = self.dataset[self.rows_taken % len(self.dataset)]
            self.rows_taken += 1
            yield row

    # ------------------------------------------------------------------------------ staleness and resume
    def _samples_consumed(self) -> int:
        """Samples the trainer has taken from the buffer so far (dropped ones included)."""
        return self._samples_put - self.rollout_buffer.qsize()

    def _wait_for_room(self) -> float | None:
        """Wait until a new run cannot go stale (`StalenessGate.room`); the seconds waited, None when stopped."""
        start = time.perf_counter()
        while not self._stop.is_set():
            if self.staleness.room(self._samples_consumed(), self.rollout_buffer.qsize()):
                return time.perf_counter() - start
            self._heartbeat = time.time()  # waiting on the trainer is not a hang
            time.sleep(GATE_POLL_S)
        return None

    def resume_state(self, trained_group_ids: Iterable[int]) -> dict[str, int]:
        """Where a run resumed from a checkpoint starts: after the last run whose groups were all trained.

        Args:
            trained_group_ids: the group ids the trainer has trained on (TRL's collator records them).

        Returns:
            ``{"rows": dataset position, "groups": next group id}``: the rows of runs still in flight, queued or
            partly trained are sampled again after the resume (their trees, judge calls and REPLs are redone; their
            samples were never, or only partly, trained).
        """
        trained = max(trained_group_ids, default=-1)
        rows, groups = self._resumed_from
        for next_group, rows_after in self._run_marks:
            if next_group - 1 <= trained:
                rows, groups = rows_after, next_group
        return {"rows": rows, "groups": groups}

    def restore_state(self, state: Mapping[str, int]) -> None:
        """Start at a `resume_state` (call before `start`)."""
        if self._thread is not None:
            raise RuntimeError("restore_state must be called before the rollout worker starts.")
        rows, groups = int(state.get("rows", 0)), int(state.get("groups", 0))
        self._resumed_from = (rows, groups)
        self.groups = groups
        self._rows = self._cycle(rows)

    def tick(self) -> None:
        """The heartbeat: the thread is making progress (a long generator or judge call is not a hang)."""
        self._heartbeat = time.time()

    def push_metrics(self, metrics: dict[str, Any]) -> None:
        """Queue ``metrics`` for the trainer's log. TRL reduces a ``(numerator, denominator)`` rate over the log
        window as Σ numerators / Σ denominators, so a rate with nothing counted (denominator 0) is left out."""
        metrics = {name: value for name, value in metrics.items() if not (isinstance(value, tuple) and not value[1])}
        try:
            self.metrics_queue.put_nowait(metrics)
        except queue.Full:
            pass  # never block rollouts on a trainer that stopped logging

    # ------------------------------------------------------------------------------ what a method uses (RolloutRuntime)
    @property
    def policy(self) -> Generator:
        """The policy's sampler, ticking the heartbeat around every call (a long run is not a hang)."""
        if self.generator is None:
            raise RuntimeError(
                f"The {self.worker_name} rollout worker has no generator: pass generator= (or let the trainer set it)."
            )
        return _Heartbeat(self.generator, self.tick)

    def next_group_id(self) -> int:
        """A new group id (`groups` counts them; a resumed run continues the count)."""
        group_id, self.groups = self.groups, self.groups + 1
        return group_id

    def sample_groups(self, rows: Sequence[dict[str, Any]]) -> list[ScoredGroup]:
        """One sampler call for ``num_generations`` completions of each row (the method's ``prompt_ids`` and
        ``finish_completions``), then each group scored: rewards (`summed_rewards`; where every function returned
        None, the method's ``unscored_reward``), the method's ``group_advantages``, a group id."""
        prompt_ids = [self.method.prompt_ids(row["prompt"], self) for row in rows]
        size = len(rows) * self.num_generations
        completions = self.policy.generate([ids for ids in prompt_ids for _ in range(self.num_generations)])
        if len(completions) != size:
            raise RuntimeError(f"The generator returned {len(completions)} completions for {size} prompts.")
        completions = self.method.finish_completions(completions, self)
        groups = []
        for index, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True)):
            group = completions[index * self.num_generations : (index + 1) * self.num_generations]
            texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
            per_func = self.call_rewards(row, texts, [list(c.token_ids) for c in group])
            rewards = self.summed_rewards(per_func, unscored=self.method.unscored_reward)
            groups.append(
                ScoredGroup(
                    row=row,
                    prompt_ids=ids,
                    completions=list(group),
                    texts=texts,
                    per_func=per_func,
                    rewards=rewards,
                    advantages=self.method.group_advantages(rewards, self),
                    reward_std=population_std(rewards),
                    group_id=self.next_group_id(),
                )
            )
        return groups

    def call_rewards(
        self, row: dict[str, Any], texts: list[str], ids: list[list[int]], **extra: list[Any]
    ) -> list[list[float]]:
        """``(functions, G)`` rewards (None -> NaN) of the ``G`` completions ``texts`` (token ``ids``) of ``row``'s
        prompt, the functions called as `GRPOTrainer` calls them: ``prompts``, ``completions`` (conversational for a
        conversational prompt), ``completion_ids``, every dataset column but ``prompt``/``completion``/
        ``completion_ids``, ``log_metric`` and ``extra`` (a method's own columns, e.g. ``rlm_has_answer``); an
        ``async def`` function is awaited on the worker's own event loop."""
        size = len(texts)
        columns = {key: [value] * size for key, value in row.items() if key not in _RESERVED_COLUMNS}
        kwargs = dict(
            prompts=[row["prompt"]] * size,
            completions=as_completions(row["prompt"], texts),
            completion_ids=ids,
            log_metric=self._reward_metric,
            **columns,
            **extra,
        )
        return reward_table(self.reward_funcs, self.reward_func_names, kwargs, size, resolve=self._resolve)

    def _resolve(self, values: Any) -> Any:
        """An async reward function's rewards, awaited on the worker's own event loop."""
        if not inspect.isawaitable(values):
            return values
        if self._event_loop is None:
            self._event_loop = asyncio.new_event_loop()
        return self._event_loop.run_until_complete(values)

    def _reward_metric(self, name: str, value: float) -> None:
        """A reward function's metric (TRL's ``log_metric``): logged as the mean over the logging window."""
        self.push_metrics({name: float(value)})

    def summed_rewards(self, per_func: Sequence[Sequence[float]], unscored: float = 0.0) -> list[float]:
        """``(G,)`` rewards from the ``(functions, G)`` table: each completion's values weighted by ``reward_weights``
        and summed, NaN (a None) skipped, as `GRPOTrainer`'s ``nansum``; ``unscored`` where every value is NaN (0:
        `GRPOTrainer`'s; NaN: left out of the group advantage, `trl_ext.advantages.scored_advantages`)."""
        rewards = []
        for values in zip(*per_func, strict=True):
            kept = [
                (weight, value)
                for weight, value in zip(self.reward_weights, values, strict=True)
                if not math.isnan(value)
            ]
            rewards.append(math.fsum(weight * value for weight, value in kept) if kept else unscored)
        return rewards

    def group_advantages(self, rewards: Sequence[float]) -> list[float]:
        """``(G,)`` advantages of one group's rewards under ``scale_rewards`` (NaN: an unscored completion, 0)."""
        return scored_advantages(rewards, self.scale_rewards)


# ---------------------------------------------------------------------------------- the trainers' set-up
def callable_reward_funcs(trainer_name: str, reward_funcs: Any, rollout_worker: Any) -> list[Any]:
    """``reward_funcs`` as a list; with the trainer's own worker (``rollout_worker=None``) they must be callables."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if rollout_worker is None and not all(callable(func) for func in funcs):
        raise TypeError(
            f"{trainer_name}'s rollout worker calls the reward functions itself: pass callables (TRL's "
            "reward-function interface), not model ids."
        )
    return funcs


def groups_per_run(args: Any) -> int:
    """Prompts per worker run: as many groups as ``max_inflight_tasks`` holds (at least one)."""
    return max(1, args.max_inflight_tasks // args.num_generations)


def install_served_generator(
    trainer: Any, generator: Any, *, group_requests: bool = False, generation_kwargs: dict[str, Any] | None = None
) -> None:
    """Give the trainer's own worker the served policy (`ServedPolicyGenerator` on ``vllm_server_base_url``, the
    adapter TRL publishes) unless a ``generator`` was passed. Call after ``super().__init__`` (TRL has chosen how it
    syncs the weights then). ``group_requests``: a group's completions in one request with ``n`` (RLMT)."""
    if not trainer._own_worker or generator is not None or trainer.rollout_worker is None:
        return

    base_model, lora_name = served_policy_names(trainer)
    trainer.rollout_worker.generator = ServedPolicyGenerator.from_config(
        trainer.args, base_model, lora_name, group_requests=group_requests, generation_kwargs=generation_kwargs
    )
