"""Output files (`specjax.app.output`): checked before any work without touching
anything, opened only when there is something to write, and a failed final write keeps
the result in a temporary file that the one-line error names."""
import os
import pathlib
import stat

import pytest
from clitools import read_only

from specjax.app.cli import RunError
from specjax.app.output import JsonlWriter, check_writable, save
from specjax.config import UsageError


def test_check_writable_creates_and_truncates_nothing(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("keep")
    check_writable(str(existing))
    check_writable(str(tmp_path / "new" / "deeper" / "x.json"))  # creatable: its directories do not exist yet
    assert existing.read_text() == "keep" and not (tmp_path / "new").exists()


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d, "it is a directory"),
    (lambda d: (d / "file").write_text("") or d / "file" / "x.json", "is not a directory"),
    (lambda d: "", "empty file name"),
])
def test_check_writable_refuses_what_cannot_be_written(tmp_path, make, fragment):
    with pytest.raises(UsageError, match=fragment):
        check_writable(str(make(tmp_path)), "--json")


def test_check_writable_refuses_to_overwrite_an_input(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("{}\n")
    with pytest.raises(UsageError, match="destroy the input"):
        check_writable(str(tmp_path / "." / "p.jsonl"), "--output", [str(prompts)])


def test_check_writable_tries_the_write_instead_of_reading_permission_bits(tmp_path):
    """Root passes every os.access check and a read-only place shows nothing in its bits:
    --json there passed the up-front check and failed after the run."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "old.json").write_text("kept")
    with read_only(ro):
        for path, fragment in ((ro / "new.json", "cannot create it in"), (ro / "a" / "b.json", "cannot create it in"),
                               (ro / "old.json", "exists and cannot be written")):
            with pytest.raises(UsageError, match=fragment):
                check_writable(str(path), "--json")
    assert sorted(p.name for p in ro.iterdir()) == ["old.json"] and (ro / "old.json").read_text() == "kept"


def test_jsonl_writer_opens_the_file_only_at_the_first_write(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    with JsonlWriter(str(out)):
        pass  # a run that fails before its first batch
    assert out.read_text() == "old\n"
    with JsonlWriter(str(out)) as writer:
        writer.write([{"a": 1}, {"a": 2}])
    assert out.read_text() == '{"a": 1}\n{"a": 2}\n'


def test_save_is_atomic_and_a_failed_save_keeps_the_data(tmp_path):
    out = tmp_path / "sub" / "report.json"
    save(str(out), '{"ok": 1}')
    assert out.read_text() == '{"ok": 1}' and [p.name for p in out.parent.iterdir()] == ["report.json"]
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this machine")
    with pytest.raises(RunError, match=r"--json='/dev/full': cannot write it \(No space left on device\); the "
                                       r"results are saved in (\S+) instead") as info:
        save("/dev/full", b"\x89PNG data", "--json")
    fallback = pathlib.Path(str(info.value).split("saved in ")[1].split(" instead")[0])
    assert fallback.read_bytes() == b"\x89PNG data"
    fallback.unlink()
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # written to, never replaced by a file
