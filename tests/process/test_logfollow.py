"""The engine's log followed into supervise's stderr (the journal under systemd): new lines only, a file
replaced at the same path read from its start, a line written in two pieces printed once."""
import io

from restartkit.process.logfollow import LogFollower, wanted
from tests.helpers import wait_for


def test_new_lines_are_copied_and_a_replaced_file_is_read_from_its_start(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("old line\n")
    out = io.StringIO()
    f = LogFollower(log, out=out).start()
    try:
        with open(log, "a") as w:
            w.write("first\nsec")
            w.flush()
            wait_for(lambda: "engine: first\n" in out.getvalue(), timeout=10)
            w.write("ond\n")
        wait_for(lambda: "engine: second\n" in out.getvalue(), timeout=10)
        log.unlink()
        log.write_text("after rotation\n")
        wait_for(lambda: "engine: after rotation\n" in out.getvalue(), timeout=10)
    finally:
        f.stop()
    assert "old line" not in out.getvalue() and out.getvalue().count("engine: second\n") == 1, out.getvalue()


def test_only_under_the_journal():
    assert wanted({"JOURNAL_STREAM": "8:1234"}) and not wanted({})
