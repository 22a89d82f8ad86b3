"""`trl_ext.jsonl`: JSON-lines logs and JSON files that stay valid after any failed write.

Real files throughout; the disk-full tests fill a real 64 KiB tmpfs (they need root to mount it and skip without).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest

from trl_ext.jsonl import append_jsonl, read_jsonl, rewrite_jsonl, write_json_atomic
from trl_ext.judge.audit import JudgeAuditLog
from trl_ext.rlm import RLMScaffoldConfig
from trl_ext.rlm.method import StepwiseRLM
from trl_ext.rlm.tree_files import TREES_FOLDER
from trl_ext.run_info import RUN_INFO_FILE, RunInfo, read_run_info, write_run_info

TORN = '{"a": 0}\n{"a": 1}\n{"a": 1'  # two records and the start of a third, as a failed write leaves them


def strict_records(path: Path) -> list[dict]:
    """Every line of ``path`` parsed, raising on any fragment (what a plain JSON-lines reader does)."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"{path} ends with a fragment: {text[-40:]!r}"
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs, unmounted after the test."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)], capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("no `mount` command: cannot fill a real disk")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill a real disk (needs root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def fill(disk: Path) -> Path:
    """Write a filler file until the disk is full; returns it (delete it to free the space)."""
    filler = disk / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(descriptor, b"\0" * 512)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(descriptor)
    return filler


def padded(index: int) -> dict:
    """A record of about 3 KB: two of them outgrow what a full tmpfs has left (the slack of a 4 KiB page)."""
    return {"i": index, "pad": "x" * 3000}


# ------------------------------------------------------------------------------------------------ torn lines
def test_append_cuts_a_torn_last_line_away(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_text(TORN, encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="trl_ext.jsonl"):
        start = append_jsonl(path, [{"b": 2}])
    assert start == 2
    assert path.read_text(encoding="utf-8") == '{"a": 0}\n{"a": 1}\n{"b": 2}\n'
    assert strict_records(path) == [{"a": 0}, {"a": 1}, {"b": 2}]
    assert "log.jsonl" in caplog.text and "7 byte(s)" in caplog.text


def test_append_a_file_that_is_one_fragment(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": ', encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="trl_ext.jsonl"):
        assert append_jsonl(path, [{"b": 1}]) == 0
    assert strict_records(path) == [{"b": 1}]
    assert "6 byte(s)" in caplog.text


def test_append_returns_the_line_of_the_first_record(tmp_path):
    path = tmp_path / "deep" / "folder" / "log.jsonl"
    assert append_jsonl(path, [{"i": 0}, {"i": 1}]) == 0
    assert append_jsonl(path, [{"i": 2}]) == 2
    with path.open("a", encoding="utf-8") as handle:  # another writer between two appends
        handle.write('{"i": 3}\n{"i": 4}\n')
    assert append_jsonl(path, [{"i": 5}]) == 5
    assert append_jsonl(path, []) == 6
    assert [record["i"] for record in strict_records(path)] == list(range(6))


def test_read_skips_a_torn_line_instead_of_raising(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_text(TORN, encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="trl_ext.jsonl"):
        assert read_jsonl(path) == [{"a": 0}, {"a": 1}]
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Skipped 1 unreadable line(s)" in caplog.text and "line 3" in caplog.text
    assert "log.jsonl" in caplog.text
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_audit_log_reads_and_repairs_a_torn_line(tmp_path):
    path = tmp_path / "judge_audit.jsonl"
    path.write_text(TORN, encoding="utf-8")
    log = JudgeAuditLog(path)
    assert log.read() == [{"a": 0}, {"a": 1}]
    log.write([{"step": 1}])
    assert strict_records(path) == [{"a": 0}, {"a": 1}, {"step": 1}]
    assert JudgeAuditLog(tmp_path / "none" / "judge_audit.jsonl").read() == []


# ------------------------------------------------------------------------------------------------ disk full
def test_append_on_a_full_disk_leaves_no_fragment(small_disk):
    path = small_disk / "log.jsonl"
    append_jsonl(path, [{"i": 0}])
    filler = fill(small_disk)
    before = path.read_bytes()
    with pytest.raises(OSError, match="disk full") as caught:
        append_jsonl(path, [padded(1), padded(2)])
    assert caught.value.errno == errno.ENOSPC and str(path) in str(caught.value)
    assert path.read_bytes() == before
    filler.unlink()
    assert append_jsonl(path, [padded(1), padded(2)]) == 1
    assert strict_records(path) == [{"i": 0}, padded(1), padded(2)]


def test_audit_log_on_a_full_disk_stays_valid(small_disk):
    log = JudgeAuditLog(small_disk / "judge_audit.jsonl")
    log.write([{"step": 0}])
    filler = fill(small_disk)
    with pytest.raises(OSError, match="disk full"):
        log.write([padded(1), padded(2)])
    assert strict_records(Path(log.path)) == [{"step": 0}] == log.read()
    filler.unlink()
    log.write([{"step": 3}])
    assert strict_records(Path(log.path)) == [{"step": 0}, {"step": 3}]


def test_run_info_on_a_full_disk_keeps_the_previous_file(small_disk):
    write_run_info(small_disk, RunInfo(source="first run"))
    filler = fill(small_disk)
    with pytest.raises(OSError, match="disk full") as caught:
        write_run_info(small_disk, RunInfo(source="second run", extra={"pad": "x" * 5000}))
    assert RUN_INFO_FILE in str(caught.value)
    assert read_run_info(small_disk).source == "first run"
    assert sorted(os.listdir(small_disk)) == sorted([RUN_INFO_FILE, "filler"])  # no temporary file left
    filler.unlink()
    write_run_info(small_disk, RunInfo(source="second run", extra={"pad": "x" * 5000}))
    assert read_run_info(small_disk).source == "second run"


def test_rewrite_on_a_full_disk_keeps_the_old_file(small_disk):
    path = small_disk / "log.jsonl"
    append_jsonl(path, [{"i": i} for i in range(10)])
    before = path.read_bytes()
    filler = fill(small_disk)
    with pytest.raises(OSError, match="disk full"):
        rewrite_jsonl(path, keep=lambda record: record["i"] < 5)
    assert path.read_bytes() == before
    assert sorted(os.listdir(small_disk)) == ["filler", "log.jsonl"]
    filler.unlink()
    assert rewrite_jsonl(path, keep=lambda record: record["i"] < 5) == 5


# ------------------------------------------------------------------------------------------------ rewrite, atomic JSON
def test_rewrite_keeps_the_records_asked_for(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "é": "ü"}\n{"step": 3}\n{"step": 4', encoding="utf-8")
    assert rewrite_jsonl(path, keep=lambda record: record["step"] <= 2) == 1  # the torn line goes too, uncounted
    assert path.read_text(encoding="utf-8") == '{"step": 1}\n{"step": 2, "é": "ü"}\n'  # kept lines byte for byte
    assert os.listdir(tmp_path) == ["log.jsonl"]
    assert append_jsonl(path, [{"step": 3}]) == 2
    assert rewrite_jsonl(path, keep=lambda record: True) == 0
    assert rewrite_jsonl(path, keep=lambda record: False) == 3
    assert path.read_text(encoding="utf-8") == ""
    assert rewrite_jsonl(tmp_path / "missing.jsonl", keep=lambda record: False) == 0
    assert not (tmp_path / "missing.jsonl").exists()


def test_write_json_atomic(tmp_path):
    path = tmp_path / "file.json"
    assert write_json_atomic(path, {"a": Path("x")}) == path
    assert json.loads(path.read_text(encoding="utf-8")) == {"a": "x"}
    os.chmod(path, 0o640)
    write_json_atomic(path, '{"b": 1}\n')
    assert path.read_text(encoding="utf-8") == '{"b": 1}\n' and (path.stat().st_mode & 0o777) == 0o640
    with pytest.raises(FileNotFoundError, match="missing"):
        write_json_atomic(tmp_path / "missing" / "file.json", {})
    assert os.listdir(tmp_path) == ["file.json"]


# ------------------------------------------------------------------------------------------------ threads
def test_threads_appending_through_audit_logs(tmp_path, caplog):
    path = tmp_path / "judge_audit.jsonl"
    logs = [JudgeAuditLog(path), JudgeAuditLog(path)]  # two instances on one file: the module's lock still holds

    def writer(thread: int) -> None:
        for batch in range(25):
            logs[thread % 2].write([{"thread": thread, "batch": batch, "row": row} for row in range(3)])

    threads = [threading.Thread(target=writer, args=(thread,)) for thread in range(8)]
    with caplog.at_level(logging.WARNING, logger="trl_ext.jsonl"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    records = strict_records(path)
    assert len(records) == 8 * 25 * 3 == len({(r["thread"], r["batch"], r["row"]) for r in records})
    assert not caplog.records


# ------------------------------------------------------------------------------------------------ rollout trees
class _Tree:
    def __init__(self, name: str):
        self.name = name

    def to_dict(self, processing_class) -> dict:
        return {"tree": self.name}


def _save_trees(output_dir: Path, trees: list) -> list[str]:
    """`StepwiseRLM.save_trees` as the synchronous trainer calls it at global step 3 on rank 0."""
    method = StepwiseRLM(RLMScaffoldConfig(), tokenizer=None, trees_dir=output_dir / TREES_FOLDER)
    return method.save_trees(trees, "train", 3, "rank0")


def test_save_trees_references_survive_a_torn_line(tmp_path):
    first = _save_trees(tmp_path, [_Tree("a"), _Tree("b")])
    path = tmp_path / "rlm_trees" / "train-v000003-rank0.jsonl"
    assert first == [f"{path}#0", f"{path}#1"]
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"tree": "c"')  # a write killed halfway
    second = _save_trees(tmp_path, [_Tree("d")])
    assert second == [f"{path}#2"]
    records = strict_records(path)
    assert records[int(second[0].rsplit("#", 1)[1])] == {"tree": "d"}


def test_save_trees_that_cannot_be_written_do_not_stop_training(tmp_path, caplog):
    (tmp_path / "rlm_trees").write_text("a file where the folder should be", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        references = _save_trees(tmp_path, [_Tree("a"), _Tree("b")])
    assert len(references) == 2 and all(reference.startswith("not saved: ") for reference in references)
    assert "train-v000003-rank0.jsonl" in caplog.text and "training goes on" in caplog.text
