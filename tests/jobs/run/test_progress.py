"""What a run shows while it goes: bars on a terminal whose time left counts only this run's rows,
plain lines anywhere else (no carriage returns or escape sequences in a log), lines of their own
that do not break a bar."""

from __future__ import annotations

import io
import subprocess
import sys

from salabatch.jobs.run.progress import Progress
from tests.jobs.run.test_runner import write_docs, write_job


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rows_done_earlier_leave_the_bar_and_its_time_left():
    # The bar counted skipped rows as progress: 4:26 left was shown for a 32 s job.
    screen = Terminal()
    progress = Progress.to(screen, "job", 40)
    assert progress.mode == "bars"
    progress.found_done(30)
    progress.found_done(30)  # the same count again: nothing new
    assert progress.bar.total == 10 and progress.bar.n == 0
    progress.rows(4)
    assert progress.bar.n == 4 and "30 done earlier" in screen.getvalue()
    progress.close()


def test_a_log_gets_plain_lines_only():
    log = io.StringIO()
    progress = Progress.to(log, "job", 6)
    assert progress.mode == "lines"
    progress.interval = 0.0
    progress.found_done(2)
    progress.rows(1)
    with progress.tokens("decode a.txt", 8) as advance:
        advance(3)
    progress.write("error in document b.txt: empty file (0 bytes)")
    progress.close()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("job: 1/4 rows (+2 done earlier), 0:00, about 0:00 left")
    assert lines[1].endswith("; decode a.txt: 3/8 tokens")
    assert lines[2] == "error in document b.txt: empty file (0 bytes)"
    assert lines[3].startswith("job: 1/4 rows (+2 done earlier)")
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()


def test_a_line_of_its_own_does_not_break_a_bar():
    screen = Terminal()
    progress = Progress.to(screen, "job", 3)
    progress.rows(1)
    progress.write("warning: the prefix store is read-only")
    progress.close()
    # the bar is cleared first (carriage return), the line printed whole, the bar drawn again
    before, line, after = screen.getvalue().partition("warning: the prefix store is read-only\n")
    assert line and before.endswith("\r") and "job:" in after


def test_a_run_logged_to_a_file_has_no_carriage_returns_or_escapes(tmp_path, tiny_model):
    write_docs(tmp_path)
    job = write_job(tmp_path, tiny_model)
    (tmp_path / "docs" / "empty.txt").write_bytes(b"")
    result = subprocess.run(
        [sys.executable, "-m", "salabatch.cli", "run", str(job)],  # progress on, the default
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stderr
    assert "\r" not in result.stderr and "\x1b" not in result.stderr
    lines = result.stderr.splitlines()
    assert "error in document empty.txt: empty file (0 bytes)" in lines
    assert any(line.startswith("t: 12/12 rows, ") for line in lines)
