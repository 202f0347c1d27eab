"""Structured outputs (JSON schema, regex, choice, grammar): the spec, the grammar compiler and the
per-request matchers that mask the sampler's logits. See spec.py for the request-level contract."""
