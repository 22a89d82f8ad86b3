"""CPU support for TRL's asynchronous trainer: TRL's FlashAttention-3 fetch and peak-FLOPs lookup made to answer off
CUDA.

TRL's tree packing (``trl.experimental.async_grpo.packing.tree_attention``) fetches FlashAttention-3 from the Hub
through ``kernels`` (``packing._flash_attn``), a CUDA kernel, and ``AsyncGRPOTrainer.__init__`` calls
``get_peak_flops_per_device``, which calls ``torch.cuda.get_device_name`` unconditionally: on a CPU-only machine the
trainer fails to build, and its forward could not run. `install_cpu_support` replaces both module attributes with
versions that dispatch on the device: tensors on CUDA still go to TRL's kernel and lookup; anything else gets
`trl_ext.attention.flash_attn_varlen_cpu` and no MFU metric (None, TRL's "unknown device").
"""

from __future__ import annotations

from torch import Tensor
from trl.experimental.async_grpo import async_grpo_trainer, packing

from ...attention import flash_attn_varlen_cpu

__all__ = ["cpu_support_installed", "install_cpu_support"]


class _DeviceKernel:
    """What ``packing._flash_attn()`` returns once `install_cpu_support` ran: the varlen function by device."""

    def __init__(self, cuda_kernel):
        self._cuda_kernel = cuda_kernel

    def flash_attn_varlen_func(self, q: Tensor, *args, **kwargs):
        if q.is_cuda:
            return self._cuda_kernel().flash_attn_varlen_func(q, *args, **kwargs)
        return flash_attn_varlen_cpu(q, *args, **kwargs)


def install_cpu_support() -> None:
    """Replace TRL's FA3 fetch (``packing._flash_attn``) and peak-FLOPs lookup
    (``async_grpo_trainer.get_peak_flops_per_device``) by versions that keep TRL's on CUDA and run on the CPU
    otherwise. Process-wide and idempotent; the trainer calls it when it trains off CUDA."""
    if cpu_support_installed():
        return
    cuda_kernel = packing._flash_attn
    cuda_peak_flops = async_grpo_trainer.get_peak_flops_per_device

    def flash_attn() -> _DeviceKernel:
        return _DeviceKernel(cuda_kernel)

    def get_peak_flops_per_device(accelerator, dtype: str) -> float | None:
        if accelerator.device.type != "cuda":
            return None  # MFU is for GPUs: TRL's table has no CPU
        return cuda_peak_flops(accelerator, dtype)

    flash_attn.trl_ext_cpu_support = True
    get_peak_flops_per_device.trl_ext_cpu_support = True
    packing._flash_attn = flash_attn
    async_grpo_trainer.get_peak_flops_per_device = get_peak_flops_per_device


def cpu_support_installed() -> bool:
    """Whether `install_cpu_support` has replaced both of TRL's module attributes in this process."""
    return all(
        getattr(function, "trl_ext_cpu_support", False)
        for function in (packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device)
    )
