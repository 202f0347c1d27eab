"""The KV cache's allocation (workers/engine/model_runner.py ``zeroed``): on the CPU an anonymous private
memory map that is all zeros like ``torch.zeros``, costs no resident memory until blocks are
written (a start or a standby's promotion pays nothing up front), and reads back what is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.engine.model_runner import zeroed


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_zeroed_equals_torch_zeros_and_holds_writes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = zeroed((2, 3, 5, 7), dtype, torch.device("cpu"))
        assert t.dtype is dtype and t.shape == (2, 3, 5, 7) and t.is_contiguous()
        assert torch.equal(t, torch.zeros(2, 3, 5, 7, dtype=dtype))
        t[1, 2].fill_(3)
        t.index_copy_(2, torch.tensor([4]), torch.ones(2, 3, 1, 7, dtype=dtype))
        want = torch.zeros(2, 3, 5, 7, dtype=dtype)
        want[1, 2] = 3
        want[:, :, 4] = 1
        assert torch.equal(t, want)
    assert zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="resident memory is read from Linux's /proc")
def test_only_written_blocks_become_resident():
    before = _rss()
    t = zeroed((8, 2, 4096, 4, 128), torch.float32, torch.device("cpu"))  # 128 MiB
    assert _rss() - before < 16 << 20  # nothing touched yet
    t[0].fill_(1.0)  # one layer: 16 MiB
    assert 12 << 20 < _rss() - before < 40 << 20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="resident memory is read from Linux's /proc")
def test_populate_commits_every_page_in_the_background_and_keeps_what_was_written():
    import time

    before = _rss()
    t = zeroed((8, 2, 4096, 4, 128), torch.float32, torch.device("cpu"), populate=True)  # 128 MiB
    t[3].fill_(2.0)  # written while the populating thread runs
    deadline = time.monotonic() + 30
    while _rss() - before < 120 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rss() - before >= 120 << 20  # all of it resident, although only one layer was written
    want = torch.zeros(8, 2, 4096, 4, 128)
    want[3] = 2.0
    assert torch.equal(t, want)
