import os
from collections.abc import Iterator

import pytest

from .vllm_server import VLLMServer, save_chat_model, start_vllm_server

# Tests never reach the Hugging Face Hub or a tracker.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def vllm_sockets_in_the_session_folder(tmp_path_factory) -> Iterator[None]:
    """vLLM's engines (colocated and `vllm serve`) make their ZeroMQ sockets in ``VLLM_RPC_BASE_PATH`` (default: the
    temporary folder) and leave them there when the engine is killed: in this session's own folder, which pytest
    rotates, they never pile up in the temporary folder."""
    previous = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(tmp_path_factory.mktemp("vllm_rpc"))
    yield
    if previous is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = previous


# The vLLM test group's shared `vllm serve` (tests/vllm_server.py). Started on the first request of a test that asks
# for `vllm_server` or `vllm_server_to_kill` (never in a run without one), stopped at the end of the session.
SHARED_MAX_LORAS = 4  # TRL needs max_staleness + 2 (it checks at start-up): enough for max_staleness <= 2


@pytest.fixture(scope="session")
def shared_vllm_server(tmp_path_factory) -> Iterator[VLLMServer]:
    """One LoRA-enabled `vllm serve` of the tiny chat model (`save_chat_model`) for the whole session. Tests take it
    through `vllm_server`, which hands it over without adapters (a module-scoped fixture clears it itself)."""
    folder = tmp_path_factory.mktemp("shared_vllm_server")
    model_dir = save_chat_model(folder / "model")
    server = start_vllm_server(model_dir, folder / "vllm_serve.log", max_loras=SHARED_MAX_LORAS)
    yield server
    server.stop()


@pytest.fixture
def vllm_server(shared_vllm_server) -> VLLMServer:
    """The shared `vllm serve`, with no LoRA adapter loaded and generation running (`VLLMServer.clear_lora_adapters`:
    every trainer publishes ``trl-policy-v1``, ``-v2``, ... again). Serves the base model under ``server.model``, the
    path to train from. A test that kills the server asks for `vllm_server_to_kill` instead; one that changes its
    base weights starts a server of its own."""
    shared_vllm_server.clear_lora_adapters()
    return shared_vllm_server


@pytest.fixture
def vllm_server_to_kill(shared_vllm_server) -> VLLMServer:
    """The shared `vllm serve`, cleared as by `vllm_server`, for a test that kills it: such a test runs after every
    other test of the session (`pytest_collection_modifyitems`), so none needs the server after it."""
    shared_vllm_server.clear_lora_adapters()
    return shared_vllm_server


def pytest_collection_modifyitems(items):
    """Run the tests that kill the shared `vllm serve` (they ask for `vllm_server_to_kill`) last, in their order."""
    items.sort(key=lambda item: "vllm_server_to_kill" in getattr(item, "fixturenames", ()))
