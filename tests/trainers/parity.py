"""What the differential tests share: one training step of the same policy through the synchronous and the
asynchronous trainer, and the check that the two gradients agree."""

from __future__ import annotations

from typing import Any

import torch


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def step_both(sync: Any, sync_batch: dict, asynchronous: Any, async_batch: dict, *, scale: float) -> tuple[Any, Any]:
    """Move the sync trainer's policy by ``scale`` × seeded noise (so every ratio moves), copy it into the async
    trainer's, and run one loss and backward pass in each; returns the two losses."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in sync.model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    asynchronous.model.load_state_dict(sync.model.state_dict())
    sync.model.zero_grad()
    sync_loss = sync.compute_loss(sync.model, sync_batch)
    sync_loss.backward()
    asynchronous.model.train()
    asynchronous.model.zero_grad()
    asynchronous.current_gradient_accumulation_steps = 1
    async_loss = asynchronous.compute_loss(asynchronous.model, async_batch)
    async_loss.backward()
    return sync_loss, async_loss


def assert_same_gradients(sync_model: Any, async_model: Any, rel: float = 1e-4) -> None:
    """Every parameter's gradient within ``rel`` (relative norm): float32 sums in another order (padded rows vs one
    packed row)."""
    sync_grads, async_grads = grads(sync_model), grads(async_model)
    assert sync_grads.keys() == async_grads.keys() and sync_grads
    for name in sync_grads:
        error = (async_grads[name] - sync_grads[name]).norm() / sync_grads[name].norm()
        assert error < rel, f"{name}: relative gradient error {error:.2e}"
