"""The engine: requests in, token deltas out, one ``step()`` at a time (schedule -> run -> postprocess).

    engine.py        Engine: requests, detokenizers, the step, stats; built from injected parts
    scheduler.py     token-budget scheduling: chunked prefill, decodes, preemption
    block_manager.py paged KV blocks, prefix caching by block hash
    sequence.py      one request's tokens and state
    runner.py        the Runner protocol and the boundary types (KVLayout, RunnerOutput, KVTicket ...)
    model_runner.py  the single-process Runner: batches a SchedulerOutput through the model, samples
    gang_runner.py   the Runner of a TP / EP / SP gang's leader, and what its followers run
    cuda_graphs.py   captured decode steps on CUDA
    device.py        device and dtype resolution ('auto' -> concrete) for one process
    kv_handoff.py    the engine side of P/D: export prompt KV, reserve and import on the decode side
    migration.py     the engine side of live migration: pause, snapshot, import, resume
    kv_tiers.py      the engine side of the lower KV tiers (host, disk): evicted blocks go down, prefix
                     hits and preempted requests load back; the TierStore protocol (workers/kv/tiers/)
    node_feed.py     the node's shared host tier reported as this worker's host holdings (a thread)
    proposer.py      the Proposer protocol (speculative drafts) and the Draft message
    speculator.py    what the step calls to draft and record acceptance; draft_length.py adapts depth
    grammar_gate.py  structured-output requests wait here while their grammar compiles
    loop.py          EngineLoop: the engine on its own thread, fed by an asyncio front end

The engine never downloads: it is given a checkpoint directory (workers/models/checkpoint.py).
"""
