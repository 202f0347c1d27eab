"""A .gguf file alone is a model name: the embedded SmolLM2 GGUF, served from its path (config and
tokenizer from the GGUF metadata, converted once into the cache), gives the same greedy tokens as
the prepared checkpoint.
A truncated GGUF fails with a message naming the file and what to do."""

from __future__ import annotations

import pytest

from workers.errors import CheckpointError
from workers.models.assets import _find_smollm2_gguf, gguf_source, prepare_gguf_file
from workers.sampling_params import SamplingParams

PROMPT = [1, 504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    gguf = _find_smollm2_gguf()
    return gguf, prepare_gguf_file(gguf, tmp_path_factory.mktemp("cache"))


def test_gguf_path_equals_the_prepared_checkpoint(converted, smollm2_path):
    from workers.llm import LLM

    gguf, path = converted
    assert path.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and gguf_source(path) == gguf
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = LLM(str(path), kv_cache_memory_bytes=16 << 20).generate([PROMPT], params)[0].token_ids
    ref = LLM(str(smollm2_path), kv_cache_memory_bytes=16 << 20).generate([PROMPT], params)[0].token_ids
    assert ours == ref


def test_truncated_gguf_names_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(_find_smollm2_gguf().read_bytes()[: 1 << 20])
    with pytest.raises(CheckpointError, match=r"broken.gguf.*cannot be read.*truncated.*re-download"):
        prepare_gguf_file(bad, tmp_path / "cache")
