"""The policy's serving side of asynchronous training (docs/async.md): what rollouts are sampled from and how the
trainer's weights reach it, apart from the trainers that use it.

- `served_policy`: `ServedPolicyGenerator`, the `trl_ext.rlm.Generator` over ``vllm serve`` that samples from the
  policy version the trainer last published (`ServedGroupGenerator`: a group in one request);
- `local_policy`: `LocalPolicy`, an in-process sampling copy of the policy that receives the weight syncs (training
  without a vLLM server);
- `weight_sync`: `DiskWeightTransfer`, full weights to ``vllm serve`` without NCCL (safetensors and vLLM's reload),
  and `choose_weight_transfer`;
- `server_probe`: `probe_server`, one ``/health`` probe and why a server cannot be reached;
- `server_watch`: `ServerWatch`, a server that stops answering during training ends it with an error naming it.

Nothing here imports a trainer or TRL's trainers; the asynchronous trainers (`trl_ext.trainers.ext_async_grpo`) and
their rollout workers import these.
"""
