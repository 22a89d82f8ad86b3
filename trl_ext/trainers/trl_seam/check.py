"""What the seam takes from TRL's internals, as data, and `check_trl`, which compares it with the installed TRL.

`check_trl` runs when the seam is imported: a TRL whose private methods, attributes or ``_generate`` tuple differ
from these fails at once, with the fix, instead of at a metric ``KeyError`` minutes into training. The checks both
seams make (`signature_problems`, `attribute_problems`, `raise_if_problems` with the one pin `TRL_PIN`) live here;
the asynchronous seam (`trl_ext.trainers.async_seam.check`) adds what is its own.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import fields

import trl
from trl import GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from .grpo import GeneratedBatch

__all__ = [
    "FORWARD_KEYS",
    "SEAM",
    "SEAM_ATTRIBUTES",
    "SEAM_CALLS",
    "TRL_PIN",
    "VLLM_GENERATION_SEAM",
    "assigned_attributes",
    "attribute_problems",
    "check_trl",
    "raise_if_problems",
    "signature_problems",
    "source_tree",
]

# TRL private method the seam overrides -> the parameter names it calls it with.
SEAM: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("self", "inputs"),
    "_tokenize_prompts": ("self", "prompts"),
    "_generate": ("self", "prompts"),
    "_generate_single_turn": (
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_compute_loss": ("self", "model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    ),
    "_prepare_inputs": ("self", "generation_batch"),
    "_save_checkpoint": ("self", "model", "trial"),  # transformers.Trainer's, overridden by TRL
}

# The model inputs TRL forwards to a log-prob pass, when present, besides the ids and the mask (images, per-token
# processor fields): the parameters of its log-prob method after ``compute_aux_loss``.
FORWARD_KEYS: tuple[str, ...] = SEAM["_get_per_token_logps_and_entropies"][8:]

# TRL private methods the seam calls without overriding them -> their parameter names.
SEAM_CALLS: dict[str, tuple[str, ...]] = {
    "_log_completion_extra": ("self", "column", "values"),  # a column of the completions table
    "_log_metric": ("self", "name", "value"),  # a reward function's metric (TRL's log_metric kwarg)
    "_get_output_dir": ("self", "trial"),  # transformers.Trainer's: where checkpoint-N folders go
}

# TRL private attributes the seam reads or writes: set on the instance by `GRPOTrainer.__init__` (found in its
# source as ``self.<name> = ...``), or class attributes (the model card's).
SEAM_ATTRIBUTES: tuple[str, ...] = (
    "_metrics",  # {"train"|"eval": {name: [values]}}: what TRL averages into each log
    "_tokenizer",  # the tokenizer of processing_class (a processor's, for vision-language models)
    "_entropy_bonus_enabled",  # entropy_coef != 0 or use_adaptive_entropy
    "_buffered_inputs",  # the micro-batches of the current generation batch
    "_step",  # micro-steps trained so far (picks the buffered micro-batch)
    "_tag_names",  # the model card: tags, method name, paper
    "_name",
    "_paper",
)

# TRL's vLLM backend (`trainer.vllm_generation`): the method `LayerwiseReloadVLLMGeneration` overrides, and the
# private parameter iterator it calls (TRL's gathering of FSDP / ZeRO-3 shards and merging of PEFT adapters).
VLLM_GENERATION_SEAM: dict[str, tuple[str, ...]] = {
    "sync_weights": ("self",),
    "_iter_named_params": ("self",),
}


TRL_PIN = "trl>=1.16,<1.17"  # the one TRL range both seams are checked against (pyproject.toml pins the same)


def check_trl() -> None:
    """Fail with the fix when the installed TRL lacks the private methods, attributes (and shapes) the seam uses."""
    problems = signature_problems(GRPOTrainer, SEAM) + signature_problems(GRPOTrainer, SEAM_CALLS)
    problems += signature_problems(VLLMGeneration, VLLM_GENERATION_SEAM)
    problems += attribute_problems(GRPOTrainer, SEAM_ATTRIBUTES, assigned_attributes(GRPOTrainer.__init__))
    returned = _generate_return_names()
    expected_names = tuple(item.name for item in fields(GeneratedBatch))
    if returned is not None and returned != expected_names:
        problems.append(f"GRPOTrainer._generate returns {returned} (expected {expected_names})")
    raise_if_problems("TRL 1.16's GRPOTrainer internals", problems)


# ---------------------------------------------------------------------------------- the checks both seams make
def signature_problems(owner: type, methods: dict[str, tuple[str, ...]]) -> list[str]:
    """A problem for each method of ``owner`` that is missing or whose parameter names differ from ``methods``'."""
    problems = []
    for name, expected in methods.items():
        method = getattr(owner, name, None)
        if method is None:
            problems.append(f"{owner.__name__}.{name} is missing")
        elif (params := tuple(inspect.signature(method).parameters)) != expected:
            problems.append(f"{owner.__name__}.{name}{params} (expected {expected})")
    return problems


def source_tree(obj: object) -> ast.AST | None:
    """The parsed source of a class or function; None when its source is unavailable."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError):
        return None


def assigned_attributes(obj: object) -> set[str] | None:
    """The attribute names ``obj``'s source (a class or a method) assigns on ``self``; None without source."""
    tree = source_tree(obj)
    if tree is None:
        return None
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def attribute_problems(owner: type, names: tuple[str, ...], assigned: set[str] | None) -> list[str]:
    """A problem for each of ``names`` that ``owner`` neither assigns on ``self`` nor has as a class attribute
    (none when its source, and so ``assigned``, is unavailable)."""
    if assigned is None:
        return []
    missing = [name for name in names if name not in assigned and not hasattr(owner, name)]
    return [f"{owner.__name__} has no attribute {name}" for name in missing]


def raise_if_problems(needs: str, problems: list[str]) -> None:
    """`ImportError` naming what trl-ext ``needs`` of TRL, every difference found and the fix (`TRL_PIN`)."""
    if problems:
        raise ImportError(
            f"trl-ext needs {needs}, and trl {trl.__version__} differs: "
            + "; ".join(problems)
            + f". Install the tested version: pip install '{TRL_PIN}'."
        )


def _generate_return_names() -> tuple[str, ...] | None:
    """The names in ``GRPOTrainer._generate``'s final ``return a, b, ...``; None when its source is unavailable."""
    tree = source_tree(GRPOTrainer._generate)
    if tree is None:
        return None
    returns = [node for node in ast.walk(tree) if isinstance(node, ast.Return)]
    if not returns or not isinstance(returns[-1].value, ast.Tuple):
        return ()
    return tuple(elt.id if isinstance(elt, ast.Name) else ast.unparse(elt) for elt in returns[-1].value.elts)


check_trl()
