"""Tiny, offline, deterministic models and tokenizers for tests, benchmarks and the quickstart.

Nothing here touches the Hugging Face Hub: the tokenizer is a byte-level BPE trained in memory on a fixed
corpus, and the models are randomly initialised Qwen2 architectures seeded by ``seed`` (Qwen2-VL and Qwen2.5-VL for
vision-language tests, with their processors over the same tokenizer).
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .rlm.generators import ScriptedGenerator

# Chat template of the ChatML family (the one Qwen uses), written out so no Hub file is needed.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD_TOKEN_ID, EOS_TOKEN_ID = 0, 2

# A small fixed corpus: chat words, digits, arithmetic, Python and REPL syntax used by the RLM scaffold.
_CORPUS = [
    "system user assistant You are a helpful assistant. Answer the question.",
    "What is 2 + 3? The answer is 5. What is 7 * 6? The answer is 42.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "```repl\nprint(context[:100])\nx = len(context)\nprint(x)\n```",
    "FINAL(answer) FINAL_VAR(result) llm_query rlm_query rlm_query_batched SHOW_VARS context",
    "def f(x):\n    return x + 1\nfor i in range(10):\n    print(i)\nif x > 0:\n    y = [a for a in b]",
    "<think> Let me plan the response first. </think> Here is my response.",
    "<response> The capital of France is Paris. </response> Thank you!",
    "The quick brown fox jumps over the lazy dog. Hello world! yes no true false None",
    "import re\nresult = re.findall(r'[a-z]+', text)\nanswer = sum(values) / max(1, len(values))",
    "error Traceback (most recent call last): NameError: name 'y' is not defined",
]


@lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def build_tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with a ChatML chat template, trained offline on a fixed corpus.

    Any text round-trips (byte-level alphabet). Special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>``
    (id 1), ``<|im_end|>`` (eos, id 2). Left padding, as TRL's generation expects.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# The text model of every tiny model here (Qwen2's fields): ~30k parameters with the tiny tokenizer.
_TINY_TEXT: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    pad_token_id=PAD_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    bos_token_id=None,
)


def _tiny_qwen2_config(vocab_size: int, overrides: dict[str, Any]):
    from transformers import Qwen2Config

    params: dict[str, Any] = dict(
        vocab_size=vocab_size,
        **_TINY_TEXT,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    reference = Qwen2Config()
    unknown = [key for key in overrides if key not in params and not hasattr(reference, key)]
    if unknown:
        raise TypeError(f"Unknown Qwen2Config field(s) {sorted(unknown)}; pass fields of transformers.Qwen2Config.")
    params.update(overrides)
    return Qwen2Config(**params)


# Head sizes vLLM's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_vllm_compatible(config: Any) -> None:
    """Raise a `ValueError` saying why vLLM (CPU build) would refuse a model with this config, if it would."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"vLLM's CPU attention supports head sizes {list(VLLM_CPU_HEAD_SIZES)}; this model has head_dim={head_dim} "
            f"(hidden_size={config.hidden_size} / num_attention_heads={config.num_attention_heads}). Build it with "
            "build_tiny_model_and_tokenizer(vllm=True) (one head of 32), or choose hidden_size and "
            "num_attention_heads so that their quotient is one of those sizes."
        )


def build_tiny_model_and_tokenizer(seed: int = 0, *, vllm: bool = False, **config_overrides: Any):
    """Build a tiny causal LM (Qwen2 architecture, ~30k parameters) and its tokenizer, fully offline.

    Args:
        seed: seeds the weight initialisation; the same seed gives bit-identical weights.
        vllm: build one vLLM's CPU build accepts: one attention head and one key-value head, so head_dim is 32
            (the default 4 heads of 8 are below vLLM's smallest head size). Raises a `ValueError` naming the
            problem when the overrides make it incompatible. vLLM loads models from disk: see `save_tiny_model`.
        **config_overrides: fields of `transformers.Qwen2Config`, e.g. ``initializer_range=0.5`` for a peaked
            (far from uniform) policy, which tests of clipping and masking need.

    Returns:
        ``(model, tokenizer)``: a `Qwen2ForCausalLM` in float32 with a generation config (eos = pad-free
        ``<|im_end|>``), and the tokenizer of `build_tiny_tokenizer`.
    """
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    if vllm:
        config_overrides = {"num_attention_heads": 1, "num_key_value_heads": 1, **config_overrides}
    config = _tiny_qwen2_config(len(tokenizer), config_overrides)
    if vllm:
        check_vllm_compatible(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    return model, tokenizer


def save_tiny_model(model: Any, tokenizer: Any, directory: str | os.PathLike[str]) -> Path:
    """Write a tiny model and its tokenizer where `from_pretrained` and vLLM (``LLM(model=directory)``) load them.

    Returns the directory. The weights are saved as float32 safetensors; vLLM picks its own dtype unless told
    (docs/installation.md: vLLM on the CPU).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_reward_model(seed: int = 0, **config_overrides: Any):
    """Build a tiny sequence-classification reward model (one label) and its tokenizer, fully offline.

    The score of a sequence is read at its last non-pad token, as `transformers` does for Qwen2.
    """
    from transformers import Qwen2ForSequenceClassification

    tokenizer = build_tiny_tokenizer()
    config = _tiny_qwen2_config(len(tokenizer), {"num_labels": 1, **config_overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    return model, tokenizer


# ------------------------------------------------------------------------------------------------ vision-language
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # Qwen-VL's
# ChatML with Qwen-VL's image placeholder: a content part {"type": "image"} becomes <|vision_start|><|image_pad|>
# <|vision_end|>, which the processor expands to one <|image_pad|> per merged patch.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n'}}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{'<|vision_start|><|image_pad|><|vision_end|>'}}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def build_tiny_vlm_and_processor(seed: int = 0, family: str = "qwen2_vl"):
    """Build a tiny vision-language model (Qwen2-VL or Qwen2.5-VL architecture) and its processor, fully offline.

    The processor is the family's own (`Qwen2VLProcessor` / `Qwen2_5_VLProcessor`) over the PIL image processor
    (no torchvision needed) and the tiny tokenizer with Qwen-VL's vision tokens; images of 28×28 to 56×56 pixels
    become 1 to 4 merged patches. Videos are not supported (their processor needs torchvision).

    Args:
        seed: seeds the weight initialisation.
        family: ``"qwen2_vl"`` or ``"qwen2_5_vl"``.

    Returns:
        ``(model, processor)``: a ``*ForConditionalGeneration`` in float32 (~100k parameters) and its processor,
        whose chat template renders ``{"type": "image"}`` content parts.
    """
    from transformers import GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if family not in VLM_FAMILIES:
        raise ValueError(f"family={family!r}: use one of {list(VLM_FAMILIES)}.")
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    text = dict(
        vocab_size=len(tokenizer),
        **_TINY_TEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},  # head_dim 8
    )
    vision = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model
        from transformers import Qwen2VLProcessor as Processor

        vision.update(embed_dim=32, hidden_size=32, mlp_ratio=2)
    else:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model
        from transformers import Qwen2_5_VLProcessor as Processor

        vision.update(
            hidden_size=32, out_hidden_size=32, intermediate_size=64, window_size=56, fullatt_block_indexes=[0]
        )
    config = Config(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=start,
        vision_end_token_id=end,
        image_token_id=image,
        video_token_id=video,
        tie_word_embeddings=True,
    )

    class OfflineProcessor(Processor):
        """The family's processor without a video processor (whose classes need torchvision)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    processor = OfflineProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=VLM_CHAT_TEMPLATE
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Model(config)
    model.generation_config = GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    return model, processor


# ----------------------------------------------------------------------------------------------------------------
# Scripted RLM trees: deterministic stepwise-RLM rollouts for tests and benchmarks (a real REPL runs the code)
# ----------------------------------------------------------------------------------------------------------------
def repl_code(source: str) -> str:
    """``source`` as the scaffold's REPL code block."""
    return f"```repl\n{source}\n```"


# Tree of "root task": root spawns A, B, C (k=3); A spawns A1, A2 (k=2). Weights 1, 1/3, 1/6, 1/6, 1/3, 1/3.
RLM_SCRIPT = {
    "root task": [
        repl_code("answers = rlm_query_batched(['sub A', 'sub B', 'sub C'])\nprint(answers)"),
        "FINAL({root})",
    ],
    "sub A": [repl_code("x = rlm_query_batched(['leaf A1', 'leaf A2'])\nprint(x)"), "FINAL(A done)"],
    "leaf A1": [repl_code("print('a1')"), "FINAL(a1)"],
    "leaf A2": [repl_code("print('a2')"), repl_code("print('a2 again')"), "FINAL(a2)"],
    "sub B": [repl_code("print(1)"), "FINAL(B)"],
    "sub C": [repl_code("print(2)"), repl_code("print(3)"), "FINAL(C)"],
    # a one-node tree for a second prompt (fewer rows)
    "small task": [repl_code("print(len(context))"), "FINAL({root})"],
}
RLM_SCRIPT_TURNS = {"root task": 2 + 2 + 2 + 3 + 2 + 3, "small task": 2}  # turns of every node of each tree
_TASK_AND_TURN = re.compile(r"Task: (.*?)\n\nTurn (\d+) of", re.DOTALL)
_VARIANT = re.compile(r"# variant (\d)")


class VariantGenerator(ScriptedGenerator):
    """Plays ``script`` (task -> the action of each turn; `RLM_SCRIPT` by default). Roots (the tasks in ``roots``)
    alternate between two variants in the order their first turns reach the generator (the engine sends every root's
    first turn in task order, in one call): variant 0 answers "yes", variant 1 "no" (an action's ``{root}``).
    Deterministic whatever order the REPLs finish in, so group advantages are non-zero and reproducible (with
    `yes_reward`)."""

    def __init__(self, tokenizer, script: dict[str, list[str]] = RLM_SCRIPT, roots=("root task", "small task")):
        super().__init__(self._respond, tokenizer)
        self.script, self.roots, self.roots_seen = script, roots, 0

    def _respond(self, prompt: str) -> str:
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        task, turn = _TASK_AND_TURN.search(last_user).groups()
        action = self.script[task][int(turn) - 1]
        if int(turn) == 1 and task in self.roots:
            variant, self.roots_seen = self.roots_seen % 2, self.roots_seen + 1
            return action.replace("```repl\n", f"```repl\n# variant {variant}\n")
        if "{root}" in action:
            return action.format(root="yes" if _VARIANT.search(prompt).group(1) == "0" else "no")
        return action


def yes_reward(completions, **kwargs):
    """1.0 for a completion that is exactly "yes" (stripped), else 0.0."""
    return [1.0 if text.strip() == "yes" else 0.0 for text in completions]
