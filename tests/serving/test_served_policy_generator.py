"""`ServedPolicyGenerator` against a stand-in `vllm serve` on 127.0.0.1 that answers each request from its seed."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_ext.serving.served_policy import ServedPolicyGenerator


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict] = []
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
        # A "sample" that depends on the prompt and the seed only, as vLLM's seeded sampling does.
        token = (sum(body["prompt"]) * 31 + body["seed"]) % 1000
        choice = {"index": 0, "token_ids": [token], "logprobs": {"token_logprobs": [-0.5]}}
        payload = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def server():
    httpd = _Server()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_identical_prompts_get_a_request_and_a_seed_each(server):
    """The G identical first prompts of a task's trees must not share one draw (vLLM gives every prompt of one
    batched request the request's seed): each prompt is its own request, with its own seed."""
    url = f"http://127.0.0.1:{server.server_address[1]}"
    generator = ServedPolicyGenerator(url, "base", lora_name="trl-policy", seed=0)
    generator.update_model_version(3)
    completions = generator.generate([[5, 6, 7]] * 4 + [[8]])
    assert len(server.requests) == 5
    assert all(request["model"] == "trl-policy-v3" and request["n"] == 1 for request in server.requests)
    assert len({request["seed"] for request in server.requests}) == 5
    assert len({tuple(c.token_ids) for c in completions[:4]}) == 4  # four distinct draws of one prompt
    assert [c.logprobs for c in completions] == [[-0.5]] * 5
    # The same seed gives the same seeds, in the prompts' order: the completions come back in that order.
    again = ServedPolicyGenerator(url, "base", lora_name="trl-policy", seed=0)
    again.update_model_version(3)
    assert [c.token_ids for c in again.generate([[5, 6, 7]] * 4 + [[8]])] == [c.token_ids for c in completions]
