"""Sampling: from logits to tokens, exactly reproducible per request.

    sampler.py            temperature / top-k / top-p / min-p sampling from per-request generators
    penalties.py          presence, frequency and repetition penalties, logit bias, min_tokens
    logprobs.py           TokenLogprob and top-k logprobs; logprobs_proto.py its wire form
    rejection_sampler.py  lossless verification of speculative drafts (greedy and sampled)
    grammar_masks.py      structured-output token masks, computed beside the forward pass
"""
