"""A .gguf file alone is a model name: the embedded SmolLM2 GGUF, served from its path (config and
tokenizer from the GGUF metadata, converted once into the cache), gives the same greedy tokens as
the prepared checkpoint.
A truncated GGUF fails with a message naming the file and what to do."""

from __future__ import annotations

import pytest

from workers.errors import CheckpointError
from workers.models.assets.prepare import prepare_gguf_file
from workers.models.checkpoint import find_smollm2_gguf, gguf_source
from workers.sampling_params import SamplingParams

PROMPT = [1, 504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    gguf = find_smollm2_gguf()
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
    bad.write_bytes(find_smollm2_gguf().read_bytes()[: 1 << 20])
    with pytest.raises(CheckpointError, match=r"broken.gguf.*cannot be read.*truncated.*re-download"):
        prepare_gguf_file(bad, tmp_path / "cache")


def test_fast_reader_reads_what_the_plain_reader_reads():
    # open_gguf's reader slices an ndarray view of the memory map instead of the np.memmap itself
    import numpy as np
    from gguf import GGUFReader

    from workers.models.gguf_weights import open_gguf

    path = find_smollm2_gguf()
    fast, plain = open_gguf(path), GGUFReader(str(path))
    assert list(fast.fields) == list(plain.fields) and fast.data_offset == plain.data_offset
    for key, field in plain.fields.items():
        got = fast.fields[key]
        assert got.types == field.types and got.data == field.data, key
        assert all(np.array_equal(a, b) for a, b in zip(got.parts, field.parts, strict=True)), key
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in plain.tensors]
    for a, b in zip(fast.tensors, plain.tensors, strict=True):
        assert type(a.data) is np.ndarray and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
