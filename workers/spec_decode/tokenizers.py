"""Whether a drafter's tokenizer can serve a target: its drafts are token ids, which must mean the
same text to both models (speculation verifies ids, not text).

The rule: every id both vocabularies have maps to the same token (added tokens included); the
drafter may know fewer ids (it just never drafts the others) or more (the target's vocabulary size
bounds the drafts). Read from each checkpoint's tokenizer files with transformers' AutoTokenizer, so
any format it loads is compared the same way.

Example: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B -> None (identical tokenizers); SmolLM2
drafting for Qwen2.5 -> "id 0 is '<|endoftext|>' in the target's tokenizer and ..." (refused).
"""

from __future__ import annotations

from pathlib import Path


def _id_to_token(path: Path) -> dict[int, str]:
    from transformers import AutoTokenizer  # deferred: slow to import

    vocab = AutoTokenizer.from_pretrained(path).get_vocab()  # token -> id, added tokens included
    return {i: t for t, i in vocab.items()}


def tokenizer_mismatch(target_dir: Path, draft_dir: Path) -> str | None:
    """Why the drafter's ids do not mean the target's (the first id that differs), or None."""
    if Path(target_dir).resolve() == Path(draft_dir).resolve():
        return None
    target, draft = _id_to_token(target_dir), _id_to_token(draft_dir)
    for i in sorted(set(target) & set(draft)):
        if target[i] != draft[i]:
            return f"id {i} is {target[i]!r} in the target's tokenizer and {draft[i]!r} in the drafter's"
    if not set(target) & set(draft):
        return "the two tokenizers share no token id"
    return None
