"""Model assets: turn a model name, Hub id or GGUF file into a checkpoint directory (at the edges only).

    resolve.py   resolve_model(name_or_path) -> checkpoint directory; prepare_named
    prepare.py   convert a pinned GGUF once into a cached float32 safetensors checkpoint
    qwen.py      the optional Qwen2.5-Coder models from split GGUF part packages
    hub.py       Hugging Face Hub ids (when a hub is reachable)
    upcycle.py   a dense checkpoint upcycled into a Mixtral-style MoE (tests and benchmarks)
    progress.py  progress reporting for long joins and conversions
    __main__.py  ``python -m workers.models.assets``: prepare known models in the cache
"""
