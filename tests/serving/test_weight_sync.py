"""`trl_ext.serving.weight_sync` without vLLM: real safetensors files, and a tiny HTTP server on 127.0.0.1 standing in
for ``vllm serve``'s dev endpoints (``/health``, ``/server_info``, ``/pause``, ``/collective_rpc``,
``/reset_prefix_cache``, ``/resume``). It records every call and, on ``reload_weights``, reads the checkpoint the
transfer wrote, as vLLM's loader does (the index, then the shards it names). A real `ExtAsyncGRPOTrainer` run (an
in-process rollout worker) syncs through `DiskWeightTransfer` into it. Runs against ``vllm serve`` are in
``tests/test_vllm_async_weights.py``."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from trl_ext import ExtAsyncGRPOConfig, ExtAsyncGRPOTrainer
from trl_ext.serving.weight_sync import (
    INDEX_FILE,
    WEIGHTS_DIR_NAME,
    DiskWeightTransfer,
    checkpoint_weight_names,
    choose_weight_transfer,
    config_has_tied_lm_head,
    shard_weights,
    unknown_weight_names,
    untie_checkpoint,
    write_checkpoint,
)
from trl_ext.testing import build_tiny_model_and_tokenizer

from ..trainers.test_ext_async_grpo import QueueWorker, config_kwargs, rollout_samples


# ----------------------------------------------------------------------------------------------------------------
# A stand-in for vLLM's dev endpoints
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class FakeVLLM:
    """What the stand-in serves (its model path and device) and what it saw (calls, the weights it reloaded)."""

    model_path: str
    device: str = "cpu"
    dev_mode: bool = True
    calls: list[tuple[str, str, dict, Any]] = field(default_factory=list)  # (verb, path, query, JSON body)
    reloads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    url: str = ""

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.calls]

    def answer(self, verb: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        self.calls.append((verb, path, query, body))
        if path == "/health":
            return 200, None
        if not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if path == "/server_info":
            config = {"device_config": {"device": self.device}, "model_config": {"model": self.model_path}}
            return 200, {"vllm_config": {**config, "model_config": {**config["model_config"], "dtype": "float32"}}}
        if path in ("/pause", "/resume"):
            return 200, {"status": path[1:]}
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/collective_rpc" and body["method"] == "reload_weights":
            directory = Path(body["kwargs"]["weights_path"])
            shards = set(json.loads((directory / INDEX_FILE).read_text())["weight_map"].values())
            weights: dict[str, torch.Tensor] = {}
            for shard in sorted(shards):
                weights.update(load_file(directory / shard))
            self.reloads.append(weights)
            return 200, {"results": [None]}
        return 404, {"detail": "Not Found"}


@pytest.fixture
def fake_vllm(tmp_path):
    fake = FakeVLLM(model_path=str(tmp_path / "served"))

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, verb: str) -> None:
            parsed = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, reply = fake.answer(verb, parsed.path, parse_qs(parsed.query), body)
            data = b"" if reply is None else json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


def save_model(directory: Path, *, tied: bool) -> Path:
    model, tokenizer = build_tiny_model_and_tokenizer(0, tie_word_embeddings=tied)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------------------------------------------
# The checkpoint files
# ----------------------------------------------------------------------------------------------------------------
def test_shards_keep_the_order_and_stay_under_the_size():
    weights = [(f"w{i}", torch.zeros(10, dtype=torch.float32)) for i in range(5)]  # 40 bytes each
    shards = list(shard_weights(weights, max_shard_bytes=100))
    assert [list(shard) for shard in shards] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [list(shard) for shard in shard_weights([("big", torch.zeros(100))], max_shard_bytes=10)] == [["big"]]
    with pytest.raises(ValueError, match="'w0' was streamed twice"):
        list(shard_weights([weights[0], weights[0]]))


def test_written_checkpoint_reads_back_and_replaces_the_previous_one(tmp_path):
    first = {f"layer.{i}.weight": torch.randn(8, 4) for i in range(3)}
    assert write_checkpoint(first.items(), tmp_path, max_shard_bytes=300) == list(first)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2  # 128 bytes a tensor: 2 + 1
    second = {"only.weight": torch.arange(6.0).view(2, 3)[:, 1:]}  # a non-contiguous view is written too
    write_checkpoint(second.items(), tmp_path)
    assert sorted(path.name for path in tmp_path.glob("*.safetensors")) == ["model-00001.safetensors"]
    assert checkpoint_weight_names(tmp_path) == {"only.weight"}
    assert torch.equal(load_file(tmp_path / "model-00001.safetensors")["only.weight"], second["only.weight"])


def test_checkpoint_names_of_a_saved_model_are_its_parameter_names(tmp_path):
    tied = save_model(tmp_path / "tied", tied=True)
    untied = save_model(tmp_path / "untied", tied=False)
    model, _ = build_tiny_model_and_tokenizer(0, tie_word_embeddings=False)
    assert checkpoint_weight_names(untied) == {name for name, _ in model.named_parameters()}
    assert "lm_head.weight" not in checkpoint_weight_names(tied)  # a tied head is not in the checkpoint
    assert checkpoint_weight_names(tmp_path / "missing") is None
    assert unknown_weight_names(["a", "b", "c"], {"b"}) == ["a", "c"]


def test_untied_copy_computes_what_the_tied_model_does(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    source = save_model(tmp_path / "tied", tied=True)
    copy = untie_checkpoint(source, tmp_path / "untied")
    assert config_has_tied_lm_head(AutoConfig.from_pretrained(source))
    assert not config_has_tied_lm_head(AutoConfig.from_pretrained(copy))
    assert "lm_head.weight" in checkpoint_weight_names(copy)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        tied_logits = AutoModelForCausalLM.from_pretrained(source).eval()(input_ids=ids).logits
        untied_model = AutoModelForCausalLM.from_pretrained(copy).eval()
        assert untied_model.lm_head.weight is not untied_model.model.embed_tokens.weight
        assert torch.equal(untied_model(input_ids=ids).logits, tied_logits)


# ----------------------------------------------------------------------------------------------------------------
# The transfer against the stand-in server
# ----------------------------------------------------------------------------------------------------------------
def test_a_sync_pauses_reloads_from_the_files_and_resumes(fake_vllm, tmp_path):
    served = save_model(Path(fake_vllm.model_path), tied=False)
    model, _ = build_tiny_model_and_tokenizer(0, tie_word_embeddings=False)
    transfer = DiskWeightTransfer(fake_vllm.url, tmp_path / "weights")
    transfer.init_weight_transfer()
    assert transfer.expected_names == checkpoint_weight_names(served)
    transfer.pause()
    transfer.send_weights(model.named_parameters())
    transfer.resume()
    assert fake_vllm.paths() == [
        "/health", "/server_info", "/pause", "/collective_rpc", "/reset_prefix_cache", "/resume",
    ]  # fmt: skip
    assert fake_vllm.calls[2][2] == {"mode": ["keep"]}  # in-flight requests are frozen, as TRL's own sync does
    rpc = fake_vllm.calls[3][3]
    assert rpc["method"] == "reload_weights"
    assert rpc["kwargs"] == {"weights_path": str((tmp_path / "weights").resolve()), "is_checkpoint_format": True}
    reloaded = fake_vllm.reloads[-1]
    assert set(reloaded) == {name for name, _ in model.named_parameters()}
    assert all(torch.equal(reloaded[name], param) for name, param in model.named_parameters())
    transfer.destroy()
    assert not (tmp_path / "weights").exists()


def test_a_name_the_served_checkpoint_lacks_is_refused_before_the_reload(fake_vllm, tmp_path):
    save_model(Path(fake_vllm.model_path), tied=False)
    transfer = DiskWeightTransfer(fake_vllm.url, tmp_path / "weights")
    transfer.init_weight_transfer()
    with pytest.raises(RuntimeError, match=r"1 weight name\(s\).*base_model\.model\.lm_head\.weight.*check_names"):
        transfer.send_weights([("base_model.model.lm_head.weight", torch.zeros(2))])
    assert "/collective_rpc" not in fake_vllm.paths()
    unchecked = DiskWeightTransfer(fake_vllm.url, tmp_path / "weights", check_names=False)
    unchecked.init_weight_transfer()
    unchecked.send_weights([("base_model.model.lm_head.weight", torch.zeros(2))])
    assert list(fake_vllm.reloads[-1]) == ["base_model.model.lm_head.weight"]


def test_a_tied_head_is_refused_on_a_cpu_server_with_the_fixes(fake_vllm, tmp_path):
    save_model(Path(fake_vllm.model_path), tied=True)
    transfer = DiskWeightTransfer(fake_vllm.url, tmp_path / "weights", tied_lm_head=True)
    with pytest.raises(RuntimeError, match=r"ties its LM head.*runs on the CPU.*LoRA sync.*untie_checkpoint"):
        transfer.init_weight_transfer()
    fake_vllm.device = "cuda"  # vLLM does not process an unquantized head on CUDA: the tied weight is updated
    DiskWeightTransfer(fake_vllm.url, tmp_path / "weights", tied_lm_head=True).init_weight_transfer()


def test_a_server_without_dev_mode_is_named(fake_vllm, tmp_path):
    fake_vllm.dev_mode = False
    with pytest.raises(RuntimeError, match="no /server_info endpoint: start it with VLLM_SERVER_DEV_MODE=1"):
        DiskWeightTransfer(fake_vllm.url, tmp_path / "weights").init_weight_transfer()


def test_a_server_that_does_not_answer_times_out_with_the_setting(tmp_path):
    transfer = DiskWeightTransfer("http://127.0.0.1:9", tmp_path / "weights", server_timeout=0.0)
    with pytest.raises(TimeoutError, match="vllm_server_timeout"):
        transfer.init_weight_transfer()


# ----------------------------------------------------------------------------------------------------------------
# The chooser, and a real trainer syncing through the transfer
# ----------------------------------------------------------------------------------------------------------------
def test_the_chooser_picks_the_disk_for_full_weights_without_nccl(fake_vllm, tmp_path):
    untied = str(save_model(tmp_path / "untied", tied=False))
    args = ExtAsyncGRPOConfig(**config_kwargs(tmp_path / "run"), vllm_server_base_url=fake_vllm.url)
    assert choose_weight_transfer(untied, args, weight_sync="nccl") is None
    assert choose_weight_transfer(untied, args, peft_config=object()) is None  # TRL's LoRA sync over HTTP
    transfer = choose_weight_transfer(untied, args)
    assert isinstance(transfer, DiskWeightTransfer) and not transfer.tied_lm_head
    assert transfer.directory == (tmp_path / "run" / WEIGHTS_DIR_NAME).resolve()
    assert (transfer.server_timeout, transfer.reload_timeout) == (args.vllm_server_timeout, args.weight_sync_timeout)
    assert isinstance(
        choose_weight_transfer(untied, args, peft_config=object(), weight_sync="disk"), DiskWeightTransfer
    )
    assert fake_vllm.calls == []  # an untied model: the server is first contacted on train begin
    with pytest.raises(ValueError, match="weight_sync='gloo' is not one of 'auto', 'nccl', 'disk'"):
        choose_weight_transfer(untied, args, weight_sync="gloo")
    save_model(Path(fake_vllm.model_path), tied=True)
    with pytest.raises(RuntimeError, match="ties its LM head"):  # refused when the trainer is built
        choose_weight_transfer(str(save_model(tmp_path / "tied", tied=True)), args)


def test_a_trainer_syncs_its_final_weights_through_the_files(fake_vllm, tmp_path):
    served = str(save_model(Path(fake_vllm.model_path), tied=False))
    args = ExtAsyncGRPOConfig(**config_kwargs(tmp_path / "run"), vllm_server_base_url=fake_vllm.url)
    transfer = choose_weight_transfer(served, args)
    trainer = ExtAsyncGRPOTrainer(
        served,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused: the worker is a stub"] * 8}),
        rollout_worker=QueueWorker(rollout_samples(16)),
        weight_transfer=transfer,
    )
    trainer.train()
    # One cold sync on train begin, then one per optimizer step, each a pause, a reload and a resume.
    assert len(fake_vllm.reloads) == args.max_steps + 1 == trainer.model_version
    syncs = [path for path in fake_vllm.paths() if path not in ("/health", "/server_info")]  # the probes
    assert syncs == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"] * 3
    final = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    reloaded = fake_vllm.reloads[-1]
    assert set(reloaded) == checkpoint_weight_names(served)  # TRL streams the checkpoint's names, each one
    assert all(torch.equal(reloaded[name], final[name].detach()) for name in reloaded)
    assert not torch.equal(fake_vllm.reloads[0]["lm_head.weight"], reloaded["lm_head.weight"])  # it trained
    assert not (tmp_path / "run" / WEIGHTS_DIR_NAME).exists()  # removed on train end
