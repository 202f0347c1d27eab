"""Llama-family decoder (Llama, Qwen2): flat token batch in, hidden states out.

Each layer: x += o_proj(attn(rope(qkv_proj(norm(x))))) ; x += down(silu(gate) * up)(norm(x)).
q/k/v and gate/up are fused at load time (one GEMM each). Qwen2 differs only by q/k/v biases.

Tensor parallel over the "tp" group (identity when it has one rank): each rank holds its query and
kv heads (workers/parallel/sharding.py: GQA groups stay whole) in qkv_proj, o_proj, the attention
and the KV cache; its slice of the MLP width in gate_up_proj / down_proj; its vocabulary rows of
the embedding and the LM head. o_proj and down_proj all-reduce (RowParallelLinear); the embedding
all-reduces; the LM head gathers the sampled rows' logits to tp rank 0.

Quantization ('int8' | 'q4', see workers/layers/quant_linear.py) swaps every projection of the
decoder layers for its quantized layer, with the same tensor-parallel shards and collectives
(workers/layers/quant_parallel.py: each rank quantizes or slices only its shard, int8 row-parallel
shards keep their full rows' scales, row-parallel splits must fall on 32-feature blocks, else a
ConfigError), so a TP gang computes what one rank computes up to float summation order. The LM
head (tied to the embedding in SmolLM2) is int8 with per-row scales in both modes (weight-only:
fp32 activations, kernels/int8_linear.py), split over the vocabulary like the float head: it is the
largest matrix (V x E = 28M weights), so leaving it fp32 would cost 113 MB per token, more than all
q4 layers together (66 MB), while int8 costs 28 MB and little quality (the quality of each
layer/head combination on SmolLM2 is in benchmarks/README.md, "Figures moved out of the code";
tests/workers/models/test_quant_model.py asserts the bounds). The embedding lookup stays fp32 (one
row per token).

Axes: T tokens in the step, E hidden, H query heads, G kv heads, D head dim, V vocab, I MLP width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kernels.linear import gemv_max_tokens
from workers.layers.activation import gated_activation
from workers.layers.attention import PagedAttention
from workers.layers.attention_metadata import AttentionMetadata
from workers.layers.linear import MergedColumnParallelLinear
from workers.layers.quant_linear import QuantLinear, QuantMergedLinear
from workers.layers.quant_parallel import QuantParallelLMHead, column_parallel, row_parallel
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from workers.models.config import ModelSpec
from workers.models.decode_stack import fused_stack
from workers.parallel.groups import get_group
from workers.parallel.sharding import attention_shard, even_shard

if TYPE_CHECKING:
    from workers.lora.stacks import LoraStacks
    from workers.lora.targets import LoraTargets

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V each [S, G, D]


class LlamaAttention(nn.Module):
    """Also the attention of the variants ModelSpec describes: per-head q/k RMSNorm before RoPE
    (Qwen3, Gemma 3), a sliding window on ``spec.sliding_layers``, logit soft-capping and a custom
    softmax scale (Gemma 2)."""

    def __init__(self, spec: ModelSpec, quant: str, layer_idx: int = 0) -> None:
        super().__init__()
        tp = get_group("tp")
        d = spec.head_dim
        heads = attention_shard(spec.num_heads, spec.num_kv_heads, tp.world_size, tp.rank)
        h, g = heads.q_heads.size, heads.kv_heads.size  # this rank's heads
        self.h, self.g, self.d = h, g, d
        self.layer_idx = layer_idx
        self.lora: LoraStacks | None = None  # LoRA adapters' slots (LlamaForCausalLM.attach_lora)
        o_bias = spec.attention_bias and spec.model_type not in ("qwen2", "qwen2_moe")
        q, kv = heads.q_heads.scaled(d), heads.kv_heads.scaled(d)  # this rank's rows of q_proj, of k/v_proj
        self.qkv_proj = column_parallel(spec.hidden_size, {"q": q, "k": kv, "v": kv}, spec.attention_bias, quant)
        self.o_proj = row_parallel(spec.num_heads * d, spec.hidden_size, o_bias, quant, shard=q)
        window = spec.sliding_window if layer_idx in spec.sliding_layers else None
        self.attn = PagedAttention(h, g, d, scale=spec.attn_scale, window=window, softcap=spec.attn_logit_softcap)
        if spec.qk_norm:  # one RMSNorm over each head's D features, shared by all heads
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_offset)

    def forward(self, x, cos, sin, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2G) D]
        if self.lora is not None:
            self.lora.apply(self.layer_idx, "qkv", x, qkv)
        qkv = qkv.view(t, self.h + 2 * self.g, self.d)  # [T, H + 2G, D]
        q, k, v = qkv.split([self.h, self.g, self.g], dim=1)  # views: [T, H, D], [T, G, D], [T, G, D]
        if hasattr(self, "q_norm"):
            q = self.q_norm(q.reshape(t * self.h, self.d))[0].view(t, self.h, self.d)
            k = self.k_norm(k.reshape(t * self.g, self.d))[0].view(t, self.g, self.d)
        o = self.attn(q, k, v, cos, sin, kv[0], kv[1], meta)  # [T, H D]
        if self.lora is None:
            return self.o_proj(o)
        return self.lora.apply(self.layer_idx, "o", o, self.o_proj(o))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None, quant: str = "none") -> None:
        super().__init__()
        tp = get_group("tp")
        width = intermediate_size or spec.intermediate_size
        i = even_shard(width, tp.world_size, tp.rank)  # this rank's slice of the MLP width
        self.gate_up_proj = column_parallel(spec.hidden_size, {"gate": i, "up": i}, spec.mlp_bias, quant)
        self.down_proj = row_parallel(width, spec.hidden_size, spec.mlp_bias, quant, shard=i)
        self.act = gated_activation(spec.hidden_act)
        self.layer_idx = -1  # set with lora (LlamaForCausalLM.attach_lora)
        self.lora: LoraStacks | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.down_proj(self.act(self.gate_up_proj(x)))
        gate_up = self.lora.apply(self.layer_idx, "gate_up", x, self.gate_up_proj(x))  # [T, 2 I]
        h = self.act(gate_up)  # [T, I]
        return self.lora.apply(self.layer_idx, "down", h, self.down_proj(h))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, mlp: nn.Module, quant: str = "none", layer_idx: int = 0,
                 attn: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = attn if attn is not None else LlamaAttention(spec, quant, layer_idx)  # MLA: its own
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp  # LlamaMLP, or a sparse MoE (workers/models/mixtral.py)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos, sin, kv: KVCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: this layer's input delta, residual: the stream so far (None at layer 0).
        Returns (output delta, residual stream); the next norm adds them (fused add + norm)."""
        if residual is None:
            x, _ = self.input_layernorm(h)
            residual = h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, cos, sin, kv, meta)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


# The classes the fused C++ decode stack reproduces exactly (workers/models/decode_stack.py).
FUSED_STACK_TYPES = (LlamaDecoderLayer, LlamaMLP, LlamaAttention)


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, make_layer: Callable[[ModelSpec, int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(make_layer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    _fused = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"),
        ".up_proj.": (".gate_up_proj.", "up"),
    }

    def __init__(self, spec: ModelSpec, quantization: str = "none") -> None:
        super().__init__()
        self.spec = spec
        self.quantization = quantization
        self.model = LlamaModel(spec, self.make_layer)
        if quantization == "none":
            tied = self.model.embed_tokens if spec.tie_word_embeddings else None
            self.lm_head: nn.Module = ParallelLMHead(spec.vocab_size, spec.hidden_size, tied)
        else:  # int8 (module doc); tied: a separate int8 copy of the embedding's rows, filled after loading
            self.lm_head = QuantParallelLMHead(spec.vocab_size, spec.hidden_size)
        self.num_local_kv_heads = self.model.layers[0].self_attn.g  # type: ignore[union-attr]  # KV cache width of this rank
        self._stack: Any = None  # fused decode stack (workers/models/decode_stack.py), built on first use
        self.fused_decode = True  # EngineConfig.fused_decode; reset _stack to None after changing it
        # its bf16 linear layers hold oneDNN-packed weights (EngineConfig.prepack_weights): a decode
        # step with more rows than the GEMV takes runs them through the module path, which uses them
        self.prepacked = False
        self.lora: LoraStacks | None = None  # LoRA adapters' slots (attach_lora), None without LoRA

    def lora_targets(self) -> LoraTargets:
        """The projections a LoRA adapter may target, per layer (workers/lora/targets.py): the
        attention and dense MLP of every layer built from LlamaAttention / LlamaMLP; MoE experts,
        MLA attention and other classes take none."""
        from workers.lora.targets import projection_shape

        targets: LoraTargets = {}
        for i, layer in enumerate(self.model.layers):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            found = {}
            if isinstance(attn, LlamaAttention):
                found["qkv"] = projection_shape(attn.qkv_proj, "qkv")
                found["o"] = projection_shape(attn.o_proj, "o")
            if isinstance(mlp, LlamaMLP):
                found["gate_up"] = projection_shape(mlp.gate_up_proj, "gate_up")
                found["down"] = projection_shape(mlp.down_proj, "down")
            if found:
                targets[i] = found
        return targets

    def attach_lora(self, stacks: LoraStacks) -> None:
        """Let the layers of ``lora_targets`` apply the adapters in ``stacks`` (once, before serving)."""
        assert self.lora is None, "LoRA is attached once"
        self.lora = stacks
        for i, layer in enumerate(self.model.layers):
            for part in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
                if isinstance(part, (LlamaAttention, LlamaMLP)):
                    part.layer_idx, part.lora = i, stacks

    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        return LlamaMLP(spec, quant=self.quantization)

    def make_layer(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        return LlamaDecoderLayer(spec, self.make_mlp(spec, layer_idx), self.quantization, layer_idx)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E]
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.lookup(positions, h.dtype)  # [T, D/2] each
        # decode-only step: the fused stack if eligible (it computes the bf16 projections on the plain
        # weights, so a batch that the packed ones serve faster keeps the module path: the same results),
        # and no token of the step runs a LoRA adapter (the stack applies none: the module path does)
        if meta.num_decodes == h.shape[0] > 0 and not meta.ring and not (
                self.prepacked and h.shape[0] > gemv_max_tokens(h.dtype)) and not (
                self.lora is not None and self.lora.active):
            if self._stack is None:
                self._stack = fused_stack(self, FUSED_STACK_TYPES) or False
            if self._stack:
                return self._stack.forward(h, cos, sin, kv_caches, meta.slot_mapping, meta.decode_block_tables,
                                           meta.decode_context_lens, meta.block_size)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, cos, sin, kv, meta)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, E] -> logits [N, V] (only rows that are sampled); None on tp ranks > 0.
        Collective over the tp group when it has several ranks."""
        return self.lm_head(hidden)

    def process_weights_after_loading(self) -> None:
        """Quantize the tied LM head from the loaded embedding (a no-op without quantization)."""
        if self.spec.tie_word_embeddings and isinstance(self.lm_head, QuantParallelLMHead):
            self.lm_head.load_tied(self.model.embed_tokens)

    def _quant_layers(self) -> dict[str, QuantLinear]:
        """checkpoint weight name -> quantized layer that loads it (the tied head loads from the embedding)."""
        tied = self.spec.tie_word_embeddings
        return {f"{n}.weight": m for n, m in self.named_modules()
                if isinstance(m, QuantLinear) and not (tied and n == "lm_head")}

    def expected_weights(self) -> set[tuple[str, str | None]]:
        """(parameter name, shard id) pairs a complete checkpoint fills."""
        keys: set[tuple[str, str | None]] = {(n, s) for n, m in self._quant_layers().items() for s in m.shard_ids()}
        for mod_name, mod in self.named_modules():
            for p_name, _ in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                shards = mod.offsets if isinstance(mod, (MergedColumnParallelLinear, QuantMergedLinear)) else {None: None}
                keys.update((full, s) for s in shards)
        return keys

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, str | None]]:
        """Copy checkpoint tensors into parameters; returns the (name, shard) pairs filled."""
        params = dict(self.named_parameters())
        quant = self._quant_layers()
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            shard = None
            for frag, (fused, shard_id) in self._fused.items():
                if frag in name:
                    name, shard = name.replace(frag, fused), shard_id
                    break
            if name in quant:
                quant[name].load_weight(tensor, shard)
                loaded.add((name, shard))
                continue
            param = params.get(name)
            if param is None:
                raise KeyError(name)
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                assert shard is None and param.shape == tensor.shape, (name, param.shape, tensor.shape)
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)
            loaded.add((name, shard))
        return loaded
