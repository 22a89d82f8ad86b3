"""Running a recipe (`trl_ext.recipes`): `build_trainer` builds its trainer as TRL's ``grpo`` script builds
`GRPOTrainer` (``asynchronous: true``: the method's asynchronous trainer, on TRL's `AsyncGRPOTrainer`, with what that
trainer cannot take refused up front, `check_async_recipe`); `train_from_recipe` builds, trains, saves the adapter (or model), the trainer state, ``trl_ext_run.json``
(`recipe_run_info`) and the monitors plot in ``output_dir``, and pushes the adapter with a model card when
``push_to_hub`` is set (`trl_ext.hub.push_adapter`). It runs unchanged under ``accelerate launch -m trl_ext.cli
train CONFIG.yaml``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .recipe_inputs import REWARD_REGISTRY, check_model_source, load_recipe_datasets, resolve_reward_funcs
from .recipes import DATA_FILE_BUILDERS, Recipe, RecipeError, trainer_class
from .run_info import PLOT_FILE, RunInfo, collect_monitor_alerts, config_summary, last_logged_metrics, write_run_info

logger = logging.getLogger(__name__)

__all__ = [
    "build_trainer",
    "check_async_recipe",
    "missing_server_advice",
    "recipe_run_info",
    "reward_names",
    "train_from_recipe",
]


def build_trainer(
    recipe: Recipe,
    *,
    model: Any = None,
    processing_class: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    reward_funcs: Sequence[Any] | None = None,
    callbacks: Sequence[Any] | None = None,
    **trainer_kwargs: Any,
) -> Any:
    """The recipe's trainer, as TRL's ``grpo`` script builds `GRPOTrainer`: the model by name (with the model
    arguments as ``model_init_kwargs``), the PEFT and quantization configs from `trl.ModelConfig`, the rewards, the
    data, and `default_monitors` unless ``monitors: false``.

    Every argument overrides what the recipe would build (tests pass a tiny in-memory model and dataset);
    ``trainer_kwargs`` go to the trainer (e.g. ``generator=`` for `StepwiseRLMTrainer`, ``judge=`` for
    `JudgeCreditTrainer`).

    With ``asynchronous: true`` the trainer is the method's asynchronous one (`trl_ext.methods.Method.async_trainer`):
    the model goes by name (TRL's asynchronous trainer loads it, and the ``vllm serve`` at ``vllm_server_base_url``
    must serve it under that name), the monitors include the `StalenessMonitor`, and the reward functions must be
    picklable module-level functions (TRL's rollout worker is a spawned process). Building it probes the server.
    """
    from trl import get_peft_config, get_quantization_config

    script_args, args, model_args = recipe.script_args, recipe.training_args, recipe.model_args
    method = recipe.method
    if recipe.asynchronous:
        check_async_recipe(
            recipe, model=model, eval_dataset=eval_dataset, weight_transfer=trainer_kwargs.get("weight_transfer")
        )
    if model is None:
        if not model_args.model_name_or_path:
            raise RecipeError(f"{recipe.source}: set `model_name_or_path:` (a Hub model id or a local folder).")
        model = model_args.model_name_or_path
        check_model_source(model, "model_name_or_path", revision=model_args.model_revision, source=recipe.source)
        init_kwargs = {
            "revision": model_args.model_revision,
            "trust_remote_code": getattr(args, "trust_remote_code", False),
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype,
        }
        init_kwargs = {key: value for key, value in init_kwargs.items() if value is not None}
        args.model_init_kwargs = {**init_kwargs, **(args.model_init_kwargs or {})}
    if reward_funcs is None:
        reward_funcs = resolve_reward_funcs(script_args.reward_funcs)
        if script_args.reward_models:
            if method.tag == "rlmt":
                raise RecipeError(
                    f"{recipe.source}: `reward_models` would score the plan with the response; for rlmt set "
                    "`reward_model_name_or_path:` (RLMTConfig), which scores the response only."
                )
            for reward_model in script_args.reward_models:
                check_model_source(reward_model, "reward_models", source=recipe.source)
            reward_funcs = [*script_args.reward_models, *reward_funcs]
        reward_model = getattr(args, "reward_model_name_or_path", None)
        if isinstance(reward_model, str):
            check_model_source(reward_model, "reward_model_name_or_path", source=recipe.source)
    reward_funcs = list(reward_funcs)
    if not reward_funcs and not (method.tag == "rlmt" and getattr(args, "reward_model_name_or_path", None)):
        raise RecipeError(
            f"{recipe.source}: no reward. Set `reward_funcs:` (import paths or built-in names)"
            + (" or `reward_model_name_or_path:`." if method.tag == "rlmt" else ".")
        )
    if train_dataset is None:
        train_dataset, loaded_eval = load_recipe_datasets(recipe)
        eval_dataset = loaded_eval if eval_dataset is None else eval_dataset
    callbacks = list(callbacks or [])
    if script_args.monitors:
        from .callbacks import MonitorCallback, default_monitors

        if not any(isinstance(cb, MonitorCallback) for cb in callbacks):
            # An asynchronous config (it has `max_staleness`) adds the StalenessMonitor.
            callbacks.extend(default_monitors(action=script_args.monitor_action, args=args))
    kwargs: dict[str, Any] = dict(
        args=args,
        train_dataset=train_dataset,
        processing_class=processing_class,
        callbacks=callbacks,
        peft_config=get_peft_config(model_args),
        **trainer_kwargs,
    )
    if not recipe.asynchronous:  # TRL's asynchronous trainer neither evaluates nor quantizes (check_async_recipe)
        kwargs["eval_dataset"] = eval_dataset
        quantization = get_quantization_config(model_args)
        if quantization is not None:
            kwargs["quantization_config"] = quantization
    trainer = trainer_class(method, recipe.asynchronous, recipe.source)
    return trainer(model, reward_funcs if reward_funcs else None, **kwargs)


def check_async_recipe(
    recipe: Recipe, *, model: Any = None, eval_dataset: Any = None, weight_transfer: Any = None
) -> None:
    """Refuse, before anything is loaded, what TRL's asynchronous trainer cannot take; each message names the recipe
    key and the fix (the same recipe trains synchronously without ``asynchronous: true``).

    Raises:
        RecipeError: no ``vllm_server_base_url`` in the recipe or on the command line (TRL's default,
            http://localhost:8000, would be waited for ``vllm_server_timeout`` seconds; not asked when
            ``weight_transfer`` is a sampler without a server, ``uses_server = False``:
            `trl_ext.trainers.LocalPolicy`), a model object (it loads the model itself, by name), ``attn_implementation`` (it attends with its own
            prefix-tree kernel), quantization (``load_in_4bit`` / ``load_in_8bit``), ``reward_models`` (its rollout
            worker scores with reward functions), or evaluation (``eval_strategy`` other than ``no``, or an
            ``eval_dataset``).
    """
    model_args, args = recipe.model_args, recipe.training_args
    where = f"{recipe.source}: asynchronous: true"
    # `set_keys` is empty for a `Recipe` built by hand (nothing known of its keys): only a parsed recipe is checked.
    uses_server = getattr(weight_transfer, "uses_server", True)
    if recipe.set_keys and "vllm_server_base_url" not in recipe.set_keys and uses_server:
        raise RecipeError(f"{where}, but no vLLM server is named. {missing_server_advice(recipe)}")
    if model is not None and not isinstance(model, str):
        raise RecipeError(
            f"{where}, but model= is a {type(model).__name__}: TRL's asynchronous trainer loads the model itself, by "
            "name, and the vLLM server serves it under that name. Pass a path or Hub id (or leave model= out: "
            "`model_name_or_path`)."
        )
    if model_args.attn_implementation is not None:
        raise RecipeError(
            f"{where}, with attn_implementation={model_args.attn_implementation!r}: TRL's asynchronous trainer packs "
            "each micro-batch into a prefix tree and attends with its own kernel. Remove `attn_implementation`."
        )
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise RecipeError(
            f"{where}, with load_in_4bit/load_in_8bit: TRL's asynchronous trainer does not load quantized models. "
            "Remove them, or train synchronously (remove `asynchronous: true`)."
        )
    if recipe.script_args.reward_models:
        raise RecipeError(
            f"{where}, with reward_models: TRL's asynchronous rollout worker scores with reward functions only. Use "
            "`reward_funcs:` (picklable module-level functions or classes), or train synchronously."
        )
    evaluation = getattr(args, "eval_strategy", "no")
    evaluation = getattr(evaluation, "value", evaluation)  # TrainingArguments holds an IntervalStrategy
    if evaluation != "no" or eval_dataset is not None:
        raise RecipeError(
            f"{where}, with evaluation (eval_strategy={evaluation!r}): TRL's "
            "asynchronous trainer takes no eval_dataset. Set `eval_strategy: no`, or train synchronously."
        )


def missing_server_advice(recipe: Recipe) -> str:
    """What to add to an asynchronous recipe that names no server: the ``vllm_server_base_url`` key, and the
    ``vllm serve`` command of docs/async.md for the recipe's model (LoRA: ``--max-loras`` at least
    ``max_staleness + 2``; full weights: reloaded from disk, or over NCCL, which needs ``VLLM_SERVER_DEV_MODE=1``)."""
    args, model_args = recipe.training_args, recipe.model_args
    model = model_args.model_name_or_path or "MODEL"
    if model_args.use_peft:
        command = (
            f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_SERVER_DEV_MODE=1 vllm serve {model} --port 8000 --enable-lora "
            f"--max-lora-rank {model_args.lora_r} --max-loras {getattr(args, 'max_staleness', 2) + 2}"
        )
    else:
        command = f"VLLM_SERVER_DEV_MODE=1 vllm serve {model} --port 8000"
    timeout = getattr(args, "vllm_server_timeout", 240.0)
    return (
        "TRL's asynchronous trainer generates with a running `vllm serve`: start one for the model first, e.g.\n"
        f"    {command}\n"
        "then add its address to the recipe, `vllm_server_base_url: http://127.0.0.1:8000` (or pass "
        "`--vllm_server_base_url http://HOST:PORT`); see docs/async.md. Without it the trainer would wait "
        f"vllm_server_timeout={timeout:g} s for TRL's default, http://localhost:8000."
    )


def train_from_recipe(recipe: Recipe, **build_kwargs: Any) -> Any:
    """Build, train, save (adapter or model, trainer state, ``trl_ext_run.json``, ``monitors.png``) and, when
    ``push_to_hub`` is set, push the adapter with a model card (`trl_ext.hub.push_adapter`); returns the trainer.
    What ``trl-ext train`` runs.

    ``push_to_hub`` is handled here, not by `transformers.Trainer` (which would push every checkpoint with its own
    card): one commit at the end, adapter files only, to ``hub_model_id`` (default: the output folder's name under
    your account).
    """
    args = recipe.training_args
    push_repo = None
    if args.push_to_hub:
        push_repo = args.hub_model_id or Path(args.output_dir).name
        args.push_to_hub = False
    trainer = build_trainer(recipe, **build_kwargs)
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "latest"):  # the command line gives strings
        resume = True  # the latest complete checkpoint of output_dir (ExtGRPOTrainer.train)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(args.output_dir)
    trainer.save_state()
    if trainer.accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        write_run_info(output_dir, recipe_run_info(recipe, trainer))
        if recipe.script_args.save_plot:
            try:
                from .callbacks import plot_run

                plot_run(output_dir, out=output_dir / PLOT_FILE)
            except (ImportError, ValueError, FileNotFoundError) as error:
                logger.warning("No monitors plot: %s", error)
        if push_repo is not None:
            from .hub import push_adapter

            if "/" not in push_repo:
                from huggingface_hub import HfApi

                from .hub import HubUploadError, describe_hub_error

                try:
                    push_repo = f"{HfApi(token=args.hub_token).whoami()['name']}/{push_repo}"
                except Exception as error:  # noqa: BLE001 - offline, unreachable or a refused token: say which
                    raise HubUploadError(
                        f"finding your Hub user name for hub_model_id={push_repo!r} failed: {describe_hub_error(error)}"
                    ) from error
            info = push_adapter(
                output_dir, push_repo, private=bool(getattr(args, "hub_private_repo", False)), token=args.hub_token
            )
            logger.info("Pushed the adapter to %s", getattr(info, "commit_url", push_repo))
    trainer.accelerator.wait_for_everyone()
    return trainer


def recipe_run_info(recipe: Recipe, trainer: Any) -> RunInfo:
    """The run file (``trl_ext_run.json``, `trl_ext.run_info.RunInfo`) of a recipe run, once ``trainer`` has trained:
    what ``trl-ext push`` puts in the model card (trainer, base model, config, metrics, alerts); ``extra`` holds the
    recipe's path."""
    alerts, alert_log = collect_monitor_alerts(trainer)
    return RunInfo(
        source="trl-ext train",
        method=recipe.method.tag,
        trainer=type(trainer).__name__,
        base_model=_model_reference(
            recipe.model_args.model_name_or_path or getattr(trainer.model.config, "_name_or_path", None)
        ),
        dataset=_dataset_reference(recipe),
        reward_funcs=reward_names(getattr(trainer, "reward_funcs", None), recipe),
        config=config_summary(recipe.training_args, recipe.set_keys or None),
        peft=_peft_summary(recipe.model_args),
        metrics=last_logged_metrics(trainer.state.log_history),
        steps=trainer.state.global_step,
        alerts=alerts,
        alert_log=alert_log,
        sandbox=getattr(trainer, "sandbox_info", None),  # what the REPLs of this run were isolated from
        extra=_run_extra(recipe),
    )


def reward_names(reward_funcs: Sequence[Any] | None, recipe: Recipe) -> list[str]:
    """The run file's ``reward_funcs``: the trainer's reward functions' names, or, for a trainer that keeps them in
    its rollout worker (TRL's asynchronous trainer), the names the recipe's ``reward_models`` and ``reward_funcs``
    entries give (``pkg.mod:exact_match`` -> ``exact_match``; a built-in name -> what it resolves to)."""
    if reward_funcs is not None:
        return [getattr(func, "__name__", str(func)) for func in reward_funcs]
    names = list(recipe.script_args.reward_models or [])
    for spec in recipe.script_args.reward_funcs or []:
        target = spec if isinstance(spec, str) else (spec.get("path") or spec.get("name"))
        target = REWARD_REGISTRY.get(target, target)
        names.append(target.rsplit(":", 1)[-1].rsplit(".", 1)[-1])
    return names


def _run_extra(recipe: Recipe) -> dict[str, Any]:
    """The run file's ``extra`` of a recipe run: the recipe's path, and ``asynchronous: true`` for a run of an
    asynchronous trainer (its settings, ``max_staleness`` and the like, are in ``config`` when the recipe set them)."""
    extra: dict[str, Any] = {"recipe": str(recipe.source)} if recipe.source else {}
    if recipe.asynchronous:
        extra["asynchronous"] = True
    return extra


def _model_reference(name: str | None) -> str | None:
    """A model as the run file records it: a local folder as its absolute path (so `trl-ext push` knows it is not a
    Hub id and keeps it out of the card), a Hub id as is."""
    if name and Path(name).expanduser().is_dir():
        return str(Path(name).expanduser().resolve())
    return name


def _dataset_reference(recipe: Recipe) -> str | list[str] | None:
    """The training data as the run file records it: ``dataset_name``, or per ``datasets:`` entry its data files
    (a local file) or its path (a Hub dataset or folder)."""
    if not recipe.dataset_args.datasets:
        return recipe.script_args.dataset_name
    references: list[str] = []
    for config in recipe.dataset_args.datasets:
        files = config.data_files
        if config.path in DATA_FILE_BUILDERS.values() and files:
            if isinstance(files, Mapping):  # {split: files}
                files = [item for value in files.values() for item in ([value] if isinstance(value, str) else value)]
            references += [files] if isinstance(files, str) else [str(item) for item in files]
        else:
            references.append(config.path)
    return references


def _peft_summary(model_args: Any) -> dict[str, Any] | None:
    if not model_args.use_peft:
        return None
    return {
        "r": model_args.lora_r,
        "lora_alpha": model_args.lora_alpha,
        "lora_dropout": model_args.lora_dropout,
        "target_modules": model_args.lora_target_modules,
    }
