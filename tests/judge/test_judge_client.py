"""`AsyncChatClient` and `ScriptedChatServer`: the SDK's retries and backoff as the client uses and counts them,
timeouts, concurrency, structured-output fallback, asking again for a usable reply (`chat_parsed`), API-key hygiene —
against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import time

import openai
import pytest

from trl_ext.judge import AsyncChatClient, BackgroundEventLoop, ChatCallError, JudgeVerdict, ParsedReply
from trl_ext.judge.client import REPLY_STATUSES
from trl_ext.quickstart.scripted_server import (
    ErrorReply,
    HangReply,
    RawReply,
    ScriptedChatServer,
    TextReply,
    ToolCall,
    ToolCallReply,
    last_user_text,
    replies_in_order,
)
from trl_ext.rewards import RubricVerdict

USER = [{"role": "user", "content": "hi"}]


def make_client(server, **overrides):
    settings = dict(max_concurrency=8, timeout=5.0, max_retries=3)
    settings.update(overrides)
    return AsyncChatClient(server.base_url, "judge-model", **settings)


def run(coro):
    return asyncio.run(coro)


# ----------------------------------------------------------------------------------------------------------------
# The server itself
# ----------------------------------------------------------------------------------------------------------------
def test_server_speaks_the_openai_api_to_the_official_client():
    script = replies_in_order(
        [TextReply("hello"), ToolCallReply([ToolCall("search_trace", {"pattern": "x"})]), ErrorReply(429)],
        then=ErrorReply(500, "boom"),
    )
    with ScriptedChatServer(script, model="m1") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["m1"]
        reply = client.chat.completions.create(model="m1", messages=USER, temperature=0)
        assert reply.choices[0].message.content == "hello" and reply.choices[0].finish_reason == "stop"
        reply = client.chat.completions.create(model="m1", messages=USER)
        call = reply.choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments, reply.choices[0].finish_reason) == (
            "search_trace",
            '{"pattern": "x"}',
            "tool_calls",
        )
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="m1", messages=USER)
        with pytest.raises(openai.InternalServerError, match="boom"):
            client.chat.completions.create(model="m1", messages=USER)
        assert len(server.requests) == 4 and server.requests[0]["temperature"] == 0
        assert server.request_headers[0]["authorization"] == "Bearer k"


def test_server_answers_500_when_the_script_raises_and_rejects_non_loopback_hosts():
    def script(request):
        raise KeyError("no route for this request")

    with ScriptedChatServer(script) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="script error"):
            client.chat.completions.create(model="m", messages=USER)
    with pytest.raises(ValueError, match="loopback"):
        ScriptedChatServer(script, host="0.0.0.0")


def test_server_stop_releases_hanging_requests_quickly():
    server = ScriptedChatServer(lambda request: HangReply(60)).start()
    timeout = 30.0
    client = make_client(server, timeout=timeout, max_retries=0)
    loop = BackgroundEventLoop()
    future = loop.submit(client.chat(USER))
    deadline = time.monotonic() + 60  # a hang guard
    while not server.requests:  # the request hangs in the server
        assert time.monotonic() < deadline and not future.done(), "the request did not reach the server"
        time.sleep(0.01)
    started = time.perf_counter()
    server.stop()
    with pytest.raises(ChatCallError):
        future.result(timeout=timeout)
    assert time.perf_counter() - started < timeout / 4  # released by the stop, not by the client's timeout
    loop.close()


# ----------------------------------------------------------------------------------------------------------------
# Client behaviour
# ----------------------------------------------------------------------------------------------------------------
def test_success_returns_the_message_and_sends_model_and_params():
    with ScriptedChatServer(lambda request: TextReply("ok")) as server:
        client = make_client(server, request_params={"temperature": 0.0, "max_tokens": 64})
        result = run(client.chat(USER, top_p=0.5))
    assert (result.content, result.attempts, result.tool_calls, result.finish_reason) == ("ok", 1, [], "stop")
    request = server.requests[0]
    assert (
        request["model"],
        request["messages"],
        request["temperature"],
        request["max_tokens"],
        request["top_p"],
    ) == (
        "judge-model",
        USER,
        0.0,
        64,
        0.5,
    )
    assert "tools" not in request and "response_format" not in request


def test_tool_calls_are_returned_as_plain_dicts_ready_to_append():
    reply = ToolCallReply([ToolCall("view_tokens", {"start": 0, "end": 4}, id="call_a")])
    with ScriptedChatServer(lambda request: reply) as server:
        result = run(make_client(server).chat(USER, tools=[{"type": "function", "function": {"name": "view_tokens"}}]))
    assert result.message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "view_tokens", "arguments": '{"start": 0, "end": 4}'},
            }
        ],
    }
    assert server.requests[0]["tools"][0]["function"]["name"] == "view_tokens"


def test_429_is_retried_by_the_sdk_honouring_retry_after_and_counted():
    script = replies_in_order(
        [ErrorReply(429, retry_after=0.3), ErrorReply(429, retry_after=0.3)], then=TextReply("ok")
    )
    with ScriptedChatServer(script) as server:
        client = make_client(server)
        started = time.perf_counter()
        result = run(client.chat(USER))
        elapsed = time.perf_counter() - started
    assert result.content == "ok" and result.attempts == 3 and len(server.requests) == 3
    assert elapsed >= 0.6  # two Retry-After waits of 0.3 s
    assert (client.stats.requests, client.stats.rate_limited, client.stats.retries, client.stats.failures) == (
        3,
        2,
        2,
        0,
    )


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503])
def test_the_statuses_the_sdk_retries_are_retried(status):
    script = replies_in_order([ErrorReply(status, retry_after=0.01)], then=TextReply("ok"))
    with ScriptedChatServer(script) as server:
        client = make_client(server)
        result = run(client.chat(USER))
    assert (result.content, result.attempts, client.stats.retries) == ("ok", 2, 1)
    assert client.stats.server_errors == (1 if status >= 500 else 0)


def test_500s_exhaust_the_retries_and_raise_a_counted_error():
    with ScriptedChatServer(lambda request: ErrorReply(500, "down", retry_after=0.01)) as server:
        client = make_client(server, max_retries=2)
        with pytest.raises(ChatCallError, match="failed after 3 attempt") as caught:
            run(client.chat(USER))
    assert (caught.value.kind, caught.value.status, caught.value.attempts) == ("server_error", 500, 3)
    assert len(server.requests) == 3
    assert (client.stats.server_errors, client.stats.retries, client.stats.failures) == (3, 2, 1)


def test_without_retry_after_the_sdk_backs_off_exponentially():
    arrivals = []

    def script(request):
        arrivals.append(time.perf_counter())
        return ErrorReply(503)

    with ScriptedChatServer(script) as server:
        with pytest.raises(ChatCallError):
            run(make_client(server, max_retries=2).chat(USER))
    first_gap, second_gap = arrivals[1] - arrivals[0], arrivals[2] - arrivals[1]
    # The SDK sleeps 0.5 s, then 1 s, each less up to 25% jitter: at least 0.375 s, then at least 0.75 s, longer
    # than the first sleep can ever be, so the backoff grew. Only lower bounds: load can lengthen a gap, never
    # shorten it, and an immediate re-send would fail both.
    assert first_gap >= 0.375 - 0.005 and second_gap >= 0.75 - 0.005


def test_a_slot_is_not_held_during_the_backoff():
    def script(request):
        if last_user_text(request) == "slow" and len(server.requests) == 1:
            return ErrorReply(429, retry_after=1.0)
        return TextReply(last_user_text(request))

    with ScriptedChatServer(script) as server:
        client = make_client(server, max_concurrency=1)

        async def both():
            slow = asyncio.ensure_future(client.chat([{"role": "user", "content": "slow"}]))
            deadline = time.monotonic() + 60  # a hang guard
            while client.stats.rate_limited == 0:  # the slow call has had its 429 and is backing off
                assert time.monotonic() < deadline, "the slow call had no 429"
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            fast = await client.chat([{"role": "user", "content": "fast"}])
            return time.perf_counter() - started, fast, await slow

        waited, fast, slow = run(both())
    assert (fast.content, slow.content, slow.attempts) == ("fast", "slow", 2)
    assert waited < 0.6  # the only slot was free while the slow call waited out its Retry-After


def test_a_hanging_server_times_out_per_attempt_and_is_retried():
    with ScriptedChatServer(lambda request: HangReply(60)) as server:
        client = make_client(server, timeout=0.3, max_retries=1)
        started = time.perf_counter()
        with pytest.raises(ChatCallError) as caught:
            run(client.chat(USER))
        elapsed = time.perf_counter() - started
        assert len(server.requests) == 2
    assert caught.value.kind == "timeout" and caught.value.attempts == 2
    assert 0.6 <= elapsed < 3.0
    assert client.stats.timeouts == 2


def test_slow_reply_beyond_the_timeout_is_retried_and_then_succeeds():
    # The timeout leaves the fast reply time on a busy machine too (0.3 s did not: a third attempt was needed).
    script = replies_in_order([TextReply("late", delay=3.0)], then=TextReply("fast"))
    with ScriptedChatServer(script) as server:
        result = run(make_client(server, timeout=1.2).chat(USER))
    assert (result.content, result.attempts) == ("fast", 2)


def test_non_retryable_client_errors_fail_at_once():
    with ScriptedChatServer(lambda request: ErrorReply(401, "bad key")) as server:
        client = make_client(server)
        with pytest.raises(ChatCallError) as caught:
            run(client.chat(USER))
    assert (caught.value.kind, caught.value.status, caught.value.attempts) == ("client_error", 401, 1)
    assert len(server.requests) == 1


def test_connection_refused_is_retried_then_reported():
    server = ScriptedChatServer(lambda request: TextReply("ok")).start()
    base_url = server.base_url
    server.stop()
    client = AsyncChatClient(base_url, "m", max_retries=1, timeout=2)
    with pytest.raises(ChatCallError) as caught:
        run(client.chat(USER))
    assert caught.value.kind == "connection" and caught.value.attempts == 2


MALFORMED_BODIES = [
    '{"choices": []}',
    "not json",
    "",
    '{"choices": [{"message": {"content": 5}}]}',
    '{"choices": [{}]}',
]


@pytest.mark.parametrize("body", MALFORMED_BODIES)
def test_a_reply_that_is_not_a_chat_completion_is_reported_at_once(body):
    """A 2xx is not retried by the SDK, nor by `chat`; `chat_parsed` is where such a reply is asked for again."""
    with ScriptedChatServer(lambda request: RawReply(body)) as server:
        client = make_client(server, max_retries=1)
        with pytest.raises(ChatCallError) as caught:
            run(client.chat(USER))
        assert len(server.requests) == 1
    assert (caught.value.kind, caught.value.attempts, client.stats.failures) == ("bad_response", 1, 1)


# ----------------------------------------------------------------------------------------------------------------
# chat_parsed: asking again for a usable reply
# ----------------------------------------------------------------------------------------------------------------
def parse_number(text):
    return int(text)  # ValueError for anything else


def repair(error):
    return f"Reply with a number only ({error})."


def test_chat_parsed_repairs_an_unparseable_reply_in_the_conversation():
    script = replies_in_order([TextReply("seven"), ErrorReply(500, retry_after=0.01)], then=TextReply("7"))
    with ScriptedChatServer(script) as server:
        parsed = run(make_client(server).chat_parsed(USER, parse_number, repairs=1, repair_prompt=repair))
        sent = server.requests
    assert parsed == ParsedReply(status="ok", value=7, raw_output="7", requests=3, repairs=1)
    assert sent[2]["messages"][:2] == [*USER, {"role": "assistant", "content": "seven"}]
    assert (
        sent[2]["messages"][2]["role"] == "user"
        and "number only (invalid literal" in sent[2]["messages"][2]["content"]
    )


def test_a_reply_and_the_verdicts_built_from_it_share_one_status_vocabulary():
    assert REPLY_STATUSES == ("ok", "unparseable", "failed")
    for status in REPLY_STATUSES:
        outcomes = [ParsedReply(status=status), JudgeVerdict(status=status), RubricVerdict(status=status, reward=0.0)]
        assert [outcome.ok for outcome in outcomes] == [status == "ok"] * 3


def test_chat_parsed_gives_up_after_its_repairs():
    with ScriptedChatServer(lambda request: TextReply("no idea")) as server:
        parsed = run(make_client(server).chat_parsed(USER, parse_number, repairs=2, repair_prompt=repair))
        assert len(server.requests) == 3
    assert (parsed.status, parsed.value, parsed.raw_output, parsed.requests, parsed.repairs) == (
        "unparseable",
        None,
        "no idea",
        3,
        2,
    )
    assert "invalid literal" in parsed.error


@pytest.mark.parametrize("body", MALFORMED_BODIES)
def test_chat_parsed_sends_the_same_request_again_after_a_malformed_completion(body):
    with ScriptedChatServer(replies_in_order([RawReply(body)], then=TextReply("3"))) as server:
        parsed = run(make_client(server).chat_parsed(USER, parse_number, repairs=1, repair_prompt=repair))
        assert [request["messages"] for request in server.requests] == [USER, USER]
    assert (parsed.status, parsed.value, parsed.requests, parsed.repairs) == ("ok", 3, 2, 1)


def test_chat_parsed_reports_an_endpoint_failure_without_a_follow_up():
    with ScriptedChatServer(lambda request: ErrorReply(401, "bad key")) as server:
        parsed = run(make_client(server).chat_parsed(USER, parse_number, repairs=3, repair_prompt=repair))
        assert len(server.requests) == 1
    assert (parsed.status, parsed.requests, parsed.repairs) == ("failed", 1, 0) and "client_error 401" in parsed.error


def test_chat_parsed_starts_from_a_reply_already_received():
    with ScriptedChatServer(lambda request: TextReply("5")) as server:
        client = make_client(server)
        first = run(client.chat(USER))
        parsed = run(client.chat_parsed(USER, parse_number, repairs=1, repair_prompt=repair, first=first))
        assert len(server.requests) == 1
    assert (parsed.status, parsed.value, parsed.requests, parsed.repairs) == ("ok", 5, 0, 0)


def test_http_clients_are_closed_with_their_event_loop():
    """Each event loop gets its own HTTP client; it is closed when the loop shuts down (no leaked connections, no
    'Event loop is closed' noise from a client garbage-collected later)."""
    with ScriptedChatServer(lambda request: TextReply("ok")) as server:
        client = make_client(server)

        async def call_and_capture():
            result = await client.chat(USER)
            return result.content, await client.endpoint.client()

        content, http_client = run(call_and_capture())
        assert content == "ok" and http_client.is_closed()
        loop = BackgroundEventLoop()
        content, http_client = loop.run(call_and_capture())
        assert content == "ok" and not http_client.is_closed()
        loop.close()
        assert http_client.is_closed()


def test_concurrency_is_bounded_by_the_semaphore():
    with ScriptedChatServer(lambda request: TextReply("ok", delay=0.2)) as server:
        client = make_client(server, max_concurrency=4)

        async def many():
            return await asyncio.gather(*(client.chat(USER) for _ in range(16)))

        started = time.perf_counter()
        results = run(many())
        elapsed = time.perf_counter() - started
    assert len(results) == 16 and client.peak_in_flight == 4
    assert 0.8 <= elapsed < 2.5  # 16 calls / 4 in flight × 0.2 s


def test_structured_output_falls_back_when_the_endpoint_rejects_response_format():
    def script(request):
        if "response_format" in request:
            return ErrorReply(400, "response_format is not supported")
        return TextReply('{"spans": []}')

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with ScriptedChatServer(script) as server:
        client = make_client(server)
        first = run(client.chat(USER, response_format=schema))
        second = run(client.chat(USER, response_format=schema))
        strict = make_client(server, structured_output="on")
        with pytest.raises(ChatCallError) as caught:
            run(strict.chat(USER, response_format=schema))
        off = make_client(server, structured_output="off")
        run(off.chat(USER, response_format=schema))
    assert (first.content, first.structured, second.structured, client.structured_supported) == (
        '{"spans": []}',
        False,
        False,
        False,
    )
    sent = ["response_format" in request for request in server.requests]
    assert sent == [True, False, False, True, False]  # probe, fallback, remembered, strict mode, off mode
    assert client.stats.structured_fallbacks == 1 and caught.value.status == 400


def test_structured_output_is_sent_when_supported():
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with ScriptedChatServer(lambda request: TextReply("{}")) as server:
        result = run(make_client(server).chat(USER, response_format=schema))
    assert result.structured and server.requests[0]["response_format"] == schema


def test_api_key_comes_from_the_named_env_var_and_is_never_logged(monkeypatch, caplog):
    monkeypatch.setenv("TRL_EXT_TEST_JUDGE_KEY", "sk-secret-123")
    with ScriptedChatServer(replies_in_order([ErrorReply(500)], then=TextReply("ok"))) as server:
        client = make_client(server, api_key_env="TRL_EXT_TEST_JUDGE_KEY")
        with caplog.at_level(logging.DEBUG):
            run(client.chat(USER))
        assert server.request_headers[-1]["authorization"] == "Bearer sk-secret-123"
        monkeypatch.delenv("TRL_EXT_TEST_JUDGE_KEY")
        unset = make_client(server, api_key_env="TRL_EXT_TEST_JUDGE_KEY")
        run(unset.chat(USER))
        assert server.request_headers[-1]["authorization"] == "Bearer EMPTY"
    assert "sk-secret-123" not in repr(client) and "TRL_EXT_TEST_JUDGE_KEY" in repr(client)
    assert all("sk-secret-123" not in record.getMessage() for record in caplog.records)


def test_one_client_serves_several_event_loops():
    with ScriptedChatServer(lambda request: TextReply(last_user_text(request).upper())) as server:
        client = make_client(server)
        loop = BackgroundEventLoop()
        assert loop.run(client.chat([{"role": "user", "content": "a"}])).content == "A"
        assert run(client.chat([{"role": "user", "content": "b"}])).content == "B"
        loop.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"base_url": "127.0.0.1:8000"}, "http"),
        ({"model": ""}, "model"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"timeout": 0}, "timeout"),
        ({"max_retries": -1}, "max_retries"),
        ({"structured_output": "maybe"}, "structured_output"),
    ],
)
def test_client_settings_are_validated(overrides, message):
    settings = {"base_url": "http://127.0.0.1:1/v1", "model": "m", **overrides}
    with pytest.raises(ValueError, match=message):
        AsyncChatClient(settings.pop("base_url"), settings.pop("model"), **settings)


def test_an_unknown_setting_is_an_error():
    with pytest.raises(TypeError, match="unexpected keyword"):
        AsyncChatClient("http://127.0.0.1:1/v1", "m", max_retry=1)
