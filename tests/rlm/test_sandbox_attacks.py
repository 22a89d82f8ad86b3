"""Attacks on the REPL sandbox with its default settings, by class (docs/security.md). Every test is an attack that
must fail: model code run for real in a real sandbox, real sockets on 127.0.0.1, real processes.

The suite expects what this project's CI machine gives: root, Linux namespaces and writable cgroup v1 controllers.
Where the host gives less, the tests of what needs it are skipped with the reason (the warning of
`trl_ext.rlm.sandbox.resolve_isolation` says the same to a user).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from trl_ext.rlm import PythonREPL, SandboxLimits
from trl_ext.rlm import sandbox as sandbox_module
from trl_ext.rlm.repl_protocol import OUTPUT_NOTE_CHARS
from trl_ext.rlm.sandbox import processes_of_uid

from ..utils import process_alive

HOST = sandbox_module.host_support()
AS_ROOT = os.geteuid() == 0
needs_namespaces = pytest.mark.skipif(HOST.namespaces is not None, reason=f"no namespaces here: {HOST.namespaces}")
needs_cgroups = pytest.mark.skipif(HOST.cgroups is not None, reason=f"no control groups here: {HOST.cgroups}")
needs_root = pytest.mark.skipif(not AS_ROOT, reason="private uids need a root trainer")
needs_seccomp = pytest.mark.skipif(HOST.seccomp is not None, reason=f"no syscall filter here: {HOST.seccomp}")

# One uid only, so that a REPL opened after another one surely gets the uid the first one had.
ONE_UID = range(1_900_070_000, 1_900_070_001)


def run(repl: PythonREPL, code: str):
    return repl.execute(textwrap.dedent(code))


def test_default_isolation_is_the_strongest_the_host_allows():
    with PythonREPL() as repl:
        assert repl.isolation == ("namespace" if HOST.namespaces is None else "process")
    report = sandbox_module.isolation_report(SandboxLimits())
    assert report["repl/isolation"] == repl.isolation
    if HOST.namespaces is None and HOST.cgroups is None and HOST.seccomp is None and AS_ROOT:
        assert report["open"] == []  # nothing of the threat model left open on this host


# --------------------------------------------------------------------- 1. reward tampering via the file system
@needs_namespaces
def test_1_trainer_command_line_and_world_readable_files_are_out_of_sight(tmp_path):
    answers = tmp_path / "dataset" / "answers.jsonl"
    answers.parent.mkdir()
    answers.write_text('{"answer": "42"}\n')
    for path in (tmp_path, answers.parent):
        os.chmod(path, 0o755)
    os.chmod(answers, 0o644)  # world-readable ground truth next to the trainer
    checkpoint = os.path.join(os.getcwd(), "pyproject.toml")  # the project source, the trainer's cwd
    with PythonREPL() as repl:
        for target in (f"/proc/{os.getpid()}/cmdline", str(answers), checkpoint, sys.modules[__name__].__file__):
            result = run(repl, f"print(open({target!r}).read())")
            assert result.error is not None and "FileNotFoundError" in result.error, (target, result)
        listing = run(repl, "import os; print(sorted(os.listdir('/')))").stdout
        assert "work" not in listing and "home" in listing and "tmp" in listing
        assert "No module named 'trl_ext'" in run(repl, "import trl_ext").error  # nor the reward's source
        # the runtime it sees is read-only
        site = sandbox_module.interpreter_import_paths()[-1]
        write = run(repl, f"open({os.path.join(site, 'evil.pth')!r}, 'w')")
        assert write.error is not None and ("Read-only" in write.error or "PermissionError" in write.error)
        pids = run(repl, "import os; print([p for p in os.listdir('/proc') if p.isdigit()])").stdout
        assert pids == "['1']\n"  # its own processes only


# ------------------------------------------------------------------------------ 2. the trainer's local services
class _FakeVLLMServe(http.server.BaseHTTPRequestHandler):
    """Stands in for `trl vllm-serve`: unauthenticated endpoints that replace or close the policy's weights."""

    hits: list[str] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def vllm_serve():
    _FakeVLLMServe.hits = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLMServe)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


_POST = """
import urllib.request
for path in ("/close_communicator/", "/update_named_param/"):
    try:
        urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:{port}" + path, data=b"{{}}"), timeout=2)
        print("reached", path)
    except OSError as exc:
        print("blocked", type(exc).__name__)
"""


@needs_namespaces
def test_2_weight_update_endpoints_on_loopback_are_unreachable(vllm_serve):
    with PythonREPL() as repl:
        out = run(repl, _POST.format(port=vllm_serve)).stdout
    assert "reached" not in out and out.count("blocked") == 2
    assert _FakeVLLMServe.hits == []


@needs_namespaces
def test_2_network_is_an_explicit_opt_in(vllm_serve):
    with PythonREPL(network=True) as repl:  # documented: this is what lets model code reach the trainer's services
        assert run(repl, _POST.format(port=vllm_serve)).stdout.count("reached") == 2
    assert len(_FakeVLLMServe.hits) == 2


@needs_namespaces
def test_2_a_port_the_repl_listens_on_is_not_the_trainers_loopback():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free now; the REPL tries to take it and answer the trainer
    with PythonREPL() as repl:
        out = run(
            repl,
            f"""
            import socket
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", {port})); s.listen(); print("listening")
            except OSError as exc:
                print("no", exc)
            """,
        ).stdout
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert "listening" not in out or "no" not in out  # whichever it got, the trainer never reached it


@needs_namespaces
def test_2_world_writable_unix_sockets_are_out_of_reach(tmp_path):
    path = os.path.join(tempfile.gettempdir(), f"trl_ext_attack_{os.getpid()}.sock")
    abstract = f"\0trl_ext_attack_{os.getpid()}"
    servers = []
    try:
        for address in (path, abstract):
            server = socket.socket(socket.AF_UNIX)
            server.bind(address)
            server.listen()
            servers.append(server)
        os.chmod(path, 0o777)
        with PythonREPL() as repl:
            for address in (path, abstract):
                result = run(repl, f"import socket\nsocket.socket(socket.AF_UNIX).connect({address!r})")
                assert result.error is not None and (
                    "FileNotFoundError" in result.error or "Connection" in result.error
                )
    finally:
        for server in servers:
            server.close()
        if os.path.exists(path):
            os.remove(path)


# ------------------------------------------------------------------------------ 3. state that outlives a REPL
@needs_namespaces
@needs_root
def test_3_files_in_tmp_and_dev_shm_die_with_the_repl_and_the_next_one_on_its_uid_sees_nothing():
    with PythonREPL(sandbox_uids=ONE_UID) as first:
        run(first, "for d in ('/tmp', '/dev/shm', '.'):\n    open(d + '/answer', 'w').write('42')")
        uid = first.uid
    with PythonREPL(sandbox_uids=ONE_UID) as second:
        assert second.uid == uid
        out = run(second, "import os\nprint([os.path.exists(d + '/answer') for d in ('/tmp', '/dev/shm', '.')])")
        assert out.stdout == "[False, False, False]\n"


_SHARE_NO_FILES = r"""
import json, os, sys
from trl_ext.rlm import PythonREPL
from trl_ext.rlm import sandbox

look = (
    "import json, os\n"
    "seen = {d: sorted(os.listdir(d)) for d in ('/tmp', '/dev/shm')}\n"
    "writable = [e for e in seen['/tmp'] if os.access(os.path.join('/tmp', e), os.W_OK)]\n"
    "print(json.dumps({'seen': seen, 'writable': writable}))"
)
write = "import os\nfor d in ('/tmp', '/dev/shm'):\n    open(d + '/shared', 'w').write('hi')\n    os.chmod(d + '/shared', 0o666)"
with PythonREPL() as first, PythonREPL() as second:
    first.execute(write)
    report = json.loads(second.execute(look).stdout)
# What a REPL may see in its /tmp: the top folders of the interpreter's read-only binds that lie under the host's
# /tmp (a venv under /tmp is normal), and nothing else.
report["runtime"] = sorted({p[len("/tmp/"):].split("/")[0] for p in sandbox.runtime_paths() if p.startswith("/tmp/")})
print("REPORT " + json.dumps(report))
"""


def _venv_under_tmp() -> str:
    """A venv under the host's /tmp that sees this interpreter's packages, as a CI venv under /tmp would."""
    root = tempfile.mkdtemp(prefix="trl_ext_test_venv_", dir="/tmp")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", root], check=True)
    return root


@needs_namespaces
@pytest.mark.parametrize("interpreter", ["this", "venv_under_tmp"])
def test_3_concurrent_repls_share_no_files(interpreter):
    """A REPL sees neither another REPL's files nor the host's in /tmp and /dev/shm, wherever the venv lives.

    With the trainer's venv under /tmp, the interpreter's read-only bind shows its top folder in the REPL's /tmp:
    that is the runtime, not shared state. The test allows exactly that, and checks the REPL cannot write there.
    """
    venv = _venv_under_tmp() if interpreter == "venv_under_tmp" else None
    python = os.path.join(venv, "bin", "python") if venv else sys.executable
    fd, host_state = tempfile.mkstemp(prefix="trl_ext_host_state_", dir="/tmp")  # the host's writable state
    os.close(fd)
    try:
        result = subprocess.run([python, "-c", _SHARE_NO_FILES], capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(host_state)
        if venv:
            subprocess.run(["rm", "-rf", venv], check=True)
    reports = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and reports, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(reports[-1][len("REPORT ") :])
    if venv:
        assert report["runtime"] == [os.path.basename(venv)]  # the host layout this variant exists for
    assert report["seen"]["/dev/shm"] == []
    assert report["seen"]["/tmp"] == report["runtime"]  # neither the other REPL's file nor the host's
    assert report["writable"] == []


@needs_root
def test_3_process_backend_deletes_what_a_closed_repl_left_in_shared_directories():
    with PythonREPL(isolation="process", sandbox_uids=ONE_UID) as repl:
        out = run(repl, "import tempfile\nfor d in ('/tmp', '/dev/shm'):\n    print(tempfile.mkstemp(dir=d)[1])")
        left = out.stdout.split()
        assert all(os.path.exists(path) for path in left)
    assert not any(os.path.exists(path) for path in left)


@needs_root
@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_3_orphaned_zombies_do_not_starve_the_next_repl_on_the_uid(isolation):
    orphans = """
    import os
    for _ in range(4):
        if os.fork() == 0:      # the child forks a grandchild and exits at once: the grandchild is an orphan
            if os.fork() == 0:
                os._exit(0)     # ... which exits too, and becomes a zombie unless someone adopts and reaps it
            os._exit(0)
    """
    with PythonREPL(isolation=isolation, max_processes=4, sandbox_uids=ONE_UID) as repl:
        for _ in range(3):
            run(repl, orphans)
        deadline = time.monotonic() + 60  # a hang guard: their reaper waits for them as they exit
        while (zombies := _zombies_of_uid(repl.uid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert zombies == []
    with PythonREPL(isolation=isolation, max_processes=4, sandbox_uids=ONE_UID) as repl:
        threads = "import threading\nt = [threading.Thread(target=lambda: None) for _ in range(3)]\n[x.start() for x in t]\nprint('ok')"
        assert run(repl, threads).stdout == "ok\n"


def _zombies_of_uid(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                status = open(f"/proc/{name}/status").read()
            except OSError:
                continue
            if f"\nUid:\t{uid}\t" in status and "\nState:\tZ" in status:
                found.append(int(name))
    return found


_TRAINER = """
import sys, json
from trl_ext.rlm import PythonREPL
repls = [PythonREPL(isolation=sys.argv[1], max_processes=8) for _ in range(2)]
for repl in repls:
    repl.execute("import subprocess\\nsubprocess.Popen(['sleep', '300'], start_new_session=True)")
from trl_ext.rlm.sandbox import local
print(json.dumps([[repl.uid, repl._resources.root_dir, repl.pid] for repl in repls]), flush=True)
print(local._zygote.popen.pid if local._zygote is not None else -1, flush=True)
# Killed with SIGKILL in the middle of this cell, once its escaped sleeper runs (the test waits for that).
repls[0].execute("import subprocess, time\\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\\ntime.sleep(300)")
"""


@needs_root
@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_3_a_trainer_killed_with_sigkill_leaves_nothing_behind(isolation):
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, isolation], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        repls = json.loads(trainer.stdout.readline())
        zygote = int(trainer.stdout.readline())
        deadline = time.monotonic() + 120  # a hang guard
        while len(processes_of_uid(repls[0][0])) < 2:  # the first REPL is inside its last cell: its sleeper runs
            assert trainer.poll() is None and time.monotonic() < deadline, "the first REPL's last cell did not start"
            time.sleep(0.05)
        for uid, _root, _pid in repls:
            assert processes_of_uid(uid)  # the REPLs run (strays are killed between cells)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 60  # a hang guard: what the trainer left goes within a second
    while time.monotonic() < deadline:
        left = [(uid, processes_of_uid(uid), os.path.exists(root)) for uid, root, _ in repls]
        supervisors = [pid for _, _, pid in repls if process_alive(pid)]
        if all(not pids and not exists for _, pids, exists in left) and not supervisors and not process_alive(zygote):
            break
        time.sleep(0.05)
    assert all(not pids and not exists for _, pids, exists in left), left
    assert not supervisors and not process_alive(zygote)  # the REPLs' supervisors and the zygote are gone too
    if HOST.cgroups is None:
        for base in HOST.cgroup_dirs.values():
            assert not [name for name in os.listdir(base) if name.startswith(f"trl_ext_{trainer.pid}_")]


# ------------------------------------------------------------------------------------ 4. limits per REPL
_CHILDREN_HOLD_MEMORY = """
import os
read, write = os.pipe()
release_read, release_write = os.pipe()
children, holding = [], []
for _ in range(4):
    holding_read, holding_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(release_write)
        block = bytearray(200 * 2**20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(holding_write, b"x")
        os.read(release_read, 1)  # still holding it when the others hold theirs (the kernel kills some on the way)
        os.write(write, b"x")
        os._exit(0)
    os.close(holding_write)
    children.append(pid)
    holding.append(holding_read)
for fd in holding:
    os.read(fd, 1)  # the child holds its block, or was killed first (end of file)
os.close(release_write)
os.close(write)
held = 0
while True:
    chunk = os.read(read, 8)
    if not chunk:
        break
    held += len(chunk)
for pid in children:
    os.waitpid(pid, 0)
print("held", held)
"""


@needs_cgroups
def test_4_memory_is_limited_for_the_whole_repl_not_per_process():
    with PythonREPL(memory_mb=512, max_processes=8, timeout_s=20) as repl:
        result = run(repl, _CHILDREN_HOLD_MEMORY)
        peak = repl.memory_peak_bytes()
        # The survivors all hold 200 MB at the same time at the end: under 512 MB, at most 2 of the 4 can.
        held = int(result.stdout.split()[1]) if "held" in result.stdout else 0
        assert held <= 2, result
        assert result.crashed or result.timed_out or "held" in result.stdout, result
        assert peak is None or peak <= 512 * 2**20, (peak, result)


@needs_namespaces
@needs_cgroups
@pytest.mark.parametrize("where", ["/dev/shm", "memfd"])
def test_4_shared_memory_files_count_against_the_repl(where):
    # 700 MB of files in memory with memory_mb=512 (disk_mb large, so only the memory limit can stop it)
    open_file = "os.memfd_create('x')" if where == "memfd" else "os.open('/dev/shm/x', os.O_CREAT | os.O_WRONLY)"
    code = f"""
    import os
    fd = {open_file}
    written = 0
    try:
        for _ in range(70):
            written += os.write(fd, b"x" * (10 * 2**20))
    except OSError as exc:
        print("stopped", type(exc).__name__)
    print("written MB", written // 2**20)
    """
    with PythonREPL(memory_mb=512, disk_mb=2048, timeout_s=20) as repl:
        result = run(repl, code)
        assert "written MB 700" not in result.stdout, result
        assert result.crashed or "stopped" in result.stdout


@needs_namespaces
def test_4_disk_is_limited_for_the_whole_repl_not_per_file():
    code = """
    written = 0
    try:
        for path in ("/tmp/a", "/dev/shm/b", "c"):
            with open(path, "wb") as handle:
                for _ in range(15):
                    written += handle.write(b"x" * 2**20)
    except OSError as exc:
        print("stopped", exc.strerror)
    print(written // 2**20)
    """
    with PythonREPL(disk_mb=32, memory_mb=512) as repl:
        out = run(repl, code).stdout.split("\n")
        assert out[0] == "stopped No space left on device" and int(out[1]) <= 32


@needs_cgroups
def test_4_nothing_of_the_repl_runs_between_cells():
    start = """
    import threading, time
    count = [0]
    def spin():
        while True:
            count[0] += 1
    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.3)
    rate = count[0] / 0.3
    """
    with PythonREPL(timeout_s=5) as repl:
        run(repl, start)
        before = int(run(repl, "print(count[0])").stdout)
        time.sleep(0.5)  # between cells: the spinning thread must be frozen
        after = int(run(repl, "print(count[0])").stdout)
        rate = float(run(repl, "print(rate)").stdout)
    assert after - before < 0.1 * rate * 0.5, (before, after, rate)


# ------------------------------------------------------------------------------------- 5. the result channel
# Model code finds the descriptor its interpreter writes results to as any attacker would: in its own memory.
FIND_PROTOCOL_FD = (
    "import gc\nPROTOCOL_FD = next(o for o in gc.get_objects() if type(o).__name__ == '_Channel').write_fd\n"
)
_FORGE = (
    FIND_PROTOCOL_FD
    + """
import json, os, sys
frame = json.dumps({{"kind": "result", "seq": {seq}, "stdout": "forged", "error": None, "final_answer": {answer}}})
data = frame.encode()
os.write(PROTOCOL_FD, len(data).to_bytes(4, "big") + data)
print("real {cell}")
"""
)


def test_5_a_forged_frame_never_answers_a_later_cell():
    with PythonREPL() as repl:
        first = run(repl, _FORGE.format(seq=1, answer='"x" * 10', cell=1))
        # The forged frame carries the right sequence: it is accepted as this cell's result, which gives the model
        # nothing its own FINAL_VAR would not. The real frame that follows must not become the next cell's result.
        assert first.crashed or first.stdout == "forged"
        second = run(repl, "print('real 2')")
        assert "real 1" not in second.stdout
        assert second.stdout.endswith("real 2\n") or (second.crashed and "frame of cell 1" in second.error)
        third = run(repl, _FORGE.format(seq=99, answer='"y"', cell=3))  # a frame of another cell
        assert third.crashed and "broke the REPL protocol" in third.error and third.final_answer is None
        assert run(repl, "print('real 4')").stdout.endswith("real 4\n")


def test_5_a_huge_final_answer_is_cut_and_recorded():
    with PythonREPL(max_answer_chars=1000) as repl:
        result = run(repl, "answer = 'a' * (60 * 2**20)\nFINAL_VAR('answer')")
        assert len(result.final_answer) == 1000 and result.answer_truncated
        forged = run(repl, _FORGE.format(seq=repl._seq + 1, answer='"b" * 5_000_000', cell=2))
        assert forged.crashed or (len(forged.final_answer) == 1000 and forged.answer_truncated)


def test_5_nesting_past_the_parsers_stack_restarts_the_repl():
    code = FIND_PROTOCOL_FD + (
        "import os, sys\ndata = ('[' * 200000 + ']' * 200000).encode()\n"
        "os.write(PROTOCOL_FD, len(data).to_bytes(4, 'big') + data)\nimport time; time.sleep(1)"
    )
    with PythonREPL(timeout_s=5) as repl:
        result = run(repl, code)
        assert result.crashed and "broke the REPL protocol" in result.error
        assert run(repl, "print(1)").stdout.endswith("1\n")


# -------------------------------------------------------------------------------------------- 6. judge tools
def _judge_tools():
    from trl_ext.judge import JudgeTools, build_marked_trace
    from trl_ext.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    trace = build_marked_trace(tokenizer, tokenizer("2 + 2 = 5")["input_ids"], every=8)
    return JudgeTools(trace, python_timeout=20)


def test_6_run_python_cannot_change_what_check_equivalent_answers():
    tools = _judge_tools()

    async def attack():
        try:
            assert (await tools.check_equivalent("1", "2")).startswith("not equivalent")
            await tools.python.run(
                "import sympy, os, signal\n"
                "sympy.simplify = lambda e: 0\n"  # patch what decides, in run_python's own interpreter
                "for pid in range(2, 100):\n"  # and try to reach the checker's processes
                "    try: os.kill(pid, signal.SIGSTOP)\n"
                "    except OSError: pass\n",
                20,
            )
            return await tools.check_equivalent("1", "2"), await tools.check_equivalent("2/4", "1/2")
        finally:
            await tools.aclose()

    assert asyncio.run(attack()) == ("not equivalent: a - b simplifies to -1", "equivalent")


def test_6_check_equivalent_input_cannot_run_code_or_change_later_checks():
    tools = _judge_tools()

    async def attack():
        try:
            answers = []
            for a in ("__import__('os').system('id')", "(lambda: 0)()", "x.func", "exec(chr(49))", "1\nimport os"):
                answers.append(await tools.call("check_equivalent", {"a": a, "b": "1"}))
            # a name outside the grammar's is a product of one-letter symbols (S*y*m*...): nothing is called
            answers.append(await tools.call("check_equivalent", {"a": "Symbol(x)", "b": "x"}))
            answers.append(await tools.call("check_equivalent", {"a": "1", "b": "2"}))
            return answers
        finally:
            await tools.aclose()

    answers = asyncio.run(attack())
    assert all(answer.startswith("error: a is not a math expression") for answer in answers[:3] + answers[4:5])
    assert answers[3] != "equivalent" and "49" in answers[3]  # no exec there: a product of symbols e*x*e*c*...
    assert answers[-1] == "not equivalent: a - b simplifies to -1"


# ------------------------------------------------------------------------------------------------ 7. hardening
@needs_seccomp
def test_7_privileges_cannot_be_regained():
    code = """
    import ctypes, os, subprocess
    libc = ctypes.CDLL(None, use_errno=True)
    status = open("/proc/self/status").read()
    print("no_new_privs", "NoNewPrivs:\\t1" in status, "filtered", "Seccomp:\\t2" in status)
    attempts = {
        "unshare(user)": lambda: libc.unshare(0x10000000),
        "unshare(net)": lambda: libc.unshare(0x40000000),
        "clone(newuser)": lambda: libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0),
        "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
        "ptrace(TRACEME)": lambda: libc.ptrace(0, 0, 0, 0),
        "keyctl": lambda: libc.syscall(250, 0, 0, 0, 0, 0),
        "bpf": lambda: libc.syscall(321, 0, 0, 0),
        "chroot": lambda: libc.chroot(b"/tmp"),
    }
    for name, attempt in attempts.items():
        result = attempt()
        print(name, "refused" if result == -1 and ctypes.get_errno() == 1 else f"ALLOWED {result}")
    run = subprocess.run(["unshare", "--user", "--map-root-user", "id", "-u"], capture_output=True, text=True)
    print("unshare tool", "refused" if run.returncode else "ALLOWED " + run.stdout)
    """
    with PythonREPL(max_processes=8) as repl:
        out = run(repl, code).stdout
    assert out.startswith("no_new_privs True filtered True\n"), out
    assert "ALLOWED" not in out and out.count("refused") == 9, out


@needs_seccomp
def test_7_threads_and_subprocesses_still_work_under_the_filter():
    code = """
    import subprocess, threading
    results = []
    threads = [threading.Thread(target=results.append, args=(i,)) for i in range(3)]
    [t.start() for t in threads]; [t.join() for t in threads]
    print(sorted(results), subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout.strip())
    """
    with PythonREPL(max_processes=8) as repl:
        assert run(repl, code).stdout == "[0, 1, 2] hi\n"


@needs_root
def test_7_setuid_binaries_do_not_raise_privileges():
    with PythonREPL(max_processes=8) as repl:
        out = run(
            repl,
            """
            import os, stat, subprocess
            for path in ("/usr/bin/su", "/bin/su", "/usr/bin/passwd", "/usr/bin/newgrp"):
                if os.path.exists(path) and os.stat(path).st_mode & stat.S_ISUID:
                    print(path, open("/proc/self/status").read().count("NoNewPrivs:\\t1"))
                    break
            """,
        ).stdout
    assert out == "" or out.endswith(" 1\n")  # set: execve ignores the setuid bit
    assert signal.SIGKILL  # (keeps the import used when no setuid binary is installed)


# ------------------------------------------------------------------- 4. limits per REPL: the queries of one cell
# The policy's code asks the trainer for work: every llm_query is tokenized and generated by the trainer. The
# cell's query budget (RLMScaffoldConfig.max_cell_query*, max_query_prompt_chars) is counted by the engine from what
# it tokenizes, generates and waits for, never from anything the REPL reports.


def _run_engine(actions: list[str], *, llm_answer: str = "ok", latency_s: float = 0.0, tokenizer=None, **settings):
    """One rollout of task "t" whose turns play `actions`, through the real engine and sandbox; every llm_query is
    answered `llm_answer`. Returns the tree and the engine's stats."""
    from trl_ext.rlm import RLMEngine, RLMScaffoldConfig, RLMTask, ScriptedGenerator
    from trl_ext.testing import build_tiny_tokenizer

    plain = build_tiny_tokenizer()

    def respond(prompt: str) -> str:  # a turn's prompt ends with "Task: t\n\nTurn <n> of"; a query's does not
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        if "Task: t\n\nTurn " not in last_user:
            return llm_answer
        return actions[int(last_user.split("Task: t\n\nTurn ", 1)[1].split(" ", 1)[0]) - 1]

    sandbox = SandboxLimits().with_overrides(**settings.pop("sandbox", {}))
    engine = RLMEngine(
        ScriptedGenerator(respond, plain, latency_s=latency_s),
        tokenizer if tokenizer is not None else plain,
        RLMScaffoldConfig(sandbox=sandbox, **settings),
    )
    [tree] = engine.run([RLMTask("t", context="c")])
    return tree, engine.stats


class _CountingTokenizer:
    """The tiny tokenizer, recording the length of every text it renders or tokenizes."""

    def __init__(self) -> None:
        from trl_ext.testing import build_tiny_tokenizer

        self._tokenizer = build_tiny_tokenizer()
        self.lengths: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def __call__(self, text: str, **kwargs):
        self.lengths.append(len(text))
        return self._tokenizer(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self.lengths.append(sum(len(message["content"]) for message in messages))
        return self._tokenizer.apply_chat_template(messages, **kwargs)


@pytest.mark.parametrize(
    "loop",
    ["while True:\n    llm_query('x')", "while True:\n    llm_query_batched(['x'] * 64)"],
    ids=["llm_query", "llm_query_batched"],
)
def test_4_an_endless_query_loop_stops_at_the_cells_query_budget(loop):
    tree, stats = _run_engine([f"```repl\n{loop}\n```", "FINAL(done)"])
    [first, _] = tree.root.turns
    assert len(first.llm_calls) == 256  # the default max_cell_queries; before: generations until the cell's timeout
    assert not first.repl_result.timed_out
    assert (
        "failed: " in first.repl_result.error
        and "(max_cell_queries=256); use what you have" in first.repl_result.error
    )
    assert (stats.over_budget_queries, stats.refused_queries, stats.llm_queries) == (1, 1, 256)
    assert tree.final_answer == "done"  # the rollout goes on


def test_4_a_loop_that_swallows_the_refusal_ends_at_the_cell_timeout_with_no_more_generations():
    code = "while True:\n    try:\n        llm_query('x')\n    except RuntimeError:\n        pass"
    tree, stats = _run_engine([f"```repl\n{code}\n```", "FINAL(done)"], sandbox={"timeout_s": 1})
    first = tree.root.turns[0]
    assert first.repl_result.timed_out and len(first.llm_calls) == 256
    assert stats.over_budget_queries >= 1 and stats.llm_queries == 256 and tree.final_answer == "done"


@pytest.mark.parametrize(
    ("max_depth", "huge_call"),
    [(1, "rlm_query('y' * 2**21)"), (0, "rlm_query('z', context='w' * 2**21)")],
    ids=["child_task", "degraded_context"],
)
def test_4_a_2mb_query_prompt_is_refused_without_being_tokenized(max_depth, huge_call):
    tokenizer = _CountingTokenizer()
    code = (
        f"for call in (lambda: llm_query('x' * 2**21), lambda: {huge_call}, "
        "lambda: llm_query_batched(['v' * 150_000] * 8)):\n"
        "    try:\n        call()\n    except RuntimeError as error:\n        print(str(error)[:200])"
    )
    tree, stats = _run_engine([f"```repl\n{code}\n```", "FINAL(done)"], tokenizer=tokenizer, max_depth=max_depth)
    out = tree.root.turns[0].repl_result.stdout
    assert out.count("characters is longer than max_query_prompt_chars=200,000; shorten it") == 2, out
    assert "llm_query_batched sends 1,200,000 characters" in out and "(max_cell_query_chars=1,000,000)" in out, out
    assert (stats.refused_queries, stats.over_budget_queries, stats.llm_queries, stats.children) == (3, 1, 0, 0)
    assert max(tokenizer.lengths) < 100_000  # before: every 2 MB prompt went through the tokenizer


def test_4_the_wall_time_of_queries_counts_against_the_cell():
    code = "for i in range(3):\n    try:\n        print(llm_query('x'))\n    except RuntimeError as error:\n        print(error)"
    tree, stats = _run_engine(
        [f"```repl\n{code}\n```", "FINAL(done)"], latency_s=0.2, max_cell_query_time_s=0.1
    )  # every generator call sleeps 0.2 s: the first query spends the cell's 0.1 s
    lines = tree.root.turns[0].repl_result.stdout.splitlines()
    assert lines[0] == "ok" and len(tree.root.turns[0].llm_calls) == 1
    assert all("(max_cell_query_time_s=0.1); use what you have" in line for line in lines[1:]), lines
    assert stats.over_budget_queries == 2


def test_4_generated_tokens_count_against_the_cell():
    code = (
        "for i in range(3):\n    try:\n        llm_query('x')\n    except RuntimeError as error:\n        print(error)"
    )
    tree, stats = _run_engine(
        [f"```repl\n{code}\n```", "FINAL(done)"], llm_answer="a long answer " * 20, max_cell_query_tokens=5
    )
    first = tree.root.turns[0]
    assert len(first.llm_calls) == 1 and len(first.llm_calls[0].completion_ids) > 5
    assert first.repl_result.stdout.count("(max_cell_query_tokens=5); use what you have") == 2
    assert stats.over_budget_queries == 2


# ------------------------------------------------------------- issue 30, class 5: caps on everything the trainer keeps
def test_5_a_forged_frame_cannot_flood_the_trainer_with_output():
    # A forged result frame with the current sequence number passes the sequence check; whatever it says, the
    # trainer keeps at most max_output_chars of its stdout and of its error (the rollout trees keep what it keeps).
    flood = FIND_PROTOCOL_FD + (
        "import json, os\n"
        "frame = json.dumps({{'kind': 'result', 'seq': {seq}, 'stdout': 'o' * 8_000_000, 'error': 'e' * 8_000_000,"
        " 'final_answer': None}}).encode()\n"
        "os.write(PROTOCOL_FD, len(frame).to_bytes(4, 'big') + frame)\n"
        "import time; time.sleep(60)\n"  # the real result comes too late to be seen as extra bytes
    )
    with PythonREPL(max_output_chars=1000) as repl:
        result = run(repl, flood.format(seq=repl._seq + 1))
        assert not result.crashed  # the forged frame was taken as this cell's result: now cut to the limits
        kept = 1000 + OUTPUT_NOTE_CHARS  # the limit and the room for the sandbox's own note
        assert result.stdout == "o" * kept + f"\n... [{8_000_000 - kept} more characters not shown]"
        assert result.error == "e" * kept + f"\n... [{8_000_000 - kept} more characters not shown]"


def _host_bytes_under(path: str) -> int:
    """Bytes of disk the files under `path` take, as the host sees them (a REPL's tmpfs is not in its view)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


_FLOOD_STDOUT_THEN_FILES = """
import os
chunk = b"x" * 2**20
through_stdout = in_files = 0
for _ in range({chunks}):
    try:
        through_stdout += os.write(1, chunk)  # as a subprocess or C code would: straight to descriptor 1
    except OSError:
        break
try:
    with open(os.path.join({folder!r}, "fill"), "wb", buffering=0) as handle:
        for _ in range({chunks}):
            in_files += handle.write(chunk)
except OSError:
    pass
print("WRITTEN", through_stdout + in_files)
"""


@needs_namespaces
def test_5_stdout_cannot_grow_the_hosts_disk_past_disk_mb():
    # The REPL writes 4 x disk_mb to its stdout, then as much into files: everything it wrote sits inside its one
    # disk_mb (its output file is on its own tmpfs, emptied after each cell), and the host's disk takes none of it.
    disk_mb = 8
    with PythonREPL(disk_mb=disk_mb, max_output_chars=200) as repl:
        root = repl._resources.root_dir
        for cell in range(3):  # the same again in later cells: nothing adds up
            result = run(repl, _FLOOD_STDOUT_THEN_FILES.format(chunks=4 * disk_mb, folder="/tmp"))
            written = int(result.stdout.rsplit("WRITTEN ", 1)[1].split()[0])
            assert written <= disk_mb * 2**20, (cell, written)
            assert _host_bytes_under(root) < 2**20, (cell, _host_bytes_under(root))
            run(repl, "import os; os.remove('/tmp/fill')")


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_5_stdout_leaves_no_log_on_the_hosts_disk(isolation):
    # Whatever the backend, what the REPL writes to its descriptors 1/2 is not kept on the host after the cell
    # (the process backend's home is on the host's disk: its output file there is emptied after each cell).
    with PythonREPL(isolation=isolation, disk_mb=8, max_output_chars=200) as repl:
        root = repl._resources.root_dir
        for _ in range(3):
            result = run(repl, _FLOOD_STDOUT_THEN_FILES.format(chunks=16, folder=repl.workdir + "/no/such/dir"))
            assert "WRITTEN" in result.stdout and len(result.stdout) < 300
            assert _host_bytes_under(root) < 2**20, _host_bytes_under(root)


# ------------------------------------------------------------------ issue 30, class 7: close() under concurrent callers
def _close_from_threads(repl: PythonREPL, threads: int) -> list[BaseException]:
    """Call `repl.close()` from `threads` threads at once; returns what they raised. Each caller checks, once its
    close returned, that the REPL's supervisor is gone (a second caller must not return before the first is done)."""
    pid = repl.pid
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def close() -> None:
        barrier.wait()
        try:
            repl.close()
            assert pid is None or not process_alive(pid), f"close() returned while supervisor {pid} still runs"
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    workers = [threading.Thread(target=close) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    return errors


@pytest.mark.parametrize("moment", ["idle", "in_cell", "in_query"])
def test_7_close_from_many_threads_during_a_cell_reaches_no_caller(moment):
    started, go_on = threading.Event(), threading.Event()

    def on_query(request):
        started.set()
        if moment == "in_query":
            go_on.wait(timeout=60)  # the REPL is closed while its query is being answered
        return ["ok"]

    repl = PythonREPL(timeout_s=60, on_query=on_query)
    uid, pid = repl.uid, repl.pid
    outcome: dict[str, object] = {}

    def cell() -> None:
        try:
            outcome["result"] = repl.execute("llm_query('started')\nimport time\ntime.sleep(60)")
        except BaseException as exc:  # noqa: BLE001 - the assertion below names it
            outcome["error"] = exc

    worker = threading.Thread(target=cell)
    if moment != "idle":
        worker.start()
        assert started.wait(timeout=60)
    errors = _close_from_threads(repl, threads=8)
    go_on.set()
    if moment != "idle":
        worker.join(timeout=60)
        assert not worker.is_alive() and "error" not in outcome, outcome
        result = outcome["result"]
        assert result.crashed and not result.timed_out and "closed" in result.error, result
    assert errors == [], errors
    assert repl.closed and not process_alive(pid)
    if uid is not None:
        assert processes_of_uid(uid) == []
    with pytest.raises(RuntimeError, match="closed"):  # later calls are refused as before, close stays a no-op
        repl.execute("1")
    repl.close()


def test_7_execute_and_close_races_on_many_repls():
    # execute() on one thread, close() on four, with seeded delays that land the closes in every phase of a cell
    # (sending it, running it, reading its result, freezing the REPL, starting a fresh interpreter after a crash).
    import random

    delays = random.Random(30)
    cells = ["print(1)", "import time; time.sleep(0.05)", "import os; os._exit(3)", "x = 'y' * 10**6"]
    for round_ in range(12):
        repl = PythonREPL(timeout_s=30)
        uid, pid = repl.uid, repl.pid
        outcome: dict[str, object] = {}

        def cells_then_close(repl=repl, outcome=outcome, round_=round_) -> None:
            try:
                outcome["results"] = [repl.execute(cells[(round_ + i) % len(cells)]) for i in range(3)]
            except RuntimeError as exc:  # a cell that begins after close() returned is refused: the documented error
                outcome["refused"] = exc
            except BaseException as exc:  # noqa: BLE001 - the assertion below names it
                outcome["error"] = exc

        worker = threading.Thread(target=cells_then_close)
        worker.start()
        time.sleep(delays.uniform(0, 0.08))
        errors = _close_from_threads(repl, threads=4)
        worker.join(timeout=60)
        assert not worker.is_alive() and "error" not in outcome and errors == [], (round_, outcome, errors)
        if "refused" in outcome:
            assert "closed" in str(outcome["refused"]), outcome
        assert not process_alive(pid)
        if uid is not None:
            assert processes_of_uid(uid) == []


# ------------------------------------------------------- issue 30, class 6: freezing that cannot be dodged
def _cpu_seconds_of_uid(uid: int) -> float:
    """User + system CPU time of every live process of `uid` so far (from /proc/<pid>/stat, not the wall clock)."""
    ticks = 0
    for pid in processes_of_uid(uid):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.fixture(params=["cgroup freezer", "stop signals"])
def freezer(request, monkeypatch):
    """The host as it is (control groups: the cgroup freezer), or as a host without control groups (the REPL's
    processes are stopped with SIGSTOP instead)."""
    if request.param == "cgroup freezer" and HOST.cgroups is not None:
        pytest.skip(f"no control groups here: {HOST.cgroups}")
    if request.param == "stop signals":
        from dataclasses import replace

        from trl_ext.rlm.sandbox import local

        no_cgroups = replace(HOST, cgroups="simulated: a host without control groups", cgroup_dirs={})
        monkeypatch.setattr(local, "host_support", lambda: no_cgroups)
    return request.param


# A single-threaded REPL whose timer signal handler burns CPU whenever it runs: between cells (the server waits on
# its pipe, a read the signal interrupts) and while its query is answered.
_TIMER_BURNER = """
import signal, time
def burn(*_):
    end = time.thread_time() + 0.008
    while time.thread_time() < end:
        pass
signal.signal(signal.SIGALRM, burn)
signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
"""


@needs_root
def test_6_a_timer_signal_handler_does_not_run_between_cells_or_during_a_query(freezer):
    slow_query_cpu: list[float] = []

    def on_query(request):  # a slow answer: the REPL waits, frozen, while the trainer measures its CPU time
        before = _cpu_seconds_of_uid(repl.uid)
        time.sleep(0.5)
        slow_query_cpu.append(_cpu_seconds_of_uid(repl.uid) - before)
        return ["answer"]

    with PythonREPL(timeout_s=30, on_query=on_query) as repl:
        assert run(repl, _TIMER_BURNER).error is None
        assert run(repl, "import threading; print(threading.active_count())").stdout == "1\n"  # one thread only
        # What the handler burns while the REPL runs (a cell that sleeps): the rate to compare with.
        before = _cpu_seconds_of_uid(repl.uid)
        run(repl, "time.sleep(0.5)")
        running = _cpu_seconds_of_uid(repl.uid) - before
        assert running > 0.05, running  # the attack is armed: the handler burns CPU while the REPL may run
        before = _cpu_seconds_of_uid(repl.uid)
        time.sleep(0.5)  # between cells
        between_cells = _cpu_seconds_of_uid(repl.uid) - before
        assert run(repl, "print(llm_query('slow'))").stdout == "answer\n"
    assert between_cells < 0.1 * running, (between_cells, running)
    assert slow_query_cpu[0] < 0.1 * running, (slow_query_cpu, running)


# ------------------------------------------------------------------ issue 30, class 8: the process backend
def _without_namespaces(monkeypatch) -> None:
    """Make the REPLs of this test see a host without namespaces (where the process backend is the fallback)."""
    from dataclasses import replace

    from trl_ext.rlm.sandbox import local

    no_namespaces = replace(HOST, namespaces="simulated: a host without namespaces")
    monkeypatch.setattr(local, "host_support", lambda: no_namespaces)


_SYSV = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_CREAT, IPC_EXCL = 0o1000, 0o2000
def checked(result, what):
    if result == -1:
        raise OSError(ctypes.get_errno(), what + ": " + os.strerror(ctypes.get_errno()))
    return result
"""


def _sysv_objects_of_uid(uid: int) -> list[str]:
    found = []
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as handle:
            header, *rows = [line.split() for line in handle]
        for row in rows:
            if uid in (int(row[header.index("uid")]), int(row[header.index("cuid")])):
                found.append(f"{kind} {row[1]}")
    return found


@needs_root
@pytest.mark.parametrize("host", ["this host", "no namespaces"])
def test_8_sysv_shared_memory_dies_with_each_interpreter_life(host, monkeypatch):
    if host == "no namespaces":
        _without_namespaces(monkeypatch)
    make = (
        _SYSV
        + """
shm = checked(libc.shmget(0x30300801, 8 << 20, IPC_CREAT | 0o600), "shmget")
address = libc.shmat(shm, None, 0)
ctypes.memset(address, 1, 8 << 20)  # touched: 8 MB outside the memory group once this life ends
checked(libc.msgget(0x30300802, IPC_CREAT | 0o600), "msgget")
checked(libc.semget(0x30300803, 1, IPC_CREAT | 0o600), "semget")
print("made")
"""
    )
    find = _SYSV + "print([libc.shmget(0x30300801, 0, 0), libc.msgget(0x30300802, 0), libc.semget(0x30300803, 0, 0)])"
    with PythonREPL(isolation="process", sandbox_uids=ONE_UID, timeout_s=30) as repl:
        uid = repl.uid
        assert run(repl, make).stdout == "made\n"
        assert run(repl, "import os; os._exit(1)").crashed  # the next cell starts a new interpreter life
        assert run(repl, find).stdout.endswith("[-1, -1, -1]\n")  # nothing of the last life is there
        assert run(repl, make).stdout == "made\n"
    assert _sysv_objects_of_uid(uid) == []


@needs_root
@needs_namespaces
def test_8_concurrent_process_backend_repls_share_no_sysv_message_queue():
    send = (
        _SYSV
        + """
queue = checked(libc.msgget(0x30300804, IPC_CREAT | 0o666), "msgget")
message = ctypes.create_string_buffer(8 + 6)
ctypes.memmove(message, (1).to_bytes(8, "little") + b"secret", 14)
checked(libc.msgsnd(queue, message, 6, 0), "msgsnd")
print("sent")
"""
    )
    receive = (
        _SYSV
        + """
queue = libc.msgget(0x30300804, 0)
message = ctypes.create_string_buffer(8 + 64)
print("received", libc.msgrcv(queue, message, 64, 0, 0o4000) if queue != -1 else "no queue", message.raw[8:14])
"""
    )
    with PythonREPL(isolation="process") as sender, PythonREPL(isolation="process") as receiver:
        assert run(sender, send).stdout == "sent\n"
        out = run(receiver, receive).stdout
    assert "secret" not in out and "no queue" in out, out


@needs_root
@needs_namespaces
def test_8_a_repl_cannot_take_every_pty():
    hog = """
import os, time
def hold():
    held = []
    try:
        while True:
            held.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
    except OSError:
        pass
    return len(held)
counts = []
for _ in range(24):
    read, write = os.pipe()
    if os.fork() == 0:
        os.write(write, str(hold()).encode() + b" ")
        time.sleep(60)
        os._exit(0)
    counts.append(int(os.read(read, 16)))
mine = hold()
print(sum(counts) + mine, llm_query("may the trainer open a pty now?"))
"""
    opened: list[str] = []

    def on_query(request):
        try:
            master, slave = os.openpty()
        except OSError as exc:
            opened.append(f"openpty failed: {exc}")
        else:
            os.close(master)
            os.close(slave)
            opened.append("ok")
        return [opened[-1]]

    with PythonREPL(isolation="process", timeout_s=60, on_query=on_query) as repl:
        result = run(repl, hog)
    assert opened == ["ok"], (opened, result)
    held = int(result.stdout.split()[0])
    assert held <= 64, held


@needs_root
def test_8_a_repl_that_breaks_its_own_restart_is_replaced_and_cannot_write_the_trainers_log(caplog):
    # A REPL that shares a non-root trainer's uid can append to its own start-up log on the host; the test writes
    # what it would (a root trainer's REPLs cannot: the log is root's), then the REPL makes its folder unusable to
    # its own uid and crashes, so that its restart fails and the log's tail is reported.
    forged = "\x1b[2J\x1b[1;31m\nWARNING trl_ext: forged by the policy\n"
    break_restart = "import os\nos.chmod(os.getcwd(), 0)\nos._exit(1)"
    with PythonREPL(isolation="process", timeout_s=30) as repl:
        with open(os.path.join(repl._resources.root_dir, "stdio.log"), "a") as log:
            log.write(forged)
        results = [repl.execute(code) for code in (break_restart, "print('after')", "print('again')")]
        logging.getLogger("trl_ext.rlm.engine").warning("cell error: %s", results[1].error)  # as a trainer would
    crash, failed_restart, fresh = results
    assert crash.crashed and failed_restart.crashed, results  # contained: a crashed cell, no exception
    assert "could not be restarted" in failed_restart.error, failed_restart
    assert fresh.error is None and fresh.stdout.endswith("again\n"), fresh  # the replaced REPL runs the next cell
    for text in (caplog.text, *(result.error or "" for result in results)):
        assert "\x1b" not in text, text
        assert not any(line.startswith("WARNING trl_ext: forged") for line in text.splitlines()), text


# ------------------------------------------------------------------ 4. the trainer is never the OOM victim
_LOWER_OOM_SCORE = """
import ctypes, os, subprocess
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: own /proc/self again after the privilege drop
for path, value in (("oom_score_adj", "0"), ("oom_score_adj", "-1000"), ("oom_adj", "0")):
    try:
        with open(f"/proc/self/{path}", "w") as handle:
            handle.write(value)
        print("lowered", path, value)
    except OSError as exc:
        print("refused", type(exc).__name__)
child = subprocess.run(  # a new program is dumpable: its /proc/self is its own
    ["sh", "-c", "echo 0 > /proc/self/oom_score_adj; cat /proc/self/oom_score_adj"], capture_output=True, text=True
)
print("child", child.stdout.split()[-1])
print("now", open("/proc/self/oom_score_adj").read().strip())
"""


def _has_capability(bit: int) -> bool:
    with open("/proc/self/status") as handle:
        effective = next(line for line in handle if line.startswith("CapEff:")).split()[1]
    return bool(int(effective, 16) >> bit & 1)


CAP_SYS_RESOURCE = 24


@needs_root
@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_4_every_repl_process_is_the_oom_killers_first_choice_and_model_code_cannot_change_it(isolation):
    with PythonREPL(isolation=isolation, timeout_s=10) as repl:
        run(repl, "1")  # the interpreter is up
        # Seen from the trainer: the supervisor and the interpreter carry the top score.
        processes = [repl.pid, *processes_of_uid(repl.uid)]
        assert len(processes) == 2, processes
        scores = {pid: open(f"/proc/{pid}/oom_score_adj").read().strip() for pid in processes}
        assert set(scores.values()) == {"1000"}, scores
        result = run(repl, _LOWER_OOM_SCORE)
        # The namespace backend's /proc is read-only; on the host's /proc (process backend) the score written by a
        # root trainer with CAP_SYS_RESOURCE is the lowest its processes may set. Without that capability (Docker
        # drops it), model code of the process backend can lower its score (docs/security.md).
        if repl.isolation == "namespace" or _has_capability(CAP_SYS_RESOURCE):
            assert "lowered" not in result.stdout and result.stdout.count("refused") == 3, result
            assert "child 1000" in result.stdout and "now 1000" in result.stdout, result
        assert open(f"/proc/{repl.pid}/oom_score_adj").read().strip() == "1000"  # the supervisor runs no model code


_TRAINER_IN_A_MEMORY_GROUP = """
import json, os, sys, threading
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as handle:
    handle.write("0")  # this trainer, and every process it starts, is charged to the 1 GiB group from now on
weights = b"\\1" * (400 * 2**20)  # the trainer's own memory (model, optimiser states): the largest process here
from trl_ext.rlm import PythonREPL

# Each REPL fills its memory_mb with pages that no rlimit counts (memfds of 100 MB, under the largest file it may
# write), 10 MB at a time, the two in step: with the trainer they pass the group's limit before either reaches its own.
FILL = '''
import os, time
files = []
while True:
    files.append(os.memfd_create("fill"))
    for _ in range(10):
        os.write(files[-1], b"x" * (10 * 2**20))
        time.sleep(0.02)
'''
repls = [PythonREPL(memory_mb=400, timeout_s=60) for _ in range(2)]
results = [None, None]

def fill(index):
    results[index] = repls[index].execute(FILL)

threads = [threading.Thread(target=fill, args=(index,)) for index in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
after = repls[0].execute("print('restarted')")
for repl in repls:
    repl.close()
print(json.dumps({
    "results": [{"crashed": r.crashed, "timed_out": r.timed_out, "error": r.error} for r in results],
    "after": after.stdout,
    "weights": len(weights),
}))
"""


def _remove_group(path: str, timeout_s: float = 20) -> None:
    """Remove a test memory group and the groups in it, once their processes are gone."""
    deadline = time.monotonic() + timeout_s
    for directory in sorted((entry[0] for entry in os.walk(path)), key=len, reverse=True):
        while True:
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@needs_root
@needs_cgroups
def test_4_repls_at_their_memory_limits_never_get_the_trainer_oom_killed():
    group = os.path.join(HOST.cgroup_dirs["memory"], f"trl_ext_test_trainer_{os.getpid()}")
    try:
        os.mkdir(group)
    except OSError as exc:
        pytest.skip(f"cannot create a memory group for the trainer under {HOST.cgroup_dirs['memory']}: {exc}")
    try:
        for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if os.path.exists(os.path.join(group, name)):
                with open(os.path.join(group, name), "w") as handle:
                    handle.write(str(2**30))
        trainer = subprocess.run(
            [sys.executable, "-c", _TRAINER_IN_A_MEMORY_GROUP, group], capture_output=True, text=True, timeout=300
        )
        assert trainer.returncode == 0, (trainer.returncode, trainer.stderr[-3000:])  # -9: the kernel killed it
        report = json.loads(trainer.stdout.splitlines()[-1])
        for result in report["results"]:  # both REPLs were killed for their memory, and said so
            assert result["crashed"] and "ran out of memory" in result["error"], report
        assert report["after"].endswith("restarted\n") and report["weights"] == 400 * 2**20
    finally:
        _remove_group(group)


def test_4_the_repls_memory_budget_leaves_the_trainer_the_rest_of_its_group():
    from trl_ext.rlm.sandbox.cgroups import repl_memory_budget

    ram = 64 * 2**30
    assert repl_memory_budget(2**30, ram) == 2**29  # half of a 1 GiB trainer group, whole pages
    assert repl_memory_budget(2**30 + 4095, ram) % 4096 == 0
    assert repl_memory_budget(9223372036854771712, ram) is None  # an unlimited group: no budget


def test_4_a_rollout_spreading_its_queries_over_cells_stops_at_the_trees_budget():
    """Each cell stays within its own budget; the tree's (every node, every cell) stops the rollout as a whole: per
    cell alone, a tree could send cells x nodes times max_cell_queries (one root with 4 children sent 1,276)."""
    code = (
        "for i in range(3):\n    try:\n        llm_query('x')\n        print('ok')\n"
        "    except RuntimeError as error:\n        print(str(error)[:400])"
    )
    cell = f"```repl\n{code}\n```"
    tree, stats = _run_engine([cell, cell, cell, "FINAL(done)"], max_cell_queries=4, max_tree_queries=7)
    calls = [len(turn.llm_calls) for turn in tree.root.turns]
    assert calls == [3, 3, 1, 0] and sum(calls) == 7  # every cell under its 4, the tree stopped at 7
    third = tree.root.turns[2].repl_result.stdout.splitlines()
    assert third[0] == "ok" and all("(max_tree_queries=7); this rollout's query budget" in line for line in third[1:])
    assert stats.over_budget_queries == 2 and tree.final_answer == "done"


def test_4_the_trees_character_budget_counts_every_cell():
    code = "try:\n    llm_query('y' * 600)\n    print('ok')\nexcept RuntimeError as error:\n    print(error)"
    cell = f"```repl\n{code}\n```"
    tree, _ = _run_engine([cell, cell, cell, "FINAL(done)"], max_tree_query_chars=1_500)
    outputs = [turn.repl_result.stdout.strip() for turn in tree.root.turns[:3]]
    assert outputs[:2] == ["ok", "ok"] and "(max_tree_query_chars=1,500)" in outputs[2], outputs


# ------------------------------------------------- issue 42: the process backend's reads and its disk in total
needs_landlock = pytest.mark.skipif(HOST.landlock_abi < 1, reason="this kernel has no Landlock")


def _disk_error_mb(error: str | None) -> float:
    """The MB the REPL's files took when it was stopped, from the error the model reads."""
    assert error is not None and error.startswith("disk budget exceeded: "), error
    return float(error.split(" took ", 1)[1].split(" MB", 1)[0])


def _home_bytes(repl: PythonREPL) -> int:
    return sandbox_module.measure_home(repl.workdir, [], 2**62, 2**31).bytes


_WRITE_384_MB = """
import os
kept, written = [], 0
for index in range(48):  # 384 MB in 8 MB files, each under the per-file cap (RLIMIT_FSIZE = disk_mb)
    handle = open(f"part{index}", "wb")
    if {remove}:  # removed at once, kept open: its blocks stay taken until it is closed
        os.unlink(f"part{index}")
        kept.append(handle)
    handle.write(b"x" * (8 << 20))
    written += 8
    if not {remove}:
        handle.close()
print("written MB", written)
"""


@pytest.mark.parametrize("remove", [False, True], ids=["files", "removed files kept open"])
def test_4_process_backend_disk_is_limited_for_the_whole_home(remove):
    """One REPL with disk_mb=32 wrote 384 MB in 8 MB files (capped per file only). Now its home is measured from
    outside during and after every cell (removed files its processes keep open included): past disk_mb the REPL is
    stopped like a memory overrun, the model reads why, the home is emptied, and the next cell works.

    The bound: the writes the REPL makes between two measurements (docs/security.md gives the overshoot measured);
    it cannot exceed what the cell writes in all (384 MB), and a cell that finishes before a measurement is stopped
    by the one after its result. Nothing here depends on timing."""
    code = _WRITE_384_MB.replace("{remove}", str(remove))
    with PythonREPL(isolation="process", disk_mb=32, memory_mb=512, max_open_files=128, timeout_s=60) as repl:
        result = run(repl, code)
        assert result.crashed and result.error is not None, result
        peak = _disk_error_mb(result.error)
        assert 32 < peak <= 384, result.error
        assert "of disk_mb=32" in result.error and "next cell starts a fresh REPL" in result.error
        after = run(repl, "import os; print(os.listdir('.'))")
        assert after.restarted and "exceeded its disk budget" in after.stdout and after.stdout.endswith("[]\n")
        assert _home_bytes(repl) < 32 * 2**20
        assert run(repl, "open('small', 'wb').write(b'x' * (8 << 20)); print('fits')").stdout == "fits\n"


def test_4_process_backend_counts_files_as_the_namespace_backends_tmpfs_does():
    code = "import os\nfor index in range(5000):\n    os.mkdir(f'd{index}')\nprint('made them all')"
    with PythonREPL(isolation="process", disk_mb=8, timeout_s=60) as repl:
        result = run(repl, code)
        assert "made them all" not in result.stdout, result
        assert result.error.startswith("disk budget exceeded: its home held more than 1024 files and folders")
        assert run(repl, "import os; print(len(os.listdir('.')))").stdout.endswith("0\n")


@needs_landlock
def test_1_process_backend_reads_only_its_home_and_the_runtime(tmp_path):
    """Landlock's read rights: a process-backend REPL reads, lists and executes only beneath its home and
    `readable_roots` (system directories, the Python installation). A world-readable file the trainer wrote in a
    fresh folder (an output_dir in /tmp), /tmp itself, the checkout and another REPL's home are refused; the
    standard library, numpy and subprocesses still work."""
    answers = tmp_path / "rollout_trees" / "run-0.jsonl"
    answers.parent.mkdir()
    answers.write_text('{"final_answer": "42"}\n')
    for path in (tmp_path, answers.parent):
        os.chmod(path, 0o755)
    os.chmod(answers, 0o644)
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert not sandbox_module.repl_can_read(str(answers), SandboxLimits(isolation="process"))
    with (
        PythonREPL(isolation="process", max_processes=8) as other,
        PythonREPL(isolation="process", max_processes=8) as repl,
    ):
        run(other, "import os\nos.chmod('.', 0o755)\nopen('notes', 'w').write('mine')\nos.chmod('notes', 0o644)")
        targets = {
            "trainer's file": f"open({str(answers)!r}).read()",
            "its folder": f"os.listdir({str(tmp_path)!r})",
            "/tmp": "os.listdir('/tmp')",
            "/var/tmp": "os.listdir('/var/tmp')",
            "/dev/shm": "os.listdir('/dev/shm')",
            "checkout": f"open({os.path.join(checkout, 'pyproject.toml')!r}).read()",
            "other REPL's home": f"open({os.path.join(other.workdir, 'notes')!r}).read()",
        }
        for what, expression in targets.items():
            result = run(repl, f"import os\nprint({expression})")
            assert result.error is not None and "PermissionError" in result.error, (what, result)
        works = run(
            repl,
            """
            import collections, json, math, os, re, subprocess
            print(json.dumps({"a": math.sqrt(4)}), re.sub("b", "c", "ab"), collections.Counter("aab")["a"])
            print(subprocess.run(["ls", "/usr"], capture_output=True, text=True).returncode)
            open("mine", "w").write("ok"); print(open("mine").read(), os.listdir("."))
            try:
                import numpy
            except ImportError:
                print(6)
            else:
                print(int(numpy.arange(4).sum()))
            """,
        )
        assert works.error is None and works.stdout.splitlines() == ['{"a": 2.0} ac 2', "0", "ok ['mine']", "6"]
        assert run(other, "print(open('notes').read())").stdout == "mine\n"  # each reads its own


_READ_FROM_A_VENV_UNDER_TMP = r"""
import json, os, sys
from trl_ext.rlm import PythonREPL
with PythonREPL(isolation="process") as repl:
    denied = repl.execute(f"print(open({sys.argv[1]!r}).read())").error
    imports = repl.execute("import json, re, math, collections, sys; print(sys.prefix)").stdout
print("REPORT " + json.dumps({"denied": "PermissionError" in (denied or ""), "imports": imports, "prefix": sys.prefix}))
"""


@needs_landlock
def test_1_process_backend_reads_from_a_venv_under_tmp(tmp_path):
    """A CI venv under /tmp is the Python installation: readable; the rest of /tmp is not."""
    venv = _venv_under_tmp()
    secret = tmp_path / "secret.txt"
    secret.write_text("42")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)
    try:
        python = os.path.join(venv, "bin", "python")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": repo}
        result = subprocess.run(
            [python, "-c", _READ_FROM_A_VENV_UNDER_TMP, str(secret)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        subprocess.run(["rm", "-rf", venv], check=True)
    reports = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and reports, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(reports[-1][len("REPORT ") :])
    assert report["prefix"] == venv and report["denied"], report
    assert report["imports"].strip(), report
