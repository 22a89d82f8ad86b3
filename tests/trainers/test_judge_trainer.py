"""`JudgeCreditConfig` / `JudgeCreditTrainer`: real training runs of the tiny model (LoRA, CPU) with a scripted judge
server on 127.0.0.1; the per-token advantages differ from the outcome advantage exactly on the judge's spans."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from trl_ext.judge import DEFAULT_LABEL_SCORES, strip_markers
from trl_ext.quickstart.scripted_server import ErrorReply, HangReply, ScriptedChatServer, TextReply
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.ext_grpo import ExtGRPOConfig
from trl_ext.trainers.judge_credit import JudgeCreditConfig, JudgeCreditTrainer

from ..utils import cpu_config_kwargs, digit_reward, toy_dataset

TRACE_BLOCK = re.compile(r"<<<(DATA-[0-9a-f]{16}) TRACE\n(.*?)\n\1>>>", re.DOTALL)


def judge_kwargs(server, **overrides):
    kwargs = dict(
        judge_base_url=server.base_url,
        judge_model="scripted-judge",
        judge_tools=[],
        judge_max_retries=0,
        judge_timeout=5.0,
        marker_every=1,  # a marker before every markable token: the scripted judge can pick exact spans
    )
    kwargs.update(overrides)
    return kwargs


def lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


class SpanPickingJudge:
    """A deterministic judge: marks the first visible token `original_error` and the next two visible tokens
    `verified_correction`, quoting their text. Records the spans it gave per trace text."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.spans_by_text: dict[str, list[dict]] = {}
        self.arrivals: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, request: dict) -> TextReply:
        marked = TRACE_BLOCK.search(request["messages"][1]["content"]).group(2)
        parts = re.split(r"⟦(\d+)⟧", marked)
        segments = [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]
        bounds = [index for index, _ in segments] + [None]
        visible = [k for k, (_, text) in enumerate(segments) if text.strip()]
        spans = []
        if len(visible) >= 1:
            k = visible[0]
            spans.append(self._span(segments, bounds, k, k + 1, "original_error", 1.0))
        if len(visible) >= 3:
            k = visible[1]
            spans.append(self._span(segments, bounds, k, k + 2, "verified_correction", 0.75))
        with self._lock:
            self.arrivals.append(time.perf_counter())
            self.spans_by_text[strip_markers(marked)] = spans
        return TextReply(json.dumps({"spans": spans}), delay=self.delay)

    @staticmethod
    def _span(segments, bounds, first, last, label, confidence):
        end = bounds[last] if bounds[last] is not None else None
        quote = "".join(text for _, text in segments[first:last]).strip()
        return {"start": segments[first][0], "end": end, "label": label, "confidence": confidence, "quote": quote}


def capturing(trainer_class):
    class Capturing(trainer_class):
        captured: list[dict] = []

        def process_scored_batch(self, batch, inputs):
            before = batch["advantages"].clone()
            out = super().process_scored_batch(batch, inputs)
            self.captured.append(
                {
                    "outcome": before,
                    "advantages": out["advantages"].clone(),
                    "completion_ids": out["completion_ids"].clone(),
                    "completion_mask": out["completion_mask"].clone(),
                }
            )
            return out

    Capturing.captured = []
    return Capturing


def expected_credit(spans, length, mask_row, lam):
    """docs/judge_credit.md written out independently of trl_ext.judge.credit (``mask_row``: the judged tokens)."""
    credit = [0.0] * length
    for span in spans:
        for t in range(span["start"], span["end"]):
            credit[t] += DEFAULT_LABEL_SCORES[span["label"]] * span["confidence"]
    credit = torch.tensor([min(1.0, max(-1.0, c)) for c in credit]) * mask_row
    mean_abs = credit.abs().sum() / mask_row.sum().clamp(min=1)
    return credit * (lam / mean_abs) if mean_abs > lam else credit


def judged_text(tokenizer, ids, mask):
    ids = ids[mask.bool()].tolist()
    while ids and ids[-1] in (tokenizer.eos_token_id, tokenizer.pad_token_id):
        ids.pop()
    return tokenizer.decode(ids), len(ids)


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
def test_config_defaults_follow_the_documented_method(tmp_path):
    config = JudgeCreditConfig(
        **cpu_config_kwargs(str(tmp_path)), judge_base_url="http://127.0.0.1:1/v1", judge_model="m"
    )
    assert (config.loss_type, config.scale_rewards, config.judge_lambda, config.marker_every) == (
        "ipo",
        "none",
        0.25,
        64,
    )
    assert config.label_scores == DEFAULT_LABEL_SCORES
    assert config.judge_tools == ["view_tokens", "search_trace", "run_python", "check_equivalent"]
    assert (config.judge_api_key_env, config.judge_verdict_reward, config.judge_structured_output) == (
        "OPENAI_API_KEY",
        "auto",
        "auto",
    )
    custom = JudgeCreditConfig(
        **cpu_config_kwargs(str(tmp_path)),
        judge_base_url="http://127.0.0.1:1/v1",
        judge_model="m",
        label_scores='{"original_error": -0.8, "lucky_guess": -0.2}',
    )
    assert custom.label_scores == {"original_error": -0.8, "lucky_guess": -0.2}
    assert JudgeCreditConfig.__dataclass_fields__["judge_lambda"].metadata["help"]
    own = set(JudgeCreditConfig.__dataclass_fields__) - set(ExtGRPOConfig.__dataclass_fields__)
    assert all(JudgeCreditConfig.__dataclass_fields__[name].metadata.get("help") for name in own)


def test_config_parses_from_the_command_line_and_yaml_style_dicts(tmp_path):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(JudgeCreditConfig)
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--report_to", "none"]
    argv += ["--judge_base_url", "http://127.0.0.1:1/v1", "--judge_model", "m", "--judge_lambda", "1.0"]
    argv += ["--judge_tools", "view_tokens", "search_trace", "--label_scores", '{"original_error": -1}']
    (config,) = parser.parse_args_into_dataclasses(argv)
    assert (config.judge_lambda, config.judge_tools, config.label_scores) == (
        1.0,
        ["view_tokens", "search_trace"],
        {"original_error": -1.0},
    )
    (config,) = parser.parse_dict(
        {**cpu_config_kwargs(str(tmp_path)), "judge_base_url": "http://127.0.0.1:1/v1", "judge_model": "m"}
        | {"label_scores": {"slip": -0.5}, "judge_tools": []}
    )
    assert config.label_scores == {"slip": -0.5} and config.judge_tools == []
    assert json.loads(config.to_json_string())["label_scores"] == {"slip": -0.5}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"judge_base_url": None}, "judge_base_url=None: set it"),
        ({"judge_base_url": "127.0.0.1:8000/v1"}, "judge_base_url="),
        ({"judge_model": None}, "judge_model is not set"),
        ({"judge_lambda": -0.1}, "judge_lambda=-0.1 must be >= 0"),
        ({"judge_lambda": float("nan")}, "judge_lambda=nan"),
        ({"marker_every": 0}, "marker_every=0"),
        ({"judge_max_concurrency": 0}, "judge_max_concurrency=0"),
        ({"judge_timeout": 0}, "judge_timeout=0"),
        ({"judge_max_retries": -1}, "judge_max_retries=-1"),
        ({"judge_max_tool_rounds": -1}, "judge_max_tool_rounds=-1"),
        ({"judge_structured_output": "yes"}, "judge_structured_output='yes'"),
        ({"judge_tools": ["browse"]}, "unknown tool"),
        ({"judge_max_tokens": 0}, "judge_max_tokens=0"),
        ({"label_scores": "{not json"}, "is not JSON"),
        ({"label_scores": {}}, "non-empty mapping"),
        ({"label_scores": {"original_error": "bad"}}, "must be a finite number"),
        ({"label_scores": {"original_error": float("inf")}}, "must be a finite number"),
    ],
)
def test_config_rejects_bad_values_naming_the_fix(tmp_path, overrides, message):
    kwargs = {"judge_base_url": "http://127.0.0.1:1/v1", "judge_model": "m", **overrides}
    with pytest.raises(ValueError, match=re.escape(message)):
        JudgeCreditConfig(**cpu_config_kwargs(str(tmp_path)), **kwargs)


def test_trainer_needs_a_judge_config_and_a_known_verdict_reward(tmp_path):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    plain = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path)))
    with pytest.raises(TypeError, match="JudgeCreditConfig"):
        JudgeCreditTrainer(model, digit_reward, args=plain, train_dataset=toy_dataset(), processing_class=tokenizer)
    config = JudgeCreditConfig(
        **cpu_config_kwargs(str(tmp_path)),
        judge_base_url="http://127.0.0.1:1/v1",
        judge_model="m",
        judge_verdict_reward="accuracy",
    )
    with pytest.raises(ValueError, match=r"judge_verdict_reward='accuracy' is not a reward function.*digit_reward"):
        JudgeCreditTrainer(model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer)


# ----------------------------------------------------------------------------------------------------------------
# Training runs
# ----------------------------------------------------------------------------------------------------------------
def test_training_run_per_token_advantages_differ_exactly_on_the_spans(tmp_path):
    judge = SpanPickingJudge()
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    trainer_class = capturing(JudgeCreditTrainer)
    # EOS grows likelier after the 3rd token, so some rollouts end with an EOS the judge never reads (the λ cap's
    # mean must leave it out) and others run to the length limit.
    eos_later = {"exponential_decay_length_penalty": (3, 3.0)}
    with ScriptedChatServer(judge) as server:
        config = JudgeCreditConfig(
            **cpu_config_kwargs(str(tmp_path), max_steps=2, generation_kwargs=eos_later), **judge_kwargs(server)
        )
        trainer = trainer_class(
            model,
            digit_reward,
            args=config,
            train_dataset=toy_dataset(),
            processing_class=tokenizer,
            peft_config=lora(),
        )
        trainer.train()

    assert len(trainer.captured) == 2
    checked_spans, capped_rows, rows_with_eos = 0, 0, 0
    for batch in trainer.captured:
        outcome, advantages = batch["outcome"], batch["advantages"]
        mask = batch["completion_mask"].float()
        assert outcome.shape == (4,) and advantages.shape == batch["completion_ids"].shape  # no rollout lost
        for row in range(advantages.shape[0]):
            text, judged = judged_text(tokenizer, batch["completion_ids"][row], batch["completion_mask"][row])
            spans = judge.spans_by_text[text]
            judged_mask = mask[row].clone()
            judged_mask[judged:] = 0.0  # the λ cap averages over the tokens the judge read, not the EOS after them
            rows_with_eos += bool(judged_mask.sum() < mask[row].sum())
            credit = expected_credit(spans, advantages.shape[1], judged_mask, 0.25)
            torch.testing.assert_close(advantages[row], outcome[row] + credit)
            covered = torch.zeros(advantages.shape[1], dtype=torch.bool)
            for span in spans:
                covered[span["start"] : span["end"]] = True
            differs = advantages[row] != outcome[row]
            assert torch.equal(differs, covered & mask[row].bool()), (row, spans)
            checked_spans += len(spans)
            raw_mean = (
                expected_credit(spans, advantages.shape[1], judged_mask, float("inf")).abs().sum() / judged_mask.sum()
            )
            capped_rows += bool(raw_mean > 0.25)
    assert checked_spans >= 8 and capped_rows >= 1  # the spans were really there, and λ really bit
    assert rows_with_eos >= 1  # some rollouts ended with EOS, so the judged-token mean was really tested

    logs = [entry for entry in trainer.state.log_history if "judge/share" in entry]
    assert len(logs) == 2
    for entry, batch in zip(logs, trainer.captured):
        assert entry["judge/failure_ratio"] == 0.0 and entry["judge/invalid_span_ratio"] == 0.0
        mask = batch["completion_mask"].float()
        credit_mass = ((batch["advantages"] - batch["outcome"].unsqueeze(1)).abs() * mask).sum()
        outcome_mass = (batch["outcome"].abs().unsqueeze(1) * mask).sum()
        assert entry["judge/share"] == pytest.approx(float(credit_mass / (credit_mass + outcome_mass)), rel=1e-4)
        assert entry["judge/label/original_error"] >= 1 and entry["judge/label/key_progress"] == 0
        assert entry["judge/spans_per_rollout"] == pytest.approx(
            (entry["judge/label/original_error"] + entry["judge/label/verified_correction"]) / 4
        )
        assert entry["judge/latency_p50"] > 0
    records = [json.loads(line) for line in open(trainer.judge_audit_path)]
    assert len(records) == 8 and {r["status"] for r in records} == {"ok"}
    assert all(len(r["prompt_hash"]) == 16 and r["verdict_given"].startswith("digit_reward = ") for r in records)
    assert sum(len(r["spans"]) for r in records) == checked_spans


def test_judge_faults_give_zero_credit_and_training_goes_on(tmp_path):
    def broken(request):  # half the rollouts hit 500s, the other half a server that never answers
        return HangReply(60) if len(request["messages"][1]["content"]) % 2 else ErrorReply(500)

    model, tokenizer = build_tiny_model_and_tokenizer(1)
    trainer_class = capturing(JudgeCreditTrainer)
    with ScriptedChatServer(broken) as server:
        config = JudgeCreditConfig(
            **cpu_config_kwargs(str(tmp_path), max_steps=2),
            **judge_kwargs(server, judge_timeout=0.3, judge_max_retries=1),
        )
        trainer = trainer_class(
            model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
        )
        trainer.train()
        assert len(server.requests) == 2 * 8  # every rollout of both steps was tried twice

    assert trainer.state.global_step == 2
    for batch in trainer.captured:
        expected = batch["outcome"].unsqueeze(1).expand_as(batch["advantages"])
        assert torch.equal(batch["advantages"], expected)  # zero credit, outcome advantage kept, no row dropped
    logs = [entry for entry in trainer.state.log_history if "judge/failure_ratio" in entry]
    assert [entry["judge/failure_ratio"] for entry in logs] == [1.0, 1.0]
    # No credit: a share of 0, or no share at all where the outcome advantages were 0 too (0/0 is not logged).
    assert all(entry.get("judge/share", 0.0) == 0.0 for entry in logs)
    records = [json.loads(line) for line in open(trainer.judge_audit_path)]
    assert len(records) == 8 and {r["status"] for r in records} == {"failed"}
    assert all("failed after 2 attempt" in r["error"] for r in records)


def test_refused_and_text_verdicts_are_counted_apart(tmp_path):
    def prose(request):  # half the rollouts get prose with no verdict, the others a verdict inside prose
        if len(request["messages"][1]["content"]) % 2:
            return TextReply("I would rather not grade this trace.")
        return TextReply('Nothing stands out. Verdict: {"spans": []}')

    model, tokenizer = build_tiny_model_and_tokenizer(1)
    with ScriptedChatServer(prose) as server:
        config = JudgeCreditConfig(**cpu_config_kwargs(str(tmp_path), max_steps=2), **judge_kwargs(server))
        trainer = JudgeCreditTrainer(
            model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
        )
        trainer.train()
    records = [json.loads(line) for line in open(trainer.judge_audit_path)]
    logs = [entry for entry in trainer.state.log_history if "judge/refused_ratio" in entry]
    assert len(logs) == 2 and len(records) == 8
    for step, entry in zip(sorted({r["step"] for r in records}), logs, strict=True):
        mine = [r for r in records if r["step"] == step]
        refused = sum(r["status"] == "unparseable" for r in mine)
        assert entry["judge/refused_ratio"] == entry["judge/failure_ratio"] == refused / len(mine)
        assert entry["judge/text_verdicts"] == sum(r["text_verdict"] for r in mine) == len(mine) - refused
    assert 0 < sum(r["status"] == "unparseable" for r in records) < 8  # both kinds happened


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def judge_records(caplog, level=None):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "trl_ext.judge.method" and (level is None or r.levelno == level)
    ]


def test_dead_judge_endpoint_is_loud_and_training_goes_on(tmp_path, caplog):
    """A closed port: a warning at construction, one when the first batch's calls all fail, an error once the
    outage lasts `outage_loud_batches` batches (not one per batch), each naming the endpoint, the error and the
    fix; training finishes as plain GRPO."""
    url = f"http://127.0.0.1:{closed_port()}/v1"
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = JudgeCreditConfig(
        **cpu_config_kwargs(str(tmp_path), max_steps=3),
        judge_base_url=url,
        judge_model="scripted-judge",
        judge_tools=[],
        judge_max_retries=0,
    )
    with caplog.at_level(logging.WARNING, logger="trl_ext.judge.method"):
        trainer = JudgeCreditTrainer(
            model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
        )
        (probe,) = judge_records(caplog)
        assert f"judge endpoint {url} does not answer" in probe and "ConnectError" in probe
        assert "start the judge server" in probe
        caplog.clear()
        trainer.method.outage_loud_batches = 2
        trainer.train()

    assert trainer.state.global_step == 3
    (warning,) = judge_records(caplog, logging.WARNING)  # batch 1; batch 3 is between the loud reports (2, 4, 8, ...)
    assert "Every judge call of this batch failed (4 of 4" in warning and url in warning
    assert "connection: Connection error. (ConnectError" in warning and "start the judge server" in warning
    (error,) = judge_records(caplog, logging.ERROR)
    assert "failed for 2 batches in a row" in error and "plain GRPO" in error and url in error
    assert [e["judge/failure_ratio"] for e in trainer.state.log_history if "judge/failure_ratio" in e] == [1.0] * 3


def test_judge_outage_names_the_http_error_and_its_recovery(tmp_path, caplog):
    calls = []

    def down_then_up(request):  # the first batch's 4 calls get a 500, then the judge answers
        calls.append(1)
        return ErrorReply(500) if len(calls) <= 4 else TextReply(json.dumps({"spans": []}))

    model, tokenizer = build_tiny_model_and_tokenizer(0)
    with ScriptedChatServer(down_then_up) as server:
        url = server.base_url
        config = JudgeCreditConfig(**cpu_config_kwargs(str(tmp_path), max_steps=2), **judge_kwargs(server))
        with caplog.at_level(logging.WARNING, logger="trl_ext.judge.method"):
            trainer = JudgeCreditTrainer(
                model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
            )
            assert judge_records(caplog) == []  # the endpoint answers and serves judge_model: nothing to say
            trainer.train()
    failed, recovered = judge_records(caplog, logging.WARNING)
    assert "Every judge call of this batch failed (4 of 4" in failed and "server_error 500" in failed
    assert "check its logs" in failed
    assert f"Judge at {url} answers again" in recovered and "after 1 batch(es)" in recovered
    assert [e["judge/failure_ratio"] for e in trainer.state.log_history if "judge/failure_ratio" in e] == [1.0, 0.0]


def test_judge_model_the_endpoint_does_not_serve_is_a_warning_at_construction(tmp_path, caplog):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    with ScriptedChatServer(lambda request: TextReply("[]")) as server:
        config = JudgeCreditConfig(
            **cpu_config_kwargs(str(tmp_path)), **judge_kwargs(server, judge_model="Qwen/Qwen3-8B")
        )
        with caplog.at_level(logging.WARNING, logger="trl_ext.judge.method"):
            JudgeCreditTrainer(
                model, digit_reward, args=config, train_dataset=toy_dataset(), processing_class=tokenizer
            )
    (warning,) = judge_records(caplog)
    assert "serves ['scripted-judge'], not judge_model='Qwen/Qwen3-8B'" in warning


def test_judge_starts_before_slow_rewards_when_the_verdict_comes_from_a_verifier(tmp_path):
    """With `judge_verdict_reward` naming the verifier, judge requests reach the server while a slow second reward
    is still running; with 'total' they arrive after it. The verifier runs once per batch either way."""
    events: dict[str, list] = {"verifier_calls": [], "slow": []}

    def verifier(completions, **kwargs):
        events["verifier_calls"].append(len(completions))
        return digit_reward(completions)

    def slow_rubric(completions, **kwargs):
        start = time.perf_counter()
        if mode == "verifier":  # slow until every judge call has arrived (120 s: a hang guard; later ones fail)
            while len(judge.arrivals) < 4 and time.perf_counter() < start + 120:
                time.sleep(0.01)
        else:
            time.sleep(0.5)  # time for a judge call sent too early to arrive
        events["slow"].append((start, time.perf_counter()))
        return [0.0] * len(completions)

    arrivals = {}
    for mode in ("verifier", "total"):
        judge = SpanPickingJudge(delay=0.2)
        events["verifier_calls"].clear()
        events["slow"].clear()
        model, tokenizer = build_tiny_model_and_tokenizer(0)
        with ScriptedChatServer(judge) as server:
            config = JudgeCreditConfig(
                **cpu_config_kwargs(str(tmp_path / mode), max_steps=1),
                **judge_kwargs(server, judge_verdict_reward=mode),
            )
            trainer = JudgeCreditTrainer(
                model, [verifier, slow_rubric], args=config, train_dataset=toy_dataset(), processing_class=tokenizer
            )
            trainer.train()
            verdicts = {
                r["messages"][1]["content"].split("VERIFIER VERDICT\n")[1].split(" ")[0] for r in server.requests
            }
        arrivals[mode] = (judge.arrivals, list(events["slow"]), verdicts)
        assert events["verifier_calls"] == [4]  # once per generation batch: TRL reused the early value

    verifier_arrivals, slow, verdicts = arrivals["verifier"]
    assert verdicts == {"verifier"} and len(verifier_arrivals) == 4
    assert max(verifier_arrivals) < slow[0][1]  # every judge call was sent while the slow reward ran
    total_arrivals, slow, verdicts = arrivals["total"]
    assert verdicts == {"reward"}
    assert min(total_arrivals) > slow[0][1]  # 'total' waits for all rewards


def test_eval_rollouts_are_not_judged_by_default(tmp_path):
    judge = SpanPickingJudge()
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    with ScriptedChatServer(judge) as server:
        config = JudgeCreditConfig(
            **cpu_config_kwargs(str(tmp_path), max_steps=1, eval_strategy="steps", eval_steps=1),
            per_device_eval_batch_size=4,
            **judge_kwargs(server),
        )
        trainer = JudgeCreditTrainer(
            model,
            digit_reward,
            args=config,
            train_dataset=toy_dataset(),
            eval_dataset=toy_dataset(4),
            processing_class=tokenizer,
        )
        trainer.train()
        assert len(server.requests) == 4  # the 4 training rollouts only
    assert any("eval_loss" in entry for entry in trainer.state.log_history)


DDP_SCRIPT = """
import json, os, sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

from tests.utils import cpu_config_kwargs, digit_reward, toy_dataset
from trl_ext.testing import build_tiny_model_and_tokenizer
from trl_ext.trainers.judge_credit import JudgeCreditConfig, JudgeCreditTrainer

out_dir, base_url = sys.argv[1], sys.argv[2]
model, tokenizer = build_tiny_model_and_tokenizer(0)
config = JudgeCreditConfig(
    **cpu_config_kwargs(out_dir, max_steps=2, ddp_backend="gloo"),
    judge_base_url=base_url, judge_model="m", judge_tools=[], judge_max_retries=0, marker_every=1,
)
trainer = JudgeCreditTrainer(model, digit_reward, args=config, train_dataset=toy_dataset(16), processing_class=tokenizer)
trainer.train()
rank = trainer.accelerator.process_index
logs = [{k: v for k, v in h.items() if k.startswith("judge/")} for h in trainer.state.log_history if "judge/share" in h]
Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"logs": logs, "audit": trainer.judge_audit_path}))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_process_run_judges_each_ranks_rollouts_and_agrees_on_metrics(tmp_path):
    script = tmp_path / "judge_ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    with ScriptedChatServer(SpanPickingJudge()) as server:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tmp_path)]
            + [server.base_url],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert len(server.requests) == 2 * 2 * 4  # 2 steps × 2 ranks × 4 rollouts, each judged once
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports[0]["logs"] == reports[1]["logs"] and len(reports[0]["logs"]) == 2  # same metrics on every rank
    assert reports[0]["audit"].endswith("judge_audit.jsonl") and reports[1]["audit"].endswith(
        "judge_audit.rank1.jsonl"
    )
    records = [json.loads(line) for report in reports for line in open(report["audit"])]
    assert len(records) == 16 and {r["rank"] for r in records} == {0, 1}
    for step_log, step in zip(reports[0]["logs"], sorted({r["step"] for r in records})):
        spans = [s for r in records if r["step"] == step for s in r["spans"]]
        assert step_log["judge/spans_per_rollout"] == pytest.approx(len(spans) / 8)  # counted over both ranks
        assert step_log["judge/label/original_error"] == sum(s["label"] == "original_error" for s in spans)
