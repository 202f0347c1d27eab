"""Speculative decoding's proposers: they draft tokens, the target verifies them in its own batch.

    ngram.py             prompt lookup (no model)
    draft_model.py       a small LM on drafter replicas (the worker's private drafter actor, or the
                         replica of a drafter pool each request names), one stream per replica
                         (drafter_link.py), with overlap and degradation on faults
    drafter.py           a replica's continuous-batching draft engine (per-request KV, eviction, expiry)
    drafter_service.py   its gRPC service: one scheduler thread batching every target's rounds
    drafter_actor.py     the Ray actor shell (a drafter pool's replica, or a private drafter)
    draft_vocab.py       a drafter's pruned vocabulary head
    tokenizers.py        whether a drafter's tokenizer can serve a target (duet serve's preflight)
    factory.py           the proposer a SpeculativeConfig names

The engine's side (the Proposer protocol, the speculator, adaptive depth) is in workers/engine/; the
lossless verification is workers/sample/rejection_sampler.py.
"""
