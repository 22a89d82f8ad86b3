"""The packed layout of trl_ext.packing against hand-built and brute-force references (no model)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trl_ext.packing import (
    MAX_PACKED_TOKEN_RATIO,
    MIN_SAVED_TOKENS,
    PackedBatch,
    TreeSequence,
    group_micro_batches,
    pack_rows,
    packing_obstacle,
    rows_from_padded,
    tree_mask,
    worth_packing,
)


def visible(row) -> torch.Tensor:
    """(L, L) bool: the tree mask of one packed row."""
    batch = PackedBatch.collate([row], "cpu")
    return batch.dense_mask(torch.float32)[0, 0] == 0


def test_two_completions_of_one_prompt_by_hand():
    # prompt [5, 6, 7]; completions [8, 9] and [8, 10]: they share "8" too, but the shared "8" would then have to
    # predict both 9 and 10, so the second row repeats it in its own branch (same position, same context).
    packing = pack_rows([[5, 6, 7, 8, 9], [5, 6, 7, 8, 10]], [3, 3], completion_length=3, max_packed_tokens=100)
    (row,) = packing.packed
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9, 8, 10]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert row.labels.tolist() == [-100, -100, 8, 9, -100, 10, -100]
    assert [s.tolist() for s in row.scored] == [[2, 3], [2, 5]]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for q in range(5):  # the first row: plain causal
        expected[q, : q + 1] = True
    expected[5, [0, 1, 2, 5]] = True  # the branch sees the prompt up to its branch point, then itself
    expected[6, [0, 1, 2, 5, 6]] = True
    assert torch.equal(visible(row), expected)
    assert packing.real_tokens == 10 and packing.packed_tokens == 7


def test_a_row_contained_in_another_adds_no_token():
    # a padding row (a copy with its completion masked): prompt only
    packing = pack_rows([[1, 2, 3, 4], [1, 2, 3]], [2, 3], completion_length=2, max_packed_tokens=100)
    assert packing.packed_tokens == 4 and len(packing.packed) == 1
    assert [s.tolist() for s in packing.packed[0].scored] == [[1, 2], []]


def test_rows_are_never_dropped_and_the_budget_splits_packed_rows():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5], [9, 8, 7, 6, 5, 4, 3], [1, 2, 3, 6]]
    packing = pack_rows(rows, [3, 3, 2, 3], completion_length=5, max_packed_tokens=6)
    placed = sorted(row for packed in packing.packed for row in packed.rows)
    assert placed == [0, 1, 2, 3]
    # [1 2 3 4] + branch [3 5] = 6 tokens; the 7-token row exceeds the budget alone; the last row starts anew
    assert [len(p) for p in packing.packed] == [6, 7, 4]


def test_unpack_puts_each_value_at_its_row_and_zero_beyond():
    packing = pack_rows([[5, 6, 7, 8, 9], [5, 6, 7, 8]], [3, 3], completion_length=3, max_packed_tokens=100)
    values = [torch.arange(len(p), dtype=torch.float32) * 10 for p in packing.packed]
    out = packing.unpack(values)
    scored = packing.packed[0].scored
    assert out.tolist() == [[10.0 * scored[0][0], 10.0 * scored[0][1], 0.0], [10.0 * scored[1][0], 0.0, 0.0]]


@pytest.mark.parametrize("seed", range(5))
def test_random_trees_every_scored_position_sees_exactly_its_row(seed):
    """Brute force: each row's scored positions see exactly the packed positions of the row's earlier tokens, hold
    those tokens at their depth, and predict the row's next token."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 8))] for _ in range(3)]
    sequences, prompt_lengths = [], []
    for _ in range(12):
        prompt = list(rng.choice(prompts))
        if rng.random() < 0.3:
            prompt += [rng.randrange(3, 50) for _ in range(rng.randrange(1, 4))]
        completion = [rng.randrange(3, 6) for _ in range(rng.randrange(0, 6))]  # few ids: shared beginnings
        sequences.append(prompt + completion)
        prompt_lengths.append(len(prompt))
    packing = pack_rows(sequences, prompt_lengths, completion_length=6, max_packed_tokens=rng.choice([8, 25, 1000]))
    assert sorted(r for p in packing.packed for r in p.rows) == list(range(12))
    for packed in packing.packed:
        mask = visible(packed)
        for row, scored in zip(packed.rows, packed.scored):
            sequence, prompt_length = sequences[row], prompt_lengths[row]
            assert len(scored) == len(sequence) - prompt_length
            for offset, position in enumerate(scored.tolist()):
                depth = prompt_length - 1 + offset
                seen = torch.nonzero(mask[position]).flatten()
                assert packed.input_ids[seen].tolist() == sequence[: depth + 1]
                assert packed.position_ids[seen].tolist() == list(range(depth + 1))
                assert packed.labels[position].item() == sequence[depth + 1]


def test_rows_from_padded_reads_trl_padding_and_refuses_anything_else():
    input_ids = torch.tensor([[0, 4, 5, 6, 7, 0], [3, 4, 5, 6, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    sequences, prompt_lengths = rows_from_padded(input_ids, mask, logits_to_keep=3)
    assert sequences == [[4, 5, 6, 7], [3, 4, 5, 6]] and prompt_lengths == [2, 3]
    holes = torch.tensor([[1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    assert rows_from_padded(input_ids, holes, logits_to_keep=3) is None
    no_prompt = torch.tensor([[0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    assert rows_from_padded(input_ids, no_prompt, logits_to_keep=3) is None


def test_flex_mask_mod_is_the_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    packing = pack_rows(
        [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7], [8, 9]], [2, 2, 2, 1], completion_length=3, max_packed_tokens=9
    )
    batch = PackedBatch.collate(packing.packed, "cpu")

    def mask_mod(b, h, q, kv):
        return tree_mask(b, q, kv, batch.segment_ids, batch.visible_end)

    rows, length = batch.input_ids.shape
    flex = create_mask(mask_mod, rows, 1, length, length, device="cpu")
    assert torch.equal(flex, batch.dense_mask(torch.float32) == 0)
    # padding sees only padding (no fully masked query row: no NaN)
    assert bool((batch.dense_mask(torch.float32) == 0).any(-1).all())


def test_group_micro_batches_keeps_groups_together_and_every_row():
    torch.manual_seed(0)
    groups = torch.tensor([0, 1, 2, 3] * 4)[torch.randperm(16)]
    micro = [
        {
            "prefix_group": groups[i * 4 : (i + 1) * 4],
            "row": torch.arange(16)[i * 4 : (i + 1) * 4],
            "n": torch.tensor(9),
        }
        for i in range(4)
    ]
    arranged = group_micro_batches(micro, generator=torch.Generator().manual_seed(0))
    assert len(arranged) == 4 and all(len(batch["row"]) == 4 for batch in arranged)
    assert sorted(torch.cat([b["row"] for b in arranged]).tolist()) == list(range(16))
    assert all(len(set(batch["prefix_group"].tolist())) == 1 for batch in arranged)
    assert all(batch["n"].item() == 9 for batch in arranged)
    assert np.array_equal(group_micro_batches(micro[:1], generator=torch.Generator())[0]["row"], micro[0]["row"])


def test_group_micro_batches_leaves_the_global_random_stream_alone():
    """The groups' order comes from the generator passed in: the same generator seed gives the same split, and
    TRL's draws from the global stream (sampling, shuffles) stay where they were."""
    micro = [{"prefix_group": torch.tensor([i, i + 4]), "row": torch.tensor([2 * i, 2 * i + 1])} for i in range(4)]
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    first = group_micro_batches(micro, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.rand(3), expected)
    again = group_micro_batches(micro, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(a["row"], b["row"]) for a, b in zip(first, again))


def test_pack_rows_rejects_rows_it_cannot_score():
    with pytest.raises(ValueError, match="at least one prompt token"):
        pack_rows([[1, 2]], [0], completion_length=2, max_packed_tokens=10)
    with pytest.raises(ValueError, match="max_packed_tokens"):
        pack_rows([[1, 2]], [1], completion_length=2, max_packed_tokens=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "flex_attention"])
def test_packed_forward_equals_rows_for_the_model_families_trl_users_train(family, attention):
    """Through transformers' attention interface: the tree mask and position ids reach every layer."""
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    from trl_ext.packing import packed_logps_and_entropies

    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    config = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    # 2 prompts x 3 completions, TRL's padding: prompts left, completions right
    width, completion = 9, 5
    rows, masks = [], []
    for prompt_length in (6, 9):
        prompt = torch.randint(3, 64, (prompt_length,))
        for length in (5, 3, 4):
            ids = torch.cat([torch.zeros(width - prompt_length, dtype=torch.long), prompt, torch.randint(3, 64, (5,))])
            mask = torch.cat([torch.zeros(width - prompt_length), torch.ones(prompt_length + length)])
            rows.append(ids)
            masks.append(torch.cat([mask, torch.zeros(width + completion - len(mask))]).long())
    input_ids, attention_mask = torch.stack(rows), torch.stack(masks)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :width] = -100
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        packing = pack_rows(*rows_from_padded(input_ids, attention_mask, completion), completion, 1000)
        logps, entropies = packed_logps_and_entropies(model, packing, True, attention)
    scored = attention_mask[:, width:].bool()
    assert packing.packed_tokens < packing.real_tokens
    assert (logps - out.log_probs[:, -completion:])[scored].abs().max() < 1e-5
    assert (entropies - out.entropy[:, -completion:])[scored].abs().max() < 1e-5


@pytest.mark.parametrize(
    ("obstacle", "expected"),
    [
        ({"multimodal": True}, "the batch has multimodal inputs"),
        ({"router_loss": True}, "the MoE router loss counts every token"),
        ({"sharded": True}, "FSDP and DeepSpeed ranks would run different numbers of forwards"),
        (
            {"attention": "flash_attention_2"},
            "attention implementation 'flash_attention_2' takes no custom mask "
            "(use one of ['sdpa', 'eager', 'flex_attention'])",
        ),
        (
            {"attention": None},
            "attention implementation None takes no custom mask (use one of ['sdpa', 'eager', 'flex_attention'])",
        ),
        # several obstacles: the first in this order is named
        (
            {"multimodal": True, "router_loss": True, "sharded": True, "attention": None},
            "the batch has multimodal inputs",
        ),
        ({"router_loss": True, "sharded": True}, "the MoE router loss counts every token"),
        ({"sharded": True, "attention": "flash_attention_2"}, "FSDP and DeepSpeed ranks would run"),
    ],
)
def test_packing_obstacle_names_each_reason(obstacle, expected):
    kwargs = {"multimodal": False, "router_loss": False, "sharded": False, "attention": "sdpa", **obstacle}
    reason = packing_obstacle(**kwargs)
    assert reason is not None and reason.startswith(expected)
    if "(use one of" in expected:
        assert reason == expected


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flex_attention"])
def test_packing_obstacle_is_none_for_a_packable_pass(attention):
    assert packing_obstacle(multimodal=False, router_loss=False, sharded=False, attention=attention) is None


@pytest.mark.parametrize(
    ("mode", "padded", "packed", "expected"),
    [
        # "auto": packed / padded <= 0.8 and padded - packed >= 1024; 5120 x 0.8 = 4096 = 5120 - 1024: both at once
        ("auto", 5120, 4096, True),
        ("auto", 5120, 4097, False),  # ratio 0.8002 and 1023 saved: both just over
        ("auto", 5119, 4095, True),  # ratio 0.79996, 1024 saved
        ("auto", 5121, 4097, False),  # 1024 saved but ratio 0.80004
        ("auto", 10000, 8000, True),  # ratio exactly 0.8, 2000 saved
        ("auto", 10000, 8001, False),  # ratio 0.8001 only
        ("auto", 5000, 3976, True),  # ratio 0.795, exactly 1024 saved
        ("auto", 5000, 3977, False),  # 1023 saved only
        ("auto", 2000, 100, True),  # ratio 0.05, 1900 saved
        ("auto", 1000, 10, False),  # ratio 0.01: only 990 saved
        ("auto", 100000, 90000, False),  # 10000 saved: ratio 0.9
        ("auto", 4096, 4096, False),
        # "on" always, "off" never
        ("on", 5120, 4097, True),
        ("on", 100, 100, True),
        ("on", 100, 150, True),
        ("off", 100000, 10, False),
        ("off", 5120, 4096, False),
    ],
)
def test_worth_packing_thresholds(mode, padded, packed, expected):
    assert MAX_PACKED_TOKEN_RATIO == 0.8 and MIN_SAVED_TOKENS == 1024
    assert worth_packing(mode, padded, packed) is expected


def grouped_micro_batches() -> list[dict]:
    """4 micro-batches of 4 rows: 8 prefix groups (ids 10, 20, ..., 80) of 2 rows each, scattered across them."""
    groups = [30, 10, 50, 80, 10, 40, 60, 20, 70, 30, 20, 50, 40, 80, 60, 70]
    return [
        {
            "prefix_group": torch.tensor(groups[i * 4 : (i + 1) * 4]),
            "row": torch.arange(i * 4, (i + 1) * 4),
            "ids": torch.arange(i * 4, (i + 1) * 4).unsqueeze(1).repeat(1, 3),
            "name": [f"r{r}" for r in range(i * 4, (i + 1) * 4)],
            "num_items_in_batch": torch.tensor(42),
            "ref_per_token_logps": None,
        }
        for i in range(4)
    ]


def test_group_micro_batches_puts_each_group_in_one_micro_batch_in_the_generators_order():
    micro = grouped_micro_batches()
    state = torch.get_rng_state()
    arranged = group_micro_batches(micro, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), state)  # the global random stream is untouched
    # the groups come in the order of the generator's permutation of the sorted group ids, each group's rows in
    # their original order
    groups = [30, 10, 50, 80, 10, 40, 60, 20, 70, 30, 20, 50, 40, 80, 60, 70]
    permutation = torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    order = [10 * (index + 1) for index in permutation]
    rows = [row for group in order for row in range(16) if groups[row] == group]
    assert [b["row"].tolist() for b in arranged] == [rows[i * 4 : (i + 1) * 4] for i in range(4)]
    # e.g. group 10 is rows 1 and 4, group 20 rows 7 and 10: each ends in one micro-batch of 2 whole groups
    for batch in arranged:
        members = batch["prefix_group"].tolist()
        assert len(set(members)) == 2 and all(members.count(g) == 2 for g in members)
        assert batch["prefix_group"].tolist() == [groups[r] for r in batch["row"].tolist()]
        assert batch["ids"].tolist() == [[r] * 3 for r in batch["row"].tolist()]  # every value follows its row
        assert batch["name"] == [f"r{r}" for r in batch["row"].tolist()]
        assert batch["num_items_in_batch"].item() == 42 and batch["ref_per_token_logps"] is None
    # the same seed gives the same split, the global stream still untouched
    again = group_micro_batches(micro, generator=torch.Generator().manual_seed(3))
    assert [b["row"].tolist() for b in again] == [b["row"].tolist() for b in arranged]
    assert [b["name"] for b in again] == [b["name"] for b in arranged]
    assert torch.equal(torch.get_rng_state(), state)


def test_group_micro_batches_seeds_differ_and_the_input_is_kept():
    micro = grouped_micro_batches()
    splits = {
        tuple(tuple(b["row"].tolist()) for b in group_micro_batches(micro, generator=torch.Generator().manual_seed(s)))
        for s in range(6)
    }
    assert len(splits) > 1  # the order is drawn, not fixed
    assert [b["row"].tolist() for b in micro] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_group_micro_batches_without_groups_returns_the_split_as_is():
    micro = [{"row": torch.tensor([0, 1])}, {"row": torch.tensor([2, 3])}]
    state = torch.get_rng_state()
    assert group_micro_batches(micro, generator=torch.Generator().manual_seed(0)) is micro
    no_groups = [{**b, "prefix_group": None} for b in micro]
    assert group_micro_batches(no_groups, generator=torch.Generator().manual_seed(0)) is no_groups
    assert torch.equal(torch.get_rng_state(), state)


def random_packing(seed: int, max_packed_tokens: int):
    """Rows of a stepwise tree: a shared system prompt, per node a history, turns branching off it."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 50) for _ in range(rng.randrange(2, 6))]
    sequences, prompt_lengths = [], []
    for _ in range(rng.randrange(2, 4)):  # nodes
        history = system + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 5))]
        for _ in range(rng.randrange(1, 4)):  # turns: each a longer prompt of the node's history
            history = history + [rng.randrange(3, 6) for _ in range(rng.randrange(0, 3))]
            completion = [rng.randrange(3, 6) for _ in range(rng.randrange(1, 5))]
            sequences.append(history + completion)
            prompt_lengths.append(len(history))
            history = history + completion
    return sequences, prompt_lengths, pack_rows(sequences, prompt_lengths, 4, max_packed_tokens)


@pytest.mark.parametrize("seed", range(8))
def test_tree_sequence_paths_are_exactly_the_tree_mask(seed):
    """Brute force: in the varlen layout, each token's visible keys (its segment's path, causally) are the packed
    positions the dense tree mask lets it see, across several packed rows laid end to end."""
    _, _, packing = random_packing(seed, max_packed_tokens=random.Random(seed).choice([12, 30, 1000]))
    sequence = TreeSequence.collate(packing.packed, "cpu")
    cu_q, cu_k = sequence.cu_seqlens_q.tolist(), sequence.cu_seqlens_k.tolist()
    assert cu_q[-1] == sequence.input_ids.shape[1] == packing.packed_tokens
    segment = 0
    for row, offset in zip(packing.packed, sequence.offsets):
        mask = visible(row)
        for query in range(len(row)):
            while cu_q[segment + 1] <= offset + query:
                segment += 1
            path = sequence.kv_index[cu_k[segment] : cu_k[segment + 1]]
            length_q = cu_q[segment + 1] - cu_q[segment]
            seen = path[: len(path) - length_q + (offset + query - cu_q[segment]) + 1] - offset
            assert seen.tolist() == torch.nonzero(mask[query]).flatten().tolist()


def test_varlen_tree_attention_gives_the_rows_log_probs_and_gradients():
    """The CPU path (`TreeSequence` through `trl_ext.attention.tree_attention`) on a stepwise-like tree: the same
    log-probs, entropies and parameter gradients as the unpacked rows."""
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    from trl_ext.packing import packed_logps_and_entropies

    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, initializer_range=0.2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    sequences, prompt_lengths, packing = random_packing(3, max_packed_tokens=20)
    assert len(packing.packed) > 1 and packing.packed_tokens < packing.real_tokens
    weights = torch.rand(len(sequences), packing.completion_length, generator=torch.Generator().manual_seed(1))

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return [param.grad.clone() for param in model.parameters()]

    logps, entropies = packed_logps_and_entropies(model, packing, True, "sdpa")
    packed_grads = gradients((logps * weights).sum())
    unpacked = 0.0
    for row, (tokens, prompt_length) in enumerate(zip(sequences, prompt_lengths)):
        out = model(input_ids=torch.tensor([tokens]), shift_labels=_labels(tokens, prompt_length), fused_lm_head=True)
        n = len(tokens) - prompt_length
        scored = slice(prompt_length - 1, len(tokens) - 1)
        torch.testing.assert_close(logps[row, :n], out.log_probs[0, scored], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropies[row, :n], out.entropy[0, scored], rtol=1e-5, atol=1e-5)
        assert logps[row, n:].abs().sum() == 0
        unpacked = unpacked + (out.log_probs[0, scored] * weights[row, :n]).sum()
    for packed_grad, row_grad in zip(packed_grads, gradients(unpacked), strict=True):  # float32 sums, another order
        assert (packed_grad - row_grad).abs().max() <= 1e-4 * row_grad.abs().max() + 1e-8


def _labels(tokens: list[int], prompt_length: int) -> torch.Tensor:
    ids = torch.tensor([tokens])
    labels = torch.full_like(ids, -100)
    labels[0, prompt_length - 1 : -1] = ids[0, prompt_length:]
    return labels


def test_a_model_training_with_attention_dropout_keeps_the_dense_mask():
    """The varlen kernel has no dropout: such a model's packed pass takes the dense mask (its SDPA is not wrapped)."""
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    from trl_ext.packing import packed_logps_and_entropies

    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attention_dropout=0.1, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config).train()
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    _, _, packing = random_packing(1, max_packed_tokens=1000)
    logps, _ = packed_logps_and_entropies(model, packing, False, "sdpa")
    assert model.config._attn_implementation == "sdpa" and torch.isfinite(logps).all()
    packed_logps_and_entropies(model.eval(), packing, False, "sdpa")  # without dropout: the varlen path
    assert model.config._attn_implementation == "trl_ext_tree:sdpa"
