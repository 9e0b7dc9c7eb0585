"""The progress line: its numbers, the bar on a terminal, log lines elsewhere."""

import io
import logging

from kiln.ui.progress import LogLines, Progress, TerminalBar, duration, format_line, sink_for


class FakeTerminal(io.StringIO):
    """An output stream that says it is a terminal, so what is drawn can be read back."""

    def isatty(self) -> bool:
        return True


def test_line_shows_step_loss_throughput_lr_and_eta():
    p = Progress(step=30, total=120, loss=4.56789, tokens_per_s=8202.4, lr=3e-4, mean_step_s=2.0, val=4.9)
    assert p.eta_s == 180.0  # 90 steps left at 2 s each
    line = format_line(p, width=8)
    assert line == "[##------] step 30/120 | loss 4.568 | val 4.900 | 8,202 tok/s | lr 3.00e-04 | eta 3m00s"
    assert format_line(Progress(1, 120, 7.6, 161.0, 1e-4, 0.0)).endswith("| eta --")  # start-up is no rate
    assert duration(9.4) == "9s" and duration(245) == "4m05s" and duration(3720) == "1h02m"


def test_bar_redraws_in_place_on_a_terminal_and_keeps_the_last_frame(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # a terminal of unknown width: 120 columns
    term = FakeTerminal()
    bar = sink_for(term, every=10)
    assert isinstance(bar, TerminalBar)
    bar.min_interval_s = 0.0
    for step in range(1, 6):
        bar.update(Progress(step, 5, 5.0 - step / 10, 1000.0, 1e-3, 0.5))
    bar.close()
    out = term.getvalue()
    frames = out.split("\r\x1b[K")[1:]
    assert len(frames) == 5 and frames[0].startswith("[") and "step 1/5" in frames[0]
    assert frames[-1].startswith("[########################] step 5/5 | loss 4.500") and frames[-1].endswith("eta 0s\n")


def test_bar_fits_the_width_of_its_own_terminal(monkeypatch):
    """$COLUMNS first, then the size of the terminal the bar is drawn on (stderr's, not
    stdout's: `kiln train > log` still draws on the terminal's own width)."""
    import os
    import pty

    line = format_line(Progress(5, 5, 4.5, 1000.0, 1e-3, 0.5))
    monkeypatch.setenv("COLUMNS", "40")
    term = FakeTerminal()
    TerminalBar(term).draw(line, force=True)
    assert term.getvalue() == "\r\x1b[K" + line[:39]
    monkeypatch.delenv("COLUMNS")
    master, slave = pty.openpty()
    try:
        os.set_blocking(master, False)
        with open(slave, "w", closefd=False) as tty:
            _set_width(slave, 50)
            TerminalBar(tty).draw(line, force=True)
        assert os.read(master, 4096).decode().endswith(line[:49])
    finally:
        os.close(master)
        os.close(slave)


def _set_width(fd: int, columns: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))


def test_bar_throttles_but_always_draws_the_last_step():
    term = FakeTerminal()
    bar = TerminalBar(term, min_interval_s=3600)
    for step in range(1, 11):
        bar.update(Progress(step, 10, 1.0, 1.0, 1e-3, 0.1))
    assert term.getvalue().count("\r\x1b[K") == 2  # the first step, then the last
    assert "step 10/10" in term.getvalue()


def test_off_a_terminal_it_logs_every_n_steps(caplog, monkeypatch):
    assert isinstance(sink_for(io.StringIO(), every=10), LogLines)  # a pipe, a file, CI
    monkeypatch.setenv("TERM", "dumb")
    assert isinstance(sink_for(FakeTerminal(), every=10), LogLines)
    lines = LogLines(every=10)
    with caplog.at_level(logging.INFO, logger="kiln.console"):
        for step in range(1, 26):
            lines.update(Progress(step, 25, 1.0, 1.0, 1e-3, 0.1))
    logged = [r.getMessage() for r in caplog.records]
    assert [m.split(" | ")[0].split("] ")[1] for m in logged] == ["step 1/25", "step 10/25", "step 20/25", "step 25/25"]
    assert all("\x1b" not in m for m in logged)
