"""workers/models/loader.py ``build_model`` allocates a model's parameters in the serving dtype from
the start instead of building it in fp32 and casting: for every architecture family (and a
quantized model), the loaded model is bit for bit the one the build-then-cast path gives, its
parameters, buffers and the layers' own tables (rotary's fp32 cos/sin) included, and the process's
default dtype is left as it was, also when a layer fails to build."""

from __future__ import annotations

import pytest
import torch

from tests.testkit.tiny_families import CASES
from workers.models.config import ModelSpec
from workers.models.loader import build_model, iter_safetensors
from workers.models.registry import model_class


def _loaded(model, path, dtype):
    model.load_weights(iter_safetensors(path, dtype))
    model.process_weights_after_loading()
    return model


def _tensors(model) -> dict[str, torch.Tensor]:
    out = {f"state.{k}": v for k, v in model.state_dict().items()}
    for name, mod in model.named_modules():  # plain tensor attributes (rotary's table)
        out.update({f"attr.{name}.{k}": v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("case", [*CASES, "llama-q4"])
def test_built_in_dtype_equals_built_then_cast(tiny_checkpoint, case) -> None:
    arch, overrides = CASES[case] if case in CASES else ("llama", {})
    quantization = "q4" if case == "llama-q4" else "none"
    path = tiny_checkpoint(arch, **overrides)
    spec = ModelSpec.from_pretrained(path)
    cls = model_class(spec)
    dtype = torch.bfloat16
    with torch.device("cpu"):
        before = _loaded(cls(spec, quantization).to(dtype), path, dtype)  # the former path
    now = _loaded(build_model(cls, spec, quantization, dtype, "cpu"), path, dtype)
    assert torch.get_default_dtype() is torch.float32
    a, b = _tensors(before), _tensors(now)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_default_dtype_restored_when_the_build_fails(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    spec = ModelSpec.from_pretrained(path)

    class Broken(model_class(spec)):  # type: ignore[misc, valid-type]
        def __init__(self, spec, quantization):
            super().__init__(spec, quantization)
            raise RuntimeError("a layer failed")

    with pytest.raises(RuntimeError, match="a layer failed"):
        build_model(Broken, spec, "none", torch.bfloat16, "cpu")
    assert torch.get_default_dtype() is torch.float32
