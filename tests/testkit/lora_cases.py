"""LoRA adapters made with PEFT for the tests, and PEFT's merged model as the reference.

``save_adapter`` wraps a checkpoint's transformers model in a PEFT LoRA of the given rank, alpha and
target modules, gives lora_A and lora_B random values (PEFT starts B at zero, which would make every
adapter the identity), and saves it as PEFT does (adapter_config.json + adapter_model.safetensors).
``merged_greedy`` is the reference: PEFT's ``merge_and_unload`` (W + scale B A folded into each
weight) run through transformers' greedy ``generate``.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base: Path, out: Path, *, seed: int, r: int = 8, alpha: float = 16,
                 targets: list[str] | None = None, rslora: bool = False, b_std: float = 0.05,
                 **extra) -> Path:
    """A random PEFT LoRA adapter for checkpoint ``base`` in ``out``; ``extra``: more LoraConfig fields."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_MODULES, use_rslora=rslora,
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **extra)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
    peft_model.save_pretrained(out)
    return out


def merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy ``n`` tokens (EOS ignored) of each prompt on ``base`` with ``adapter``
    merged in by PEFT (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            outs.append(out[0, len(prompt):].tolist())
    return outs
