"""Run by tests/trainers/test_packing.py under `torchrun --nproc_per_node 2`: packed passes equal TRL's rows on
2 ranks (DDP all-reduces the gradients; each rank packs its own rows)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.trainers.test_packing import grpo_trainer, perturb  # noqa: E402
from tests.utils import end_distributed_script  # noqa: E402


def main(out_dir: str) -> None:
    trainer = grpo_trainer(Path(out_dir) / "run", loss_type="ipo", max_steps=1, ddp_backend="gloo")
    captured = []
    original = trainer.compute_policy_loss

    def capture(model, inputs):
        captured.append(inputs)
        return original(model, inputs)

    trainer.compute_policy_loss = capture
    trainer.train()  # wraps the model in DDP and leaves a scored micro-batch behind
    trainer.compute_policy_loss = original
    batch = captured[0]
    perturb(trainer.model)
    model = trainer.model_wrapped
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)

    results = {}
    for mode in ("off", "on"):
        trainer.args.prefix_sharing = mode
        before = len(trainer._metrics["train"]["packing/token_ratio"])
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        trainer.accelerator.backward(loss)
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results[mode] = loss.item(), grads, len(trainer._metrics["train"]["packing/token_ratio"]) > before
    (loss_rows, grads_rows, packed_rows), (loss_packed, grads_packed, packed) = results["off"], results["on"]
    problems = []
    if not packed or packed_rows:
        problems.append(f"packed={packed} packed_rows={packed_rows}")
    if abs(loss_packed - loss_rows) > 1e-6 * abs(loss_rows) + 1e-8 or abs(loss_rows) < 1e-4:
        problems.append(f"loss {loss_packed} vs {loss_rows}")
    for name, grad in grads_rows.items():
        error = ((grads_packed[name] - grad).norm() / grad.norm().clamp(min=1e-12)).item()
        if error >= 1e-4:
            problems.append(f"{name}: {error:.2e}")
    rank = trainer.accelerator.process_index
    report = "ok" if not problems else "FAILED " + "; ".join(problems)
    Path(out_dir, f"rank{rank}.txt").write_text(f"{report} loss={loss_rows:.6g} grads={len(grads_rows)}")
    end_distributed_script()  # every rank's results are written: leave without gloo's teardown (tests/utils.py)


if __name__ == "__main__":
    main(sys.argv[1])
