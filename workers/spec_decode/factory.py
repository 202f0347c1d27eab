"""Build the proposer a deployment's ``SpeculativeConfig`` names (the engine calls this once)."""

from __future__ import annotations

from workers.config import EngineConfig, SpeculativeConfig
from workers.engine.proposer import Proposer


def make_proposer(spec: SpeculativeConfig, engine: EngineConfig, vocab_size: int) -> Proposer:
    """vocab_size: the target's logits width (drafts must be ids the target scores)."""
    if spec.method == "ngram":
        from workers.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method == "draft_model":
        from workers.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer.from_config(spec, engine, vocab_size)
    raise AssertionError(f"no proposer for method {spec.method!r} (validated by SpeculativeConfig)")
