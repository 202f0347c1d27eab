"""Progress of long model-asset steps (GGUF joins, hashing): a tqdm bar on a terminal, plain log
lines (every 10 %) otherwise, so logs of a served worker stay readable.

Example::

    with Progress(total_bytes, "joining Qwen2.5-Coder-1.5B-Instruct") as bar:
        for chunk in chunks:
            bar.update(len(chunk))
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType

logger = logging.getLogger(__name__)


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "B", tty: bool | None = None) -> None:
        self.total, self.desc, self.done, self._next_pct = max(total, 1), desc, 0, 10
        self._bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        pct = 100 * self.done // self.total
        if pct >= self._next_pct:
            logger.info("%s: %d%%", self.desc, pct)
            self._next_pct = (pct // 10 + 1) * 10

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()
