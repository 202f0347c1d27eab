"""Build a model from a local HF checkpoint directory (config.json + *.safetensors).

Tensors are read lazily with safetensors (memory-mapped), cast to the engine dtype and copied into
the model's own (fused) parameters through each parameter's weight loader.

Quantization ('int8' | 'q4'): the quantized layers quantize the float tensors as they load. A
checkpoint prepared from a GGUF (the embedded SmolLM2, a user's .gguf file) loads from that GGUF
instead, its Q4_0 / Q4_1 / Q4_K tensors kept as codes for 'q4' and its Q8_0 ones for 'int8'
(workers/models/gguf_weights.py, gguf_quants.py): the model is then the GGUF's, not a
re-quantization of its de-quantized copy.

Weights shared per node (``shared``, workers/models/shared_weights.py): the loaded and processed
tensors are written once per node to a snapshot file that every later worker maps instead of
loading (the load below runs only on a miss); the node then holds one copy of the weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from workers.errors import CheckpointError
from kernels.cpu_features import features
from workers.layers.linear import Linear
from workers.layers.quant_linear import BF16_COPY_MIN_ROWS, QuantLinear, StepRows
from workers.layers.vocab_parallel import ParallelLMHead
from workers.models.checkpoint import gguf_source
from workers.models.config import ModelSpec
from workers.models.gguf_weights import has_native_tensors, iter_gguf
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import check_spec, model_class
from workers.models.shared_weights import SharedWeights, files_fingerprint
from workers.parallel.groups import get_group

logger = logging.getLogger(__name__)


def iter_safetensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights; re-prepare or re-download the checkpoint")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name).to(dtype)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises several types for bad files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e}); re-prepare the checkpoint") from e


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cls: type[LlamaForCausalLM], spec: ModelSpec, quantization: str, dtype: torch.dtype,
                device: str) -> LlamaForCausalLM:
    """The model's modules on ``device``, their parameters allocated in ``dtype`` from the start (values
    as each layer initialises them, before any weights load). Built in fp32 and cast afterwards, a
    1.5B model allocated 6 GB of fp32 parameters only to read them back into 3 GB of bf16 copies
    (seconds of page faults and conversion in every start, a shared one's too); the layers' own
    fp32 tables (rotary) name their dtype, and the cast after construction still converts any other
    floating buffer, as before."""
    with torch.device(device), _default_dtype(dtype):
        model = cls(spec, quantization)
    return model.to(dtype)


def load_model(
    path: Path, dtype: torch.dtype, device: str = "cpu", quantization: str = "none", use_gguf: bool = True,
    fused_decode: bool = True, shared: SharedWeights | None = None, spec: ModelSpec | None = None,
    prepack_weights: bool = True, quantized_batches: str = "kernel",
) -> tuple[LlamaForCausalLM, ModelSpec]:
    """The model of checkpoint ``path``; ``use_gguf=False`` makes 'q4' quantize the safetensors even when a GGUF source exists (tests
    compare the two). fused_decode: False keeps a Llama-family model's decode steps off the fused
    decoder stack (workers/models/decode_stack.py). shared: the node's shared snapshots (None: load
    a private copy); ``shared.last_source`` then says where the tensors came from. spec: the
    checkpoint's ModelSpec when the caller has read it already. prepack_weights: bf16 linear layers
    and LM head on the CPU keep oneDNN's blocked copy of their weights for batches past the GEMV's
    (kernels.linear.prepack; a second copy of those weights in memory). quantized_batches:
    EngineConfig.quantized_batches ('auto' resolved here from the CPU's features)."""
    t0 = time.perf_counter()
    spec = spec or ModelSpec.from_pretrained(path)
    tp, sp, ep = get_group("tp"), get_group("sp"), get_group("ep")
    check_spec(spec, str(path), tp_size=tp.world_size, sp_size=sp.world_size, ep_size=ep.world_size,
               quantization=quantization)
    model = build_model(model_class(spec), spec, quantization, dtype, device)
    gguf = gguf_source(path) if quantization != "none" and use_gguf else None
    if gguf is not None and quantization == "int8" and not has_native_tensors(gguf, "int8"):
        gguf = None  # no Q8_0 linear weights: the safetensors (the same de-quantized values) load faster

    def load() -> None:
        weights = iter_gguf(gguf, spec, quantization) if gguf is not None else iter_safetensors(path, dtype)
        try:
            loaded = model.load_weights(weights)  # type: ignore[arg-type]  # GGUF QuantizedWeights go to quantized layers
        except KeyError as e:
            raise CheckpointError(f"{path}: unexpected tensor {e.args[0]!r} for model_type {spec.model_type!r}") from None
        missing = model.expected_weights() - loaded
        if missing:
            names = sorted(f"{n}[{s}]" if s else n for n, s in missing)[:5]
            raise CheckpointError(f"{path}: checkpoint is missing {len(missing)} tensors, e.g. {names}")
        model.process_weights_after_loading()

    if shared is None:
        load()
        source = "checkpoint"
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        key = {"files": files_fingerprint(files + ([gguf] if gguf is not None else [])), "dtype": str(dtype),
               "quantization": quantization, "gguf": gguf is not None, "device": torch.device(device).type,
               "ranks": [(g.rank, g.world_size) for g in (tp, sp, ep)]}
        source = shared.load(model, key, load)
    model.eval()
    if hasattr(model, "fused_decode"):  # the Llama family (decode_stack.py covers only its layers)
        model.fused_decode = fused_decode
    if quantization != "none" and torch.device(device).type == "cpu" and (
            quantized_batches == "bf16" or (quantized_batches == "auto" and features().amx)):
        step_rows = StepRows()  # the runner sets its decode rows each step (ModelRunner.forward)
        copies = sum(m.make_bf16_copy(step_rows) for m in model.modules() if isinstance(m, QuantLinear))
        setattr(model, "step_rows", step_rows)  # noqa: B010 - any model class; ModelRunner reads it
        logger.info("%d quantized layers keep a bf16 copy for batches of more than %d rows", copies,
                    BF16_COPY_MIN_ROWS)
    if quantization != "none" and torch.device(device).type == "cpu":
        tiled = sum(m.make_tiles() for m in model.modules() if isinstance(m, QuantLinear))
        if tiled:
            logger.info("%d quantized layers keep their weights in the VNNI kernel's tile order too", tiled)
    if prepack_weights:
        packed = sum(m.prepack() for m in model.modules() if isinstance(m, (Linear, ParallelLMHead)))
        if packed and hasattr(model, "prepacked"):
            model.prepacked = True  # its decode steps past the GEMV's rows leave the fused stack for them
    logger.info("loaded %s (%s, %d layers, quantization %s%s; %s) in %.1fs", path, spec.model_type, spec.num_layers,
                quantization, f" from {gguf.name}" if gguf else "", source, time.perf_counter() - t0)
    return model, spec
