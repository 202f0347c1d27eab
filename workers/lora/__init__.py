"""LoRA adapters on a worker: read PEFT adapters, hold a bounded set of them as stacked slots, and
give the model the per-step view its layers apply (kernels/lora.py does the math).

One role per file, lowest first:

    errors.py       the typed errors (each maps to one gRPC status in workers/server/service.py)
    targets.py      which projections of which layers an adapter may target, and their shapes
    reader.py       PEFT directory -> a validated ``LoraAdapter`` (config + tensors, refusals)
    stacks.py       ``LoraStacks``: the slots' stacked A/B per layer and projection, and the step's
                    token -> slot grouping that every layer of a step reuses
    adapter_set.py  ``AdapterSet``: names -> slots, LRU over unpinned idle adapters, pins, in-use counts

The model runner owns one AdapterSet (workers/engine/model_runner.py); LlamaAttention and LlamaMLP
apply their projections' slots (workers/models/llama.py ``attach_lora``). docs/serving/lora-engine.md
explains the batching and its limits.
"""
