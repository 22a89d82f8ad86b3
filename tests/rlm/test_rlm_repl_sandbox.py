"""PythonREPL: persistence, the query protocol and every sandbox guarantee, on real subprocesses."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile
import time

import pytest

from trl_ext.rlm import PythonREPL, QueryRefused, QueryRequest, SandboxError, SandboxLimits
from trl_ext.rlm import sandbox as sandbox_module
from trl_ext.rlm.repl import REPL_RESTART_NOTICE
from trl_ext.rlm.repl_resources import repl_parent_dir, traversable_by_others
from trl_ext.rlm.sandbox import ENV_ALLOWLIST, processes_of_uid
from trl_ext.rlm.sandbox import host as sandbox_host

from ..utils import process_alive, saved_tiny_model

AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="a private sandbox uid needs a root trainer")


@pytest.fixture
def repl():
    with PythonREPL(context="hello sandbox", timeout_s=2, memory_mb=256, max_processes=8) as instance:
        yield instance


# ------------------------------------------------------------------------------------------------ basics
def test_variables_persist_and_context_is_loaded(repl):
    assert repl.execute("n = len(context)").stdout == ""
    result = repl.execute("print(n, context.upper())\nn * 2")
    assert result == type(result)(stdout="13 HELLO SANDBOX\n26\n")
    assert repl.execute("n").stdout == "13\n"


def test_show_vars_and_final_var(repl):
    repl.execute("import json\nanswer = [1, 2]\n_hidden = 3")
    assert repl.execute("SHOW_VARS()").stdout == "{'context': 'str', 'answer': 'list'}\n"
    result = repl.execute("FINAL_VAR('answer')")
    assert result.final_answer == "[1, 2]" and result.error is None
    assert repl.execute("FINAL_VAR(40 + 2)").final_answer == "42"
    missing = repl.execute("FINAL_VAR('nope')")
    assert missing.final_answer is None
    assert "NameError: FINAL_VAR('nope'): no variable named 'nope'" in missing.error
    assert "variables: ['answer', 'context']" in missing.error
    assert repl.execute("x = 1").final_answer is None  # reset every cell


def test_errors_show_only_the_models_frames(repl):
    result = repl.execute("def f(x):\n    return 1 / x\ny = 1\nf(0)")
    assert result.stdout == ""
    assert result.error == (
        "Traceback (most recent call last):\n"
        '  File "<repl-1>", line 4, in <module>\n'
        "    f(0)\n"
        '  File "<repl-1>", line 2, in f\n'
        "    return 1 / x\n"
        "           ~~^~~\n"
        "ZeroDivisionError: division by zero\n"
    )
    assert repl.execute("y").stdout == "1\n"  # statements before the error ran
    syntax = repl.execute("def g(:\n  pass")
    assert syntax.error.startswith('  File "<repl-3>", line 1') and "SyntaxError" in syntax.error
    assert "SystemExit: 3" in repl.execute("import sys; sys.exit(3)").error
    assert repl.execute("print('still here')").stdout == "still here\n"


def test_output_is_bounded_and_captures_subprocesses():
    with PythonREPL(timeout_s=5, max_output_chars=50) as repl:
        result = repl.execute("print('x' * 120)")
        assert result.stdout == "x" * 50 + "\n... [71 more characters of output not shown]"
        direct = repl.execute(
            "import os\nprint('py', flush=True)\nos.system('echo from-shell')\nos.write(2, b'raw\\n')"
        )
        # Python-level output first (the echo of os.write's return value included), then descriptor-level output
        assert direct.stdout == "py\n4\nfrom-shell\nraw\n"
        assert repl.execute("print('\\ud800 ok')").stdout == "? ok\n"  # a lone surrogate cannot reach a tokenizer


def test_helpers_source_and_objects_are_injected_and_survive_restarts():
    helpers = "def search(text, keyword, window=3):\n    i = text.find(keyword)\n    return text[max(0, i - window): i + len(keyword) + window]\n"
    with PythonREPL(
        "the needle is here", timeout_s=1, helpers=helpers, helper_objects={"LIMIT": 7, "ops": {"a": [1]}}
    ) as repl:
        assert repl.execute("print(search(context, 'needle'), LIMIT, ops)").stdout == "he needle is 7 {'a': [1]}\n"
        assert repl.execute("SHOW_VARS()").stdout == "{'context': 'str'}\n"  # helpers are not variables
        assert repl.execute("while True: pass").timed_out
        after = repl.execute("print(search(context, 'here', 1), LIMIT)")
        notice = REPL_RESTART_NOTICE.format(reason="the previous cell exceeded the 1 s time limit")
        assert after.restarted and after.stdout == notice + " here 7\n"


def test_broken_helpers_fail_loudly():
    with PythonREPL(helpers="raise ValueError('bad helper')", timeout_s=2) as repl:
        with pytest.raises(SandboxError, match="ValueError: bad helper"):
            repl.execute("1")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_mb": 10}, "memory_mb must be an int >= 64"),
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
        ({"max_processes": -1}, "max_processes must be an int >= 0"),
        ({"isolation": "vm"}, "isolation must be one of"),
        ({"helper_objects": {"llm_query": 1}}, "may not redefine the REPL's own names"),
    ],
)
def test_invalid_arguments_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PythonREPL(**kwargs)


def test_large_context_round_trip():
    text = "abc" * 1_000_000
    with PythonREPL(text, timeout_s=5) as repl:
        assert repl.execute("print(len(context), context[-4:])").stdout == "3000000 cabc\n"


# ------------------------------------------------------------------------------------------ query protocol
def test_query_functions_reach_the_handler_and_block_the_code():
    seen: list[QueryRequest] = []

    def handler(request: QueryRequest) -> list[str]:
        seen.append(request)
        if request.function == "rlm_query_batched" and len(request.prompts) > 2:
            raise QueryRefused("at most 2 children per call")
        return [f"{request.function}:{prompt}" for prompt in request.prompts]

    with PythonREPL(timeout_s=2, on_query=handler) as repl:
        code = (
            "a = llm_query('p1')\n"
            "b = llm_query_batched(['p2', 'p3'])\n"
            "c = rlm_query('p4', context={'k': [1, 2.5]})\n"
            "d = rlm_query_batched(['p5', 'p6'], context_list=['x', None])\n"
            "e = llm_query_batched([])\n"
            "print(a, b, c, d, e)"
        )
        result = repl.execute(code)
        assert result.error is None
        assert result.stdout == (
            "llm_query:p1 ['llm_query_batched:p2', 'llm_query_batched:p3'] rlm_query:p4 "
            "['rlm_query_batched:p5', 'rlm_query_batched:p6'] []\n"
        )
        assert seen == [
            QueryRequest("llm_query", ("p1",)),
            QueryRequest("llm_query_batched", ("p2", "p3")),
            QueryRequest("rlm_query", ("p4",), ({"k": [1, 2.5]},)),
            QueryRequest("rlm_query_batched", ("p5", "p6"), ("x", None)),
        ]
        refused = repl.execute("rlm_query_batched(['1', '2', '3'])")
        assert refused.error.endswith("RuntimeError: rlm_query_batched failed: at most 2 children per call\n")
        bad_context = repl.execute("rlm_query('p', context=object())")
        assert "TypeError: rlm_query: a child's context must be JSON-serialisable" in bad_context.error
        assert (
            "TypeError: llm_query_batched expects a list of prompt strings"
            in repl.execute("llm_query_batched('x')").error
        )


def test_queries_from_threads_are_refused():
    with PythonREPL(timeout_s=2, on_query=lambda request: ["x"] * len(request.prompts)) as repl:
        code = (
            "import threading\nerrors = []\n"
            "def worker():\n    try:\n        llm_query('a')\n    except RuntimeError as exc:\n        errors.append(str(exc))\n"
            "t = threading.Thread(target=worker)\nt.start()\nt.join()\nprint(errors)"
        )
        assert "can only be called from the cell's own code" in repl.execute(code).stdout


FIND_PROTOCOL_FD = (  # as an attacker would: the channel object is in the interpreter's own memory
    "import gc\nPROTOCOL_FD = next(o for o in gc.get_objects() if type(o).__name__ == '_Channel').write_fd\n"
)


def test_model_code_cannot_break_the_parent_through_the_protocol():
    with PythonREPL(timeout_s=2) as repl:
        forged = repl.execute(
            FIND_PROTOCOL_FD
            + "import os, sys\nos.write(PROTOCOL_FD, b'\\x00\\x00\\x00\\x05hello')\nimport time; time.sleep(1)"
        )
        assert forged.crashed and "broke the REPL protocol (malformed message" in forged.error
        huge = repl.execute(
            FIND_PROTOCOL_FD
            + "import os, sys\nos.write(PROTOCOL_FD, b'\\xff\\xff\\xff\\xff')\nimport time; time.sleep(1)"
        )
        assert huge.crashed and "exceeds max_message_bytes" in huge.error
        # A frame nested deeper than the JSON parser's recursion limit: a protocol error, never a RecursionError
        # raised out of execute() into the trainer.
        nested = repl.execute(
            FIND_PROTOCOL_FD + "import os, sys\npayload = b'[' * 200000 + b']' * 200000\n"
            "os.write(PROTOCOL_FD, len(payload).to_bytes(4, 'big') + payload)\nimport time; time.sleep(1)"
        )
        assert nested.crashed and "broke the REPL protocol (malformed message" in nested.error
        assert repl.execute("print('recovered')").stdout.endswith("recovered\n")


def test_without_a_handler_queries_raise_in_the_code(repl):
    result = repl.execute("llm_query('hi')")
    assert "RuntimeError: llm_query failed: llm_query is not available in this REPL" in result.error


def test_time_waiting_for_answers_does_not_count_against_the_timeout():
    def slow(request: QueryRequest) -> list[str]:
        time.sleep(0.7)
        return ["ok"] * len(request.prompts)

    with PythonREPL(timeout_s=1, on_query=slow) as repl:
        result = repl.execute("r = [llm_query('a') for _ in range(3)]\nprint(r)")
        assert not result.timed_out and result.stdout == "['ok', 'ok', 'ok']\n"


def test_a_broken_handler_raises_and_the_repl_recovers():
    with PythonREPL(timeout_s=2, on_query=lambda request: ["only one"]) as repl:
        repl.execute("x = 1")
        with pytest.raises(TypeError, match="must return one str per prompt"):
            repl.execute("llm_query_batched(['a', 'b'])")
        after = repl.execute("print('fresh')")
        assert after.restarted and after.stdout.endswith("fresh\n")
        assert "NameError" in repl.execute("x").error


def test_many_repls_execute_concurrently():
    async def main() -> list[str]:
        repls = [PythonREPL(index, timeout_s=5) for index in range(6)]
        try:
            started = time.perf_counter()
            results = await asyncio.gather(
                *(repl.aexecute("import time; time.sleep(0.5); print(context)") for repl in repls)
            )
            assert time.perf_counter() - started < 2.5  # in parallel, not 6 x 0.5 s in a row
            return [result.stdout for result in results]
        finally:
            for repl in repls:
                repl.close()

    assert asyncio.run(main()) == [f"{index}\n" for index in range(6)]


# ---------------------------------------------------------------------------------------------- sandbox
def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret")
    monkeypatch.setenv("HF_TOKEN", "hf_test_secret")
    monkeypatch.setenv("SOME_TRAINER_SETTING", "1")
    with PythonREPL(timeout_s=2, env={"TASK_MODE": "eval"}) as repl:
        names = eval(repl.execute("import os; sorted(os.environ)").stdout)
        allowed = {"PATH", "HOME", "TMPDIR", "PYTHONIOENCODING", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}
        allowed |= {"MKL_NUM_THREADS", "MALLOC_ARENA_MAX", "TASK_MODE", *ENV_ALLOWLIST}
        assert set(names) <= allowed
        assert {"OPENAI_API_KEY", "HF_TOKEN", "SOME_TRAINER_SETTING"}.isdisjoint(names)
        dump = repl.execute("import os; print(os.environ)").stdout
        assert "sk-test-secret" not in dump and "hf_test_secret" not in dump
        assert (
            repl.execute("print(os.environ['TASK_MODE'], os.environ['HOME'] == os.getcwd())").stdout == "eval True\n"
        )


@needs_root
def test_private_uid_cannot_reach_the_trainer():
    secret_dir = tempfile.mkdtemp()
    secret = os.path.join(secret_dir, "token")
    with open(secret, "w") as handle:
        handle.write("hf_file_secret")
    os.chmod(secret, 0o600)
    try:
        with PythonREPL(timeout_s=2, isolation="process") as repl:  # the uid layer alone (namespaces hide more)
            assert repl.uid is not None and repl.uid != 0
            assert (
                repl.execute("import os; print(os.getuid(), os.geteuid(), os.getgroups())").stdout
                == f"{repl.uid} {repl.uid} []\n"
            )
            trainer = os.getpid()
            for code in (
                f"open('/proc/{trainer}/environ').read()",  # the trainer's environment at exec, secrets included
                f"open('/proc/{trainer}/mem', 'rb')",
                f"open({secret!r}).read()",
                f"import os; os.kill({trainer}, 0)",  # may not even probe the trainer with signal 0
                "import os; os.setuid(0)",
            ):
                error = repl.execute(code).error
                assert error is not None and ("PermissionError" in error), (code, error)
            imports = repl.execute("import re, json, collections, decimal; print(re.sub('a', 'b', 'aa'))")
            assert imports.stdout == "bb\n"  # the stdlib still imports although the interpreter lives under /root
    finally:
        os.remove(secret)
        os.rmdir(secret_dir)


@needs_root
@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_a_tmpdir_closed_to_other_users_still_gives_working_repls(isolation, monkeypatch):
    """A $TMPDIR of mode 0700 (mktemp -d, a per-user runtime folder): the private uid could not reach a REPL folder
    made there, so REPL folders go to /tmp; a traversable $TMPDIR is used as it is."""
    outer = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(outer, 0o755)
        closed = os.path.join(outer, "closed")
        os.mkdir(closed, 0o700)
        assert traversable_by_others(outer) and not traversable_by_others(closed)
        monkeypatch.setattr(tempfile, "tempdir", closed)
        assert repl_parent_dir() == "/tmp"
        with PythonREPL(isolation=isolation) as repl:
            assert repl.execute("print(6 * 7)").stdout == "42\n"
        monkeypatch.setattr(tempfile, "tempdir", outer)
        assert repl_parent_dir() == outer
        with PythonREPL(isolation=isolation) as repl:
            assert repl.execute("print(6 * 7)").stdout == "42\n"
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def test_working_directory_is_private_and_removed_on_close():
    repl = PythonREPL(timeout_s=2, isolation="process")  # a host directory (namespaces: a private tmpfs)
    workdir = repl.workdir
    assert repl.execute("import os; print(os.getcwd())").stdout == f"{workdir}\n"
    repl.execute("open('notes.txt', 'w').write('x')\nimport os\nos.makedirs('sub/deeper')\nos.chmod('sub', 0)")
    assert os.path.exists(os.path.join(workdir, "notes.txt"))
    assert stat.S_IMODE(os.stat(workdir).st_mode) == 0o700
    repl.close()
    assert not os.path.exists(os.path.dirname(workdir))
    repl.close()  # idempotent
    with pytest.raises(RuntimeError, match="This PythonREPL is closed"):
        repl.execute("1")


def test_infinite_loop_times_out_and_the_next_cell_says_the_repl_restarted():
    with PythonREPL("ctx", timeout_s=0.5) as repl:
        repl.execute("x = 41")
        first_pid = repl.pid
        started = time.perf_counter()
        result = repl.execute("while True:\n    pass")
        assert time.perf_counter() - started < 3
        assert result.timed_out and not result.crashed and result.final_answer is None
        assert result.error.startswith("TimeoutError: the cell did not finish within 0.5 s")
        assert "variables are lost" in result.error
        assert not process_alive(first_pid)
        after = repl.execute("print(context)\nx")
        notice = REPL_RESTART_NOTICE.format(reason="the previous cell exceeded the 0.5 s time limit")
        assert after.restarted and after.stdout == notice + "ctx\n"
        assert "NameError: name 'x' is not defined" in after.error
        assert not repl.execute("print(1)").restarted


def test_memory_bomb_is_a_memory_error_and_the_repl_survives():
    with PythonREPL(timeout_s=5, memory_mb=256) as repl:
        repl.execute("kept = 'yes'")
        assert repl.execute("x = bytearray(10**9)").error.endswith("MemoryError\n")
        grow = repl.execute("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))")
        assert grow.error.endswith("MemoryError\n") and not grow.timed_out
        assert repl.execute("del chunks\nprint(kept)").stdout == "yes\n"


def test_fork_bomb_is_contained():
    with PythonREPL(timeout_s=3, memory_mb=256, max_processes=8) as repl:
        started = time.perf_counter()
        result = repl.execute("import os\nwhile True:\n    os.fork()")
        assert time.perf_counter() - started < 5
        assert "BlockingIOError" in result.error or result.timed_out
        # the trainer can still start processes and threads
        assert os.system("true") == 0
        assert repl.execute("print('alive')").stdout.endswith("alive\n")
        if AS_ROOT:  # a private uid: no process of the bomb outlived its cell, only the REPL's server remains
            deadline = time.monotonic() + 60  # a hang guard: killed at the end of the cell, they exit at once
            while len(processes_of_uid(repl.uid)) > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(processes_of_uid(repl.uid)) == 1
        uid = repl.uid
    if uid is not None:
        assert processes_of_uid(uid) == []


def test_thread_and_process_count_is_limited():
    with PythonREPL(timeout_s=3, max_processes=4) as repl:
        code = (
            "import threading, time\nstarted = 0\n"
            "try:\n    for _ in range(50):\n        threading.Thread(target=time.sleep, args=(1,), daemon=True).start()\n"
            "        started += 1\nexcept RuntimeError as exc:\n    print(started, exc)"
        )
        out = repl.execute(code).stdout
        count = int(out.split()[0])
        assert count <= (4 if AS_ROOT else 50) and "can't start new thread" in out


def test_crash_is_reported_and_the_repl_restarts():
    with PythonREPL(timeout_s=2) as repl:
        result = repl.execute("import os\nprint('bye')\nos._exit(3)")
        assert result.crashed and not result.timed_out
        assert result.error.startswith("The REPL process exited with status 3; its variables are lost")
        segv = repl.execute("import ctypes\nctypes.string_at(0)")  # a real fault (PID 1 ignores a sent SIGSEGV)
        assert segv.restarted and segv.crashed and "crashed (segmentation fault)" in segv.error
        assert repl.execute("print(2)").stdout.endswith(
            "REPL process crashed (segmentation fault). Variables from earlier cells are lost; `context` and the helper functions were loaded again.]\n2\n"
        )


def test_cpu_time_limit_kills_the_interpreter():
    with PythonREPL(timeout_s=10, cpu_time_s=1) as repl:
        started = time.perf_counter()
        result = repl.execute("while True:\n    pass")
        assert time.perf_counter() - started < 8
        assert result.crashed and "CPU-time limit" in result.error


def test_close_leaves_no_process_behind():
    repl = PythonREPL(timeout_s=2, max_processes=8, isolation="process")  # host pids (namespaces: tests/rlm/attacks)
    code = (
        "import os, subprocess, time\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "escaped = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"  # leaves the process group
        "print(os.getpid(), child.pid, escaped.pid)"
    )
    pids = [int(pid) for pid in repl.execute(code).stdout.split()]
    # with a private uid the sleepers are already gone after the cell; otherwise they are still running
    repl.close()
    # SIGKILLed processes take a moment to exit on a loaded machine: poll (a 50 ms sleep was flaky), 60 s a hang guard
    watched = pids if AS_ROOT else pids[:2]
    deadline = time.monotonic() + 60
    while any(process_alive(pid) for pid in watched) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not process_alive(pids[0]) and not process_alive(pids[1])
    if AS_ROOT:
        assert not process_alive(pids[2])


def test_garbage_collected_repl_is_cleaned_up():
    repl = PythonREPL(timeout_s=2)
    repl.execute("x = 1")
    pid, root = repl.pid, repl._resources.root_dir
    del repl
    import gc

    gc.collect()
    deadline = time.monotonic() + 60  # a hang guard: the finalizer killed it, it exits at once
    while (process_alive(pid) or os.path.exists(root)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not process_alive(pid) and not os.path.exists(root)


def _localhost_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server, server.getsockname()[1]


def test_process_isolation_takes_tcp_away_where_landlock_can():
    server, port = _localhost_server()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).close()\nprint('reached')"
    with server:
        with PythonREPL(timeout_s=3, isolation="process") as repl:
            result = repl.execute(code)
        if sandbox_module.host_support().landlock_abi >= 4:  # e.g. the served policy's dev-mode endpoint, refused
            assert "PermissionError" in (result.error or ""), result
        else:
            assert result.stdout == "reached\n"  # documented non-guarantee without Landlock's TCP rules
        with PythonREPL(timeout_s=3, isolation="process", network=True) as repl:  # asked for: the network stays
            assert repl.execute(code).stdout == "reached\n"


@pytest.mark.skipif(sandbox_module.host_support().landlock_abi < 1, reason="this kernel has no Landlock")
def test_process_isolation_keeps_writes_in_the_repls_home():
    """Two process-backend REPLs share the host's /tmp, /var/tmp and /dev/shm: with Landlock neither may create a
    file there (no channel between REPLs through them), while its own home (and TMPDIR, which is it) works."""
    probe = (
        "import os, tempfile\n"
        "for path in ('/tmp/trl_ext_ll', '/var/tmp/trl_ext_ll', '/dev/shm/trl_ext_ll'):\n"
        "    try:\n        open(path, 'w').write('x'); print('wrote', path)\n"
        "    except PermissionError:\n        print('denied', path)\n"
        "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())\n"
        "with tempfile.NamedTemporaryFile() as f: f.write(b'x'); print('tempfile ok')\n"
        "open(os.devnull, 'w').write('x'); print('devnull ok')"
    )
    with PythonREPL(timeout_s=3, isolation="process") as repl:
        out = repl.execute(probe).stdout.splitlines()
    assert out == [
        "denied /tmp/trl_ext_ll", "denied /var/tmp/trl_ext_ll", "denied /dev/shm/trl_ext_ll",
        "ok", "tempfile ok", "devnull ok",
    ]  # fmt: skip


def _namespace_available() -> bool:
    return sandbox_module.host_support().namespaces is None


@pytest.mark.skipif(not _namespace_available(), reason="this host does not allow Linux namespaces")
def test_namespace_isolation_cuts_the_network_and_hides_host_processes():
    server, port = _localhost_server()
    with server, PythonREPL(timeout_s=1, isolation="strict") as repl:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        error = repl.execute(code).error
        assert "OSError" in error or "ConnectionRefusedError" in error
        assert repl.execute("import os; print(os.getpid())").stdout == "1\n"  # its own PID namespace
        assert str(os.getpid()) not in repl.execute("import os; print(os.listdir('/proc'))").stdout
        assert repl.execute("while True: pass").timed_out
        assert repl.execute("print('back')").stdout.endswith("back\n")


def test_strict_isolation_refuses_a_host_without_namespaces(monkeypatch):
    """The probe's answer is replaced (this host has namespaces); the decision taken from it is the real one."""
    from dataclasses import replace

    host = replace(sandbox_module.host_support(), namespaces="unshare: Operation not permitted")
    monkeypatch.setattr(sandbox_host, "_host", host)
    with pytest.raises(SandboxError, match="isolation='strict' needs Linux namespaces.*Operation not permitted"):
        PythonREPL(isolation="strict")
    monkeypatch.setattr(sandbox_host, "_warned", set())
    with pytest.warns(RuntimeWarning, match="falling back to the process backend. NOT isolated: .*to read"):
        with PythonREPL(isolation="auto") as repl:
            assert repl.isolation == "process"
            assert repl.execute("print(1)").stdout == "1\n"


_NON_ROOT_SCRIPT = """
import os, time
from trl_ext.rlm import PythonREPL
for isolation in ("process", "auto"):
  with PythonREPL("ctx", timeout_s=1, memory_mb=256, max_processes=4, isolation=isolation) as repl:
    print(repl.isolation, "uid", repl.uid, repl.execute("import os; print(os.getuid(), context)").stdout.strip())
    forks = "import os\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n            import time; time.sleep(30); os._exit(0)\\n        n += 1\\nexcept OSError as exc:\\n    print(n, type(exc).__name__)"
    print("forks", repl.execute(forks).stdout.strip())
    print("timeout", repl.execute("while True: pass").timed_out, repl.execute("print(1)").restarted)
    pgid = os.getpgid(repl.pid)
  print("left", [p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/stat") and int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[2]) == pgid])
"""


@needs_root
def test_non_root_trainer_shares_its_uid_and_is_still_limited():
    """The shared-uid path (trainer not root), run as `nobody` with the interpreter bind-mounted where it can reach it."""
    import shutil
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not (shutil.which("unshare") and shutil.which("setpriv") and traversable_by_others(repo)):
        pytest.skip("needs unshare, setpriv and a checkout that `nobody` can read")
    workdir = tempfile.mkdtemp(dir=repl_parent_dir())  # `nobody` must reach it, whatever $TMPDIR's mode
    try:
        os.chmod(workdir, 0o755)
        mount = os.path.join(workdir, "python")
        os.mkdir(mount)
        script = os.path.join(workdir, "check.py")
        with open(script, "w") as handle:
            handle.write(_NON_ROOT_SCRIPT)
        python = os.path.join(mount, os.path.relpath(os.path.realpath(sys.executable), sys.base_prefix))
        inner = (
            f"mount --bind {sys.base_prefix} {mount} && cd {workdir} && setpriv --reuid=65534 --regid=65534 "
            f"--clear-groups env -i PATH=/usr/bin:/bin HOME={workdir} PYTHONPATH={repo} {python} {script}"
        )
        run = subprocess.run(["unshare", "--mount", "sh", "-c", inner], capture_output=True, text=True, timeout=60)
        if run.returncode != 0 and "mount" in run.stderr:
            pytest.skip(f"cannot bind-mount here: {run.stderr.strip()[-2000:]}")
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        # RLIMIT_NPROC of a shared uid counts the trainer's tasks too: the thread that measures the process
        # backend's disk during the cell (started then, the first time) takes one of the REPL's 4.
        assert lines[1] in ("forks 3 BlockingIOError", "forks 4 BlockingIOError"), lines
        assert lines[:1] + lines[2:] == [
            "process uid None 65534 ctx",  # the trainer's own uid: limited by rlimits only
            "timeout True True",
            "left []",
            "namespace uid None 1000 ctx",  # a user namespace of its own, mapped to the trainer's uid
            "forks 4 BlockingIOError",
            "timeout True True",
            "left []",
        ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_uid_leases_are_exclusive_across_processes():
    import subprocess
    import sys

    from trl_ext.rlm.sandbox import acquire_uid

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from trl_ext.rlm.sandbox import acquire_uid; import sys\nfor _ in range(3): print(acquire_uid().uid, flush=True)\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        theirs = {int(holder.stdout.readline()) for _ in range(3)}
        first, second = acquire_uid(), acquire_uid()
        assert len({first.uid, second.uid} | theirs) == 5  # nobody shares a uid
        first.release()
        again = acquire_uid()
        assert again.uid == first.uid  # a released uid is reused (lowest free first)
        again.release()
        second.release()
    finally:
        holder.communicate("")


@pytest.mark.skipif(not _namespace_available(), reason="this host does not allow Linux namespaces")
def test_namespaced_repl_folders_live_in_memory_where_the_host_has_a_tmpfs(monkeypatch):
    """A namespaced REPL's host folder holds only its root's mount point and its start-up log: on /dev/shm where that
    is a writable tmpfs (no disk inode to allocate per start), else in the temporary folder. The process backend's
    folder holds the REPL's home, so it stays on disk."""
    from trl_ext.rlm.sandbox import local

    memory = sandbox_host.memory_folder()
    with PythonREPL(isolation="strict") as repl:
        assert repl.execute("print(6 * 7)").stdout == "42\n"
        expected = memory if memory is not None else tempfile.gettempdir()
        assert os.path.dirname(repl._resources.root_dir) == expected
    assert not os.path.exists(repl._resources.root_dir)
    with PythonREPL(isolation="process") as repl:
        assert not repl._resources.root_dir.startswith(sandbox_host.MEMORY_FOLDER)
    monkeypatch.setattr(local, "memory_folder", lambda: None)  # a host without a writable tmpfs there
    with PythonREPL(isolation="strict") as repl:
        assert repl.execute("print(6 * 7)").stdout == "42\n"
        assert not repl._resources.root_dir.startswith(sandbox_host.MEMORY_FOLDER)


def test_a_dead_zygote_is_replaced_by_the_next_repl(caplog):
    """The zygote forks every REPL without replying (each child reports its own pid): one killed between REPLs is
    noticed and replaced, and REPLs started before it go on working."""
    from trl_ext.rlm.sandbox import local

    with PythonREPL() as before:
        before.execute("x = 1")
        zygote = local._zygote
        os.kill(zygote.popen.pid, 9)
        zygote.popen.wait(5)
        with PythonREPL() as after:
            assert after.execute("print(6 * 7)").stdout == "42\n"
            assert after.pid is not None and process_alive(after.pid)
        assert local._zygote is not zygote and "The REPL zygote exited" in caplog.text
        assert before.execute("print(x + 1)").stdout == "2\n"


def _simulated_host(monkeypatch, **changes) -> None:
    """This host as the sandbox would see another one (its probe's answers replaced; the decisions are real)."""
    from dataclasses import replace

    monkeypatch.setattr(sandbox_host, "_host", replace(sandbox_module.host_support(), **changes))
    monkeypatch.setattr(sandbox_host, "_warned", set())


@pytest.mark.parametrize(
    ("host", "exposed"),
    [
        ({"namespaces": None}, []),
        ({"namespaces": "simulated", "landlock_abi": 7}, []),
        ({"namespaces": "simulated", "landlock_abi": 3}, ["loopback TCP (Landlock ABI 3 < 4)"]),
        ({"namespaces": "simulated", "landlock_abi": 0}, ["output_dir", "loopback TCP (no Landlock in this kernel)"]),
    ],
    ids=["namespaces", "landlock 7", "landlock 3", "no landlock"],
)
def test_run_exposure_names_what_a_repl_can_reach_of_the_run(host, exposed, monkeypatch, tmp_path):
    """What of an async run (its output_dir, the served policy's dev-mode endpoint) each kind of host leaves to
    model code: the output_dir only where REPLs may read it (`repl_can_read`), TCP where Landlock cannot cut it."""
    import sys

    _simulated_host(monkeypatch, **host)
    found = sandbox_module.run_exposure(SandboxLimits(), str(tmp_path))
    assert len(found) == len(exposed) and all(map(str.startswith, found, exposed)), found
    assert sandbox_module.repl_can_read(str(tmp_path)) == ("output_dir" in exposed)
    assert sandbox_module.repl_can_read(os.__file__)  # the standard library, on every host
    if host["namespaces"] is not None and host["landlock_abi"] > 0:  # an output_dir in the Python installation
        inside = sandbox_module.run_exposure(SandboxLimits(), os.path.join(sys.prefix, "runs", "out"))
        assert inside[0].startswith("output_dir") and "which REPLs may read (readable_roots)" in inside[0]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny_rlm_exposure"))


@pytest.mark.parametrize("host", ["no landlock", "landlock 7", "this host"])
def test_async_rlm_trainer_warns_once_when_repls_can_reach_the_run(host, tiny_model_dir, tmp_path, monkeypatch):
    """An async RLM run keeps its rollout trees, rollout_state.json and weight index in output_dir and serves its
    policy over loopback TCP: on a process backend without Landlock the trainer says so loudly at construction,
    naming what is exposed and the fix; where the sandbox holds (this host's namespaces, or the process backend
    under Landlock ABI 7 with output_dir in /tmp) it says nothing."""
    import warnings

    from ..trainers.test_async_rlm import make_trainer

    if host != "this host":
        abi = 0 if host == "no landlock" else 7
        _simulated_host(monkeypatch, namespaces="simulated: no namespaces", landlock_abi=abi)
    else:
        monkeypatch.setattr(sandbox_host, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tiny_model_dir, tmp_path / "out")
    warned = [str(w.message) for w in caught if "cannot keep model code from this run" in str(w.message)]
    if host == "no landlock":
        assert len(warned) == 1, warned
        assert warned[0].startswith("AsyncStepwiseRLMTrainer: the REPL sandbox cannot keep model code from this run")
        for part in ("output_dir", "rollout_state.json", "loopback TCP", "load_lora_adapter", "isolation='strict'"):
            assert part in warned[0], (part, warned[0])
        assert "Landlock ABI >= 4" in warned[0]
    else:
        assert warned == []
