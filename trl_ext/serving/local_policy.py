"""`LocalPolicy`: the asynchronous trainers' sampler without a vLLM server, a copy of the policy in this process.

TRL's `AsyncGRPOTrainer` samples from ``vllm serve`` and publishes each new policy to it through a
``WeightTransferProtocol`` (``weight_transfer=``). `LocalPolicy` plays both sides in the trainer's own process:

- it is a `trl_ext.rlm.Generator` (``generator=`` of a trl-ext asynchronous trainer): a copy of the model samples
  with ``model.generate`` (`TransformersGenerator`, per-token log-probs of the processed scores, as vLLM's
  ``processed_logprobs``), in the rollout worker's thread;
- it is TRL's ``WeightTransferProtocol`` (``weight_transfer=``): on every sync TRL streams the policy's weights
  (an adapter merged into the base weights first, as for vLLM) and they are copied into the sampling copy.

``pause`` waits for the ``generate`` call in flight (one engine wave) and holds further calls until ``resume``, so a
call never samples from half-copied weights. Staleness is real: the worker samples from the version last synced
while the trainer trains on, exactly as against a server, and p_old is the sampling copy's log-probs.

What it is for: small models and machines without vLLM (CPU tests, debugging, the staleness benchmark in
``benchmarks/async_staleness.py``). Sampling with ``model.generate`` is far slower than vLLM for real models and
shares this process's cores and memory with training (a second copy of the weights); use ``vllm serve`` for real
runs. Sampling draws from torch's global random stream, which the training thread shares, so runs are not
reproducible draw for draw (no asynchronous run is: which version samples what depends on timing).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..rlm.generators import Completion, SamplingSettings, TransformersGenerator

__all__ = ["LocalPolicy", "pair_local_policy"]

# The config fields that make two checkpoints of one architecture hold the same weights' names and shapes.
ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def pair_local_policy(generator: Any, weight_transfer: Any) -> tuple[Any, Any]:
    """A `LocalPolicy` passed as only one of a trainer's ``generator=`` / ``weight_transfer=`` is both: it samples and
    receives the weights it samples from. Returns ``(generator, weight_transfer)``."""
    if isinstance(generator, LocalPolicy) and weight_transfer is None:
        return generator, generator
    if isinstance(weight_transfer, LocalPolicy) and generator is None:
        return weight_transfer, weight_transfer
    return generator, weight_transfer


class LocalPolicy:
    """A sampling copy of the policy that receives the trainer's weights (module docstring).

    Args:
        model: a causal LM to copy for sampling (it is deep-copied, frozen and put in eval mode), or a path/Hub id
            to load one from (float32).
        tokenizer: the policy's tokenizer (pad and eos ids).
        settings: how to sample (`SamplingSettings`; a trainer's are ``SamplingSettings.from_trl(args)``).
        batch_size: prompts per ``generate`` call (None: one call for all of a wave's prompts).

    Pass the same object as ``generator=`` and ``weight_transfer=`` to a trl-ext asynchronous trainer. It uses no
    server, so the trainer does not probe ``vllm_server_base_url``.

    Attributes:
        model: the sampling copy.
        version: syncs received so far.
    """

    uses_server = False  # read by `trl_ext.trainers.ext_async_grpo.watch_server`: nothing to probe

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        settings: SamplingSettings | None = None,
        batch_size: int | None = None,
    ) -> None:
        import copy

        from transformers import AutoModelForCausalLM

        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        else:
            model = copy.deepcopy(model)
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.version = 0
        self._generator = TransformersGenerator(model, tokenizer, settings=settings, batch_size=batch_size)
        self._lock = threading.Lock()

    @property
    def max_model_len(self) -> int | None:
        """The longest sequence the copy's model takes (``max_position_embeddings``), or None when its config does not
        say: the trainer's default ``token_budget``, as vLLM's ``max_model_len`` is for a server."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def check_model(self, config: Any) -> None:
        """Raise when ``config`` (the trained model's) differs from the sampling copy's in a field that sets the
        weights' names or shapes: the first weight sync would fail, or the copy would sample from another model."""
        mine = self.model.config
        differ = [
            f"{name}: trained {getattr(config, name, None)!r}, sampling copy {getattr(mine, name, None)!r}"
            for name in ARCHITECTURE_FIELDS
            if getattr(config, name, None) != getattr(mine, name, None)
        ]
        if differ:
            raise ValueError(
                "The LocalPolicy's model is not the model the trainer trains (" + "; ".join(differ) + "). Build it "
                "from the same path: LocalPolicy(model_path, tokenizer, ...) with the trainer's model_path."
            )

    # ------------------------------------------------------------------------------ trl_ext.rlm.Generator
    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """Sample a completion of each prompt from the weights last synced (waits while a sync is copying)."""
        with self._lock:
            return self._generator.generate(prompts)

    # ------------------------------------------------------------------------------ TRL's WeightTransferProtocol
    def init_weight_transfer(self) -> None:
        """Nothing to set up: the weights are copied in process."""

    def pause(self) -> None:
        """Wait for the ``generate`` call in flight; hold the next ones until `resume`."""
        self._lock.acquire()

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the streamed ``(name, tensor)`` pairs (the base checkpoint's names) into the sampling copy.

        A name the copy does not have, or a shape that differs, is an error naming it: the copy would otherwise
        sample from weights the trainer no longer has.
        """
        state = self.model.state_dict(keep_vars=True)
        try:
            self._copy(state, iterator)
        except BaseException:
            if self._lock.locked():
                self._lock.release()  # a failed sync ends training: never leave the worker's thread waiting
            raise
        self.version += 1

    def _copy(self, state: dict[str, torch.Tensor], iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in iterator:
                target = state.get(name)
                if target is None:
                    raise KeyError(
                        f"LocalPolicy received the weight {name!r}, which its sampling copy does not have: build it "
                        "from the same architecture the trainer trains (the same model path)."
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"LocalPolicy received {name!r} with shape {tuple(tensor.shape)}; its copy has "
                        f"{tuple(target.shape)}."
                    )
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))

    def resume(self) -> None:
        """Let ``generate`` calls run again (after `pause`)."""
        self._lock.release()

    def destroy(self) -> None:
        """Nothing to release."""
