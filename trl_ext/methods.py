"""The trl-ext methods, one table (`METHODS`): each method's name, its trainer and config classes (synchronous, on
TRL's `GRPOTrainer`, and asynchronous, on TRL's experimental `AsyncGRPOTrainer`), TRL's card attributes and whether
``trl-ext quickstart`` runs it.

A method has one spelling, its name (``"stepwise-rlm"``): the Hub tag, the ``method`` of ``trl_ext_run.json``, the
``--method`` choices of ``trl-ext quickstart``. A recipe's ``trainer:`` key writes it with underscores
(``stepwise_rlm``, `Method.recipe_name`, as docs/recipes.md documents). A trainer names its entry
(``model_card = METHODS["stepwise-rlm"]``) and the TRL seam hands TRL's model card its tags, name and paper from it;
the model card's prose about each method is in `trl_ext.model_card`. A recipe's ``asynchronous: true`` picks the
method's asynchronous classes (`Method.async_trainer`, `Method.async_config`); the method, and so its tag, stays the
same.

Only the standard library is imported: the CLI reads the table at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METHODS", "QUICKSTART_METHODS", "Method", "method_for_recipe"]


@dataclass(frozen=True, eq=False)
class Method:
    """One trl-ext method: its name, classes and TRL card attributes."""

    tag: str  # the method's one spelling: Hub tag, run-file `method`, quickstart `--method`
    name: str  # TRL's model card: "This model was trained with <name>"
    trainer: str  # the trainer class (`trl_ext.<trainer>`)
    config: str  # the config class (`trl_ext.<config>`)
    paper: dict[str, str | None]  # TRL's model card: {"title", "id" (arXiv id or None), "citation" (BibTeX)}
    in_quickstart: bool  # `trl-ext quickstart --method <tag>` runs it
    # The asynchronous trainer and config classes (`trl_ext.trainers.<name>`, on TRL's `AsyncGRPOTrainer`;
    # docs/async.md), or None when the method has none. A name may precede its class: a recipe that picks a class
    # trl-ext does not have yet fails, saying so (`trl_ext.recipes.config_class`).
    async_trainer: str | None = None
    async_config: str | None = None

    @property
    def tag_names(self) -> list[str]:
        """The model card's tags: the GRPO trainer's, ``trl-ext`` and the method tag."""
        return list(dict.fromkeys(["trl", "grpo", "trl-ext", self.tag]))

    def classes(self, asynchronous: bool = False) -> tuple[str | None, str | None]:
        """``(trainer, config)`` class names: the synchronous ones, or with ``asynchronous`` the asynchronous ones
        (``(None, None)`` when the method has none)."""
        return (self.async_trainer, self.async_config) if asynchronous else (self.trainer, self.config)

    @property
    def recipe_name(self) -> str:
        """The method as a recipe's ``trainer:`` value: its name with underscores (``stepwise_rlm``)."""
        return self.tag.replace("-", "_")


def _paper(title: str, arxiv_id: str | None, kind: str, key: str, **fields: str | int) -> dict[str, str | None]:
    """TRL's `_paper` of a method: its ``title``, ``id`` (the arXiv id, None when it is not on arXiv) and BibTeX
    ``citation`` (``@kind{key,``, the title, then ``fields`` in order: strings in braces, numbers bare)."""
    entries = {"title": f"{{{title}}}", **fields}
    lines = [
        f"    {name:<12} = {value if isinstance(value, int) else '{' + value + '}'},"
        for name, value in entries.items()
    ]
    return {"title": title, "id": arxiv_id, "citation": "\n".join([f"@{kind}{{{key},", *lines, "}"])}


_RLM_BLOG = _paper(  # a blog post, not on arXiv
    "Reinforcing Recursive Language Models",
    None,
    "misc",
    "kim2026reinforcing",
    author="Kim and Ahmad",
    year=2026,
    howpublished="alphaXiv blog, May 2026",
)
_JUDGE_BLOG = _paper(  # a blog post, not on arXiv
    "Dear diary, I judged rollouts: how your RL judge affects your model's reasoning",
    None,
    "misc",
    "dear_diary_judge2026",
    year=2026,
    howpublished="blog post",
)
_RLMT_PAPER = _paper(
    "Language Models that Think, Chat Better",
    "2509.20357",
    "article",
    "bhaskar2025language",
    author="Bhaskar, Adithya and Ye, Xi and Chen, Danqi",
    year=2025,
    eprint="arXiv:2509.20357",
)
_GRPO_PAPER = _paper(  # as `trl.GRPOTrainer._paper`
    "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    "2402.03300",
    "article",
    "shao2024deepseekmath",
    author="Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and "
    "Y. K. Li and Y. Wu and Daya Guo",
    year=2024,
    eprint="arXiv:2402.03300",
)

# The one home of the method list, in the order the CLI and the docs name them.
METHODS: dict[str, Method] = {
    method.tag: method
    for method in (
        Method(
            "stepwise-rlm",
            "Stepwise RLM",
            "StepwiseRLMTrainer",
            "StepwiseRLMConfig",
            _RLM_BLOG,
            True,
            async_trainer="AsyncStepwiseRLMTrainer",
            async_config="AsyncStepwiseRLMConfig",
        ),
        Method(
            "judge-credit",
            "Judge Credit",
            "JudgeCreditTrainer",
            "JudgeCreditConfig",
            _JUDGE_BLOG,
            True,
            async_trainer="AsyncJudgeCreditTrainer",
            async_config="AsyncJudgeCreditConfig",
        ),
        Method(
            "rlmt",
            "RLMT",
            "RLMTTrainer",
            "RLMTConfig",
            _RLMT_PAPER,
            True,
            async_trainer="AsyncRLMTTrainer",
            async_config="AsyncRLMTConfig",
        ),
        Method(
            "grpo",
            "GRPO",
            "ExtGRPOTrainer",
            "ExtGRPOConfig",
            _GRPO_PAPER,
            False,
            async_trainer="ExtAsyncGRPOTrainer",
            async_config="ExtAsyncGRPOConfig",
        ),
    )
}

# What `trl-ext quickstart --method` offers (its default first).
QUICKSTART_METHODS: tuple[str, ...] = tuple(tag for tag, method in METHODS.items() if method.in_quickstart)


def method_for_recipe(value: object) -> Method:
    """The method a recipe's ``trainer:`` value names (``stepwise_rlm``, ``judge_credit``, ``rlmt`` or ``grpo``).

    Raises:
        ValueError: any other value, naming the choices.
    """
    for method in METHODS.values():
        if value == method.recipe_name:
            return method
    choices = ", ".join(method.recipe_name for method in METHODS.values())
    raise ValueError(f"trainer={value!r} is not one of {choices}; set `trainer:` to one of them.")
