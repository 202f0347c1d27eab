"""Speculative decoding's proposers: they draft tokens, the target verifies them in its own batch.

    ngram.py             prompt lookup (no model)
    draft_model.py       a small LM in its own Ray actor (drafter.py holds its engine, drafter_service.py
                         its gRPC service, drafter_actor.py the actor shell), with overlap and
                         degradation on timeouts
    draft_vocab.py       a drafter's pruned vocabulary head
    factory.py           the proposer a SpeculativeConfig names

The engine's side (the Proposer protocol, the speculator, adaptive depth) is in workers/engine/; the
lossless verification is workers/sample/rejection_sampler.py.
"""
