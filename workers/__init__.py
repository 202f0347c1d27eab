"""Duet's worker side: the engine and everything one worker process runs.

Layers, lowest first (each imports only those before it; tests/test_package_graph.py checks it):

    errors.py, config.py, sampling_params.py, detokenizer.py, block_hash.py   shared types (the router
                    imports the torch-free ones: errors, block_hash, detokenizer, structured spec/convert/grammar)
    structured/     structured outputs: request spec, grammar compile, per-request matchers
    parallel/       process groups and collectives (TP / EP / SP), shared-memory transport
    layers/         model layers: linear (parallel, quantized), attention, MoE, rotary, norms
    sample/         sampling: sampler, penalties, logprobs, rejection sampler, grammar masks
    lora/           LoRA adapters: PEFT reader, the per-worker AdapterSet (LRU, pins), the stacked
                    slots the model's layers apply per step (kernels/lora.py)
    models/         one file per model family, registry and loader; checkpoint.py reads a prepared
                    checkpoint directory; assets/ turns names, Hub ids and GGUFs into one
    engine/         the engine: step = schedule -> run -> postprocess; runner protocol, model
                    runner, scheduler, block manager, KV hand-off and migration state, speculator
    kv/             moving KV blocks between processes (wire format, shm ring, gloo/NCCL) and into
                    the worker's lower tiers (host memory, local disk)
    spec_decode/    proposers: n-gram, draft model (its engine, service and actor)
    handoff/        who moves which blocks: P/D hand-off, prefix pull, migration service, drain
    build.py        assembles the default engine from its parts (runner, tokenizer, proposer)
    server/         the internal gRPC service, the engine loop's host, Ray actor shells
    llm.py          the offline batch API (``LLM(...).generate``)
"""
