"""The KV cache's allocation (workers/engine/model_runner.py ``zeroed``): on the CPU an anonymous private
memory map that is all zeros like ``torch.zeros``, costs no resident memory until blocks are
written (a start or a standby's promotion pays nothing up front), and reads back what is written;
committing it all in the background does not stall the worker's other threads."""

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


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="resident memory is read from Linux's /proc")
def test_populate_leaves_the_gil_to_the_caller_while_it_commits():
    """The populating thread commits the pages with the GIL released, so this thread keeps running
    Python (counting polls of its resident size) while the kernel works. With the GIL held throughout
    (``mmap.madvise``) the count is 0: this thread gets the GIL back only once the map is all
    resident. Only the order of events is asserted, no timing."""
    import time

    before = _rss()
    t = zeroed((16, 2, 4096, 4, 128), torch.float32, torch.device("cpu"), populate=True)  # 256 MiB
    polls, deadline = 0, time.monotonic() + 60
    while _rss() - before < 250 << 20 and time.monotonic() < deadline:
        polls += 1
    assert _rss() - before >= 250 << 20  # all of it committed, in the background
    assert polls > 0  # this thread ran Python while that happened
    assert torch.equal(t[::5], torch.zeros_like(t[::5]))


def _thp_mode() -> str | None:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not p.exists():
        return None
    text = p.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _smaps_field(address: int, field: str) -> int | None:
    """A field of the /proc/self/smaps entry of the mapping that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                for entry in lines[i + 1:]:
                    if entry.startswith(field + ":"):
                        return int(entry.split()[1])
                return None
    return None


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are off (or not Linux): the advice has nothing to do")
def test_huge_pages_map_is_eligible_for_transparent_huge_pages_and_equals_torch_zeros():
    plain = zeroed((4, 2, 1024, 4, 128), torch.float32, torch.device("cpu"))  # 16 MiB
    huge = zeroed((4, 2, 1024, 4, 128), torch.float32, torch.device("cpu"), huge_pages=True)
    if _thp_mode() == "madvise":  # 'always' makes every map eligible, advised or not
        assert _smaps_field(plain.data_ptr(), "THPeligible") == 0
    assert _smaps_field(huge.data_ptr(), "THPeligible") == 1
    assert torch.equal(huge, torch.zeros_like(huge))
    huge[1, 0, 7].fill_(5.0)
    want = torch.zeros_like(huge)
    want[1, 0, 7] = 5.0
    assert torch.equal(huge, want)


def test_engine_generates_the_same_tokens_with_and_without_memory_tuning(smollm2_path):
    """memory_tuning changes how the KV cache is paged, never what is in it: the same greedy tokens
    for a small batch, fp32 and q4, as the engine with the system's paging."""
    from workers.build import build_engine
    from workers.config import CacheConfig, EngineConfig
    from workers.sampling_params import SamplingParams

    prompts = [[1, 504, 3458, 282, 4114, 314] * k for k in (1, 3, 5)]
    for quantization in ("none", "q4"):
        outs = []
        for tuning in (False, True):
            engine = build_engine(EngineConfig(model=str(smollm2_path), quantization=quantization, memory_tuning=tuning,
                                               cache=CacheConfig(kv_cache_memory_bytes=64 << 20)))
            assert (_smaps_field(engine.runner.kv_cache.data_ptr(), "THPeligible") == 1) is (
                tuning or _thp_mode() == "always") or _thp_mode() not in ("madvise", "always")
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            got: dict[str, list[int]] = {}
            while engine.has_unfinished():
                for o in engine.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
            outs.append(got)
        assert outs[0] == outs[1] and all(len(v) == 12 for v in outs[0].values())
