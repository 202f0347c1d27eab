"""The engine with LoRA: prefix caching keyed by adapter, the block events routers read, and no
leak of KV blocks or adapter references when requests end early (abort, failed admission)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.block_hash import adapter_root, chain_hashes
from workers.config import LoraConfig
from workers.engine.kv_handoff import KVCapacityError
from workers.errors import InvalidRequestError
from workers.llm import LLM
from workers.lora.errors import AdapterNotLoaded, LoraDisabled
from workers.sampling_params import SamplingParams

BS = 8
PROMPT = list(range(300, 340))  # 5 full blocks
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def llm(tiny_llama: Path, tiny_adapters: dict[str, Path]) -> LLM:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64, block_size=BS,
              lora=LoraConfig(enabled=True, max_loaded=2, max_rank=16))
    llm.load_adapter("a", str(tiny_adapters["all8"]))
    llm.load_adapter("b", str(tiny_adapters["qv4"]))
    return llm


def _cached(llm: LLM, adapter: str) -> int:
    [out] = llm.generate([PROMPT], GREEDY, adapters=adapter)
    return out.num_cached_tokens


def test_an_adapter_and_the_base_never_share_a_prefix_hit(llm: LLM) -> None:
    assert _cached(llm, "") == 0
    assert _cached(llm, "a") == 0  # same prompt, the base's blocks are not reused
    assert _cached(llm, "b") == 0  # nor adapter a's under adapter b
    assert _cached(llm, "a") == 32  # its own blocks are (4 blocks: the last prompt token is recomputed)
    assert _cached(llm, "") == 32


def test_block_events_carry_the_adapters_chain(llm: LLM) -> None:
    events = llm.engine.block_manager.events
    cursor = events.read(0).seq
    llm.generate([PROMPT], GREEDY, adapters="a")
    stored = set(events.read(cursor).stored)
    want = chain_hashes(PROMPT, BS, root=adapter_root("a"))
    assert set(want[:4]) <= stored and not set(chain_hashes(PROMPT, BS)) & stored


def test_abort_and_failed_admission_leak_nothing(llm: LLM) -> None:
    engine, adapters = llm.engine, llm.engine.adapters
    free = engine.block_manager.num_free_blocks
    engine.add_request("r1", PROMPT, GREEDY, adapter="a")
    engine.step()  # prefilled: holds blocks and the adapter
    assert adapters.in_use("a") == 1
    engine.abort("r1")
    assert adapters.in_use("a") == 0 and engine.block_manager.num_free_blocks == free
    with pytest.raises(InvalidRequestError):  # fails after the adapter was acquired: given back
        engine.add_request("r2", PROMPT, SamplingParams(structured=None, max_tokens=1), adapter="a",
                           export_from_block=99)
    assert adapters.in_use("a") == 0
    with pytest.raises(AdapterNotLoaded, match="adapter 'zzz' is not loaded"):
        engine.add_request("r3", PROMPT, GREEDY, adapter="zzz")
    # the reservation path (disaggregated decode side): a full pool refuses, the adapter is given back
    engine.reserve("r4", list(range(1000, 1000 + 40 * BS)), GREEDY, adapter="b")
    assert adapters.in_use("b") == 1
    with pytest.raises(KVCapacityError):
        engine.reserve("r5", list(range(2000, 2000 + 40 * BS)), GREEDY, adapter="b")
    assert adapters.in_use("b") == 1
    engine.abort("r4")
    assert adapters.in_use("b") == 0 and engine.block_manager.num_free_blocks == free
    assert not engine.has_unfinished()


def test_an_adapter_on_an_engine_without_lora_is_refused(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=16, block_size=BS)
    with pytest.raises(LoraDisabled, match="adapter 'a': this worker runs without LoRA"):
        llm.generate([PROMPT], GREEDY, adapters="a")
    assert llm.engine.runner.adapters is None and llm.engine.runner.model.lora is None


def test_lower_tier_digests_follow_the_adapter() -> None:
    """A block evicted to the host / disk tier is named by its key's digest (kv_tiers.key_digest) and
    found again by the digests of a new request's prompt (KVTiers.digests): both start from the
    adapter's root, so they agree under one adapter and differ across adapters and the base."""
    from workers.engine.block_manager import root_key
    from workers.engine.kv_tiers import KVTiers, key_digest
    from workers.engine.sequence import Sequence

    tiers = KVTiers.__new__(KVTiers)  # digests() needs only the block size and its per-request cache
    tiers.block_size, tiers._digests = BS, {}
    blocks = [tuple(PROMPT[i * BS:(i + 1) * BS]) for i in range(2)]
    got = {}
    for adapter in ("", "a", "b"):
        key = (root_key(adapter), blocks[0])
        key = (key, blocks[1])
        seq = Sequence(f"r-{adapter}", PROMPT, GREEDY, 0, adapter=adapter)
        got[adapter] = tiers.digests(seq, 2)
        assert key_digest(key) == got[adapter][1]
    assert len({d for ds in got.values() for d in ds}) == 6
