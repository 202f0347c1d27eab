"""Speculative decoding: proposers draft tokens, the target verifies them in its own batch.

proposer.py          the Proposer protocol and the Draft message
ngram.py             prompt lookup (no model)
draft_model.py       a small LM in its own Ray actor (drafter.py holds its engine, drafter_service.py
                     its gRPC service, drafter_actor.py the actor shell), with overlap and
                     degradation on timeouts
rejection_sampler.py greedy and rejection-sampling verification (lossless)
adaptive.py          per-request draft length from acceptance rate and measured costs
speculator.py        what the engine calls: draft for the running decodes, record the outcome
"""
