"""`trl_ext.trainers.async_seam`: the CPU tree-attention kernel against a dense reference, the CPU patch, and
`check_trl_async` against the pinned TRL (and a TRL that differs)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer, packing

import trl_ext
from trl_ext.attention import attention_allowed, flash_attn_varlen_cpu
from trl_ext.trainers.async_seam import (
    ASYNC_ATTRIBUTES,
    ASYNC_MODULE_ATTRIBUTES,
    ASYNC_SEAM,
    KERNEL_KEYWORDS,
    check_trl_async,
    cpu_support_installed,
    install_cpu_support,
)
from trl_ext.trainers.async_seam import check as async_check

from .test_trl_seam import _trl_private_names, private_trl_uses

# ----------------------------------------------------------------------------------------------------------------
# The kernel: a small tree by hand (a 3-token prompt shared by two 2-token completions)
# ----------------------------------------------------------------------------------------------------------------
# TRL's trie forks one token before the samples differ, so prompt [1, 2, 3] + [4, 5] and + [6, 7] pack as
# segment 0 = [1, 2] (positions 0-1), segment 1 = [3, 4, 5] and segment 2 = [3, 6, 7] (positions 2-4 each).
PACKED_IDS = [1, 2, 3, 4, 5, 3, 6, 7]
KV_INDEX = [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7]  # each segment's root-to-segment path
CU_Q, CU_K = [0, 2, 5, 8], [0, 2, 7, 12]
# Packed position -> the packed positions it attends to (its ancestors in the tree, itself included).
ANCESTORS = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3, 4], 5: [0, 1, 5], 6: [0, 1, 5, 6]}
ANCESTORS[7] = [0, 1, 5, 6, 7]
# With window_size=(1, 0): itself and its parent only.
WINDOW_1 = {0: [0], 1: [0, 1], 2: [1, 2], 3: [2, 3], 4: [3, 4], 5: [1, 5], 6: [5, 6], 7: [6, 7]}


def test_trl_packs_the_hand_built_tree_as_written_here():
    row = packing.TreeRow()
    for completion in ([4, 5], [6, 7]):
        ids = torch.tensor([1, 2, 3, *completion])
        mask = torch.tensor([0, 0, 0, 1, 1])
        row.add({"input_ids": ids, "completion_mask": mask, "old_log_probs": torch.zeros(5), "advantage": 1.0,
                 "group_id": 0})  # fmt: skip
    packed = row.pack()
    assert packed["input_ids"].tolist() == PACKED_IDS
    assert packed["tree_kv_index"].tolist() == KV_INDEX
    assert (packed["tree_cu_seqlens_q"].tolist(), packed["tree_cu_seqlens_k"].tolist()) == (CU_Q, CU_K)


def dense_tree_attention(q, k, v, visible: dict[int, list[int]], scale: float, softcap: float = 0.0):
    """Reference: every packed query attends to the packed keys ``visible[query]``; ``(N, H, D)`` queries,
    ``(N, Hkv, D)`` keys and values (key/value head ``h // (H // Hkv)`` serves query head ``h``)."""
    n, heads, _ = q.shape
    mask = torch.zeros(n, n, dtype=torch.bool)
    for query, keys in visible.items():
        mask[query, keys] = True
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize(
    ("window_size", "visible", "softcap"),
    [((-1, -1), ANCESTORS, 0.0), ((1, 0), WINDOW_1, 0.0), ((-1, -1), ANCESTORS, 2.0)],
    ids=["causal", "window", "softcap"],
)
def test_cpu_kernel_equals_dense_tree_attention(window_size, visible, softcap):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, 16, generator=generator)  # 4 query heads
    k, v = torch.randn(2, 8, 2, 16, generator=generator)  # 2 key/value heads: grouped-query attention
    index = torch.tensor(KV_INDEX)
    out = flash_attn_varlen_cpu(
        q, k.index_select(0, index), v.index_select(0, index), torch.tensor(CU_Q, dtype=torch.int32),
        torch.tensor(CU_K, dtype=torch.int32), 3, 5, softmax_scale=0.3, causal=True, window_size=window_size,
        softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, dense_tree_attention(q, k, v, visible, 0.3, softcap), rtol=1e-5, atol=1e-6)


def test_causal_mask_is_bottom_right_aligned():
    # 2 queries, the last 2 of 4 keys: query 0 sees keys 0-2, query 1 all 4.
    assert attention_allowed(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert attention_allowed(2, 4, window_size=(0, 0)).tolist() == [[False, False, True, False], [False] * 3 + [True]]


def test_cpu_kernel_takes_every_keyword_trl_passes_and_keeps_the_dtype():
    parameters = inspect.signature(flash_attn_varlen_cpu).parameters
    assert set(KERNEL_KEYWORDS) <= set(parameters)
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert flash_attn_varlen_cpu(q, q, q, cu, cu, causal=True).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not a multiple"):
        flash_attn_varlen_cpu(torch.zeros(3, 3, 8), torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), cu, cu)


# ----------------------------------------------------------------------------------------------------------------
# The CPU patch
# ----------------------------------------------------------------------------------------------------------------
def test_cpu_support_keeps_trl_on_cuda_and_runs_on_the_cpu(monkeypatch):
    cuda_flops = SimpleNamespace(calls=[])
    monkeypatch.setattr(packing, "_flash_attn", lambda: pytest.fail("TRL's FA3 fetched for CPU tensors"))
    monkeypatch.setattr(
        async_grpo_trainer,
        "get_peak_flops_per_device",
        lambda accelerator, dtype: cuda_flops.calls.append(dtype) or 1.0,
    )
    assert not cpu_support_installed()
    install_cpu_support()
    install_cpu_support()  # idempotent
    assert cpu_support_installed()
    q = torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    out = packing._flash_attn().flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, softmax_scale=None, causal=True)
    torch.testing.assert_close(out, flash_attn_varlen_cpu(q, q, q, cu, cu, causal=True))
    lookup = async_grpo_trainer.get_peak_flops_per_device
    assert lookup(SimpleNamespace(device=torch.device("cpu")), "float32") is None
    assert lookup(SimpleNamespace(device=torch.device("cuda", 0)), "bfloat16") == 1.0
    assert cuda_flops.calls == ["bfloat16"]
    check_trl_async()  # the replaced attributes are accepted


# ----------------------------------------------------------------------------------------------------------------
# check_trl_async
# ----------------------------------------------------------------------------------------------------------------
FIX = r"pip install 'trl>=1.16,<1.17'"


def test_check_trl_async_passes_on_the_pinned_trl():
    check_trl_async()


def test_check_trl_async_names_a_changed_method(monkeypatch):
    def compute_loss(self, model, inputs):  # a TRL whose compute_loss lost parameters
        return None

    monkeypatch.setattr(AsyncGRPOTrainer, "compute_loss", compute_loss)
    with pytest.raises(ImportError, match=rf"AsyncGRPOTrainer\.compute_loss\('self', 'model', 'inputs'\).*{FIX}"):
        check_trl_async()


@pytest.mark.parametrize(
    ("module", "name"), list(ASYNC_MODULE_ATTRIBUTES), ids=lambda item: getattr(item, "__name__", item)
)
def test_check_trl_async_names_a_missing_module_attribute(monkeypatch, module, name):
    monkeypatch.delattr(module, name)
    with pytest.raises(ImportError, match=rf"{module.__name__}\.{name} is missing.*{FIX}"):
        check_trl_async()


def test_check_trl_async_compares_the_module_functions_it_replaces(monkeypatch):
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda device: None)
    with pytest.raises(
        ImportError, match=r"get_peak_flops_per_device\('device',\) \(expected \('accelerator', 'dtype'\)\)"
    ):
        check_trl_async()


def test_check_trl_async_names_a_sample_field_trl_ext_fills_and_trl_lost(monkeypatch):
    @dataclasses.dataclass
    class RolloutSample:  # a TRL whose sample record renamed ``metrics``
        prompt: str
        completion: str
        input_ids: list
        completion_mask: list
        old_log_probs: list
        advantage: float
        model_version: int
        group_id: int
        extras: dict

    monkeypatch.setattr(async_check, "RolloutSample", RolloutSample)
    with pytest.raises(ImportError, match=rf"RolloutSample has no field metrics.*{FIX}"):
        check_trl_async()


def test_check_trl_async_names_a_missing_attribute(monkeypatch):
    monkeypatch.setattr(async_check, "ASYNC_ATTRIBUTES", (*ASYNC_ATTRIBUTES, "_renamed_in_a_new_trl"))
    with pytest.raises(ImportError, match=rf"AsyncGRPOTrainer has no attribute _renamed_in_a_new_trl.*{FIX}"):
        check_trl_async()


def test_check_trl_async_reads_the_attributes_trl_assigns():
    assigned = async_check.assigned_attributes(async_check.AsyncGRPOTrainer)
    assert {"_metrics", "_step_forward_tokens", "_last_forward_time_s", "aux_loss_enabled"} <= assigned


def test_check_trl_async_names_changed_batch_keys(monkeypatch):
    keys = async_check.collated_batch_keys()
    assert keys == async_check.BATCH_KEYS and async_check._compute_loss_batch_keys() == async_check.FORWARD_KEYS
    monkeypatch.setattr(async_check, "collated_batch_keys", lambda: keys - {"segment_id"} | {"sample_index"})
    with pytest.raises(
        ImportError, match=r"collator returns the keys .*missing \['segment_id'\], new \['sample_index'\]"
    ):
        check_trl_async()


def test_check_trl_async_names_a_new_kernel_keyword(monkeypatch):
    monkeypatch.setattr(async_check, "_kernel_call_keywords", lambda: ("softmax_scale", "causal", "deterministic"))
    with pytest.raises(ImportError, match=rf"tree_attention passes the kernel .*'deterministic'.*{FIX}"):
        check_trl_async()


# ----------------------------------------------------------------------------------------------------------------
# The seam is closed: every private name of TRL's async trainer that trl-ext names is in the seam, and checked
# ----------------------------------------------------------------------------------------------------------------
def test_the_async_seam_checks_every_private_name_it_uses():
    trl_names = _trl_private_names()
    assert {"_step_forward_tokens", "_flash_attn"} <= trl_names  # the scan sees the async trainer's names
    seam = Path(trl_ext.__file__).parent / "trainers" / "async_seam"
    used = {
        use.split(".")[-1].split("(")[0]
        for path in seam.glob("*.py")
        for use in private_trl_uses(path.read_text(), trl_names)
    }
    checked = set(ASYNC_SEAM) | set(ASYNC_ATTRIBUTES) | {name for _, name in ASYNC_MODULE_ATTRIBUTES}
    assert used and used - checked == set(), used - checked
