"""Progress: plain log lines every 10 % without a terminal, a tqdm bar with one."""

from __future__ import annotations

import logging

from workers.models.assets.progress import Progress


def test_log_lines_without_a_tty(caplog):
    caplog.set_level(logging.INFO, logger="workers.models.assets.progress")
    with Progress(1000, "joining x", tty=False) as bar:
        for _ in range(40):
            bar.update(25)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"joining x: {p}%" for p in range(10, 101, 10)]


def test_tqdm_bar_on_a_tty(capsys):
    with Progress(100, "joining y", tty=True) as bar:
        bar.update(100)
    assert "joining y" in capsys.readouterr().err
