"""A vocabulary-pruned LM head for the drafter (FR-Spec, Zhao et al. 2025).

A small drafter spends much of each draft token on its LM head: the 0.5B Qwen2.5 drafter's head is
151936 x 896 (136M weights, more bytes than its 4-bit body). Drafts are almost always common
tokens, so the drafter scores only the ``size`` most frequent ones: its head keeps those rows and
its drafts are always in that set (a token outside it is simply never proposed). The target still
verifies against its full vocabulary, so output stays exactly what it would be without the drafter
(greedy) or follows the same distribution (sampled: the drafter's q is 0 outside the set, which the
rejection rule handles like any other q).

Which tokens: the tokenizer's own order of frequency, read from its ``tokenizer.json``:
- BPE (Qwen2, Llama 3, SmolLM2, GPT-2 style): the merge rank. A merge learned earlier joined a pair
  that was more frequent in the tokenizer's training corpus; base tokens (bytes, and anything no
  merge produces) come first.
- Unigram (SentencePiece): the piece's log-probability score, highest first.
- Otherwise, the lowest ids.
Added tokens (chat markers, end of text) are always kept: the drafter must be able to propose the
end of an answer. Per request, the tokens of its own context outside the set are scored too
(``ContextVocab``): code repeats its identifiers, so a rare token the prompt or the target used
once can be drafted from then on. The tokens a set misses are mostly code tokens BPE merged late
('.Tensor', ' logits', '(torch'); the coverage of the Qwen2.5 tokenizer's sets on this repository's
text is in benchmarks/README.md ("Figures moved out of the code"), and spec_bench.py reports the
share of the target's own output tokens inside the set.

Axes: N rows to score, E hidden size, V full vocabulary, P pruned vocabulary (kept ids), X a
request's context ids outside the kept ones.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from kernels.quant_formats import dequantize_int8, dequantize_q4
from workers.layers.quant_linear import QuantLinear, make_linear
from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def frequency_order(model_dir: Path, vocab_size: int) -> tuple[list[int], list[int]]:
    """(added token ids, all other ids most frequent first) for the checkpoint's tokenizer; ids are
    below vocab_size. Falls back to id order without a readable tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        tj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("draft vocabulary: no tokenizer.json in %s (%s); keeping the lowest ids", model_dir, e)
        return [], list(range(vocab_size))
    try:
        added, ids = _ordered(tj, vocab_size)
    except (KeyError, TypeError, ValueError) as e:  # a tokenizer.json of another shape
        logger.warning("draft vocabulary: unreadable tokenizer.json in %s (%r); keeping the lowest ids", model_dir, e)
        return [], list(range(vocab_size))
    if ids is None:
        logger.warning("draft vocabulary: the tokenizer in %s has no frequency order; keeping the lowest ids",
                       model_dir)
        ids = list(range(vocab_size))
    seen = set(added)
    rest = [i for i in ids if i < vocab_size and i not in seen]
    return added, rest


def _ordered(tj: dict, vocab_size: int) -> tuple[list[int], list[int] | None]:
    """(added token ids, every id most frequent first or None if the model type has no order)."""
    added = sorted({t["id"] for t in tj.get("added_tokens", []) if t["id"] < vocab_size})
    model = tj.get("model", {})
    if model.get("type") == "BPE":
        vocab: dict[str, int] = model["vocab"]
        rank: dict[str, int] = {}  # token -> index of the merge that produces it; base tokens have none
        for i, merge in enumerate(model.get("merges", [])):
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            rank.setdefault(a + b, i)
        order = sorted(vocab, key=lambda t: (rank.get(t, -1), vocab[t]))  # base tokens first
        return added, [vocab[t] for t in order]
    if model.get("type") == "Unigram":
        return added, [i for _, i in sorted((-score, i) for i, (_, score) in enumerate(model["vocab"]))]
    return added, None


def draft_token_ids(model_dir: Path, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` ids the pruned head keeps (all added tokens, then the most frequent), ascending: [P]."""
    added, rest = frequency_order(model_dir, vocab_size)
    keep = added + rest[: max(0, size - len(added))]
    return torch.tensor(sorted(keep), dtype=torch.long)


def _head_rows(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The float rows [P, E] of the model's LM head for these ids (the embedding's when tied)."""
    head = model.lm_head
    if model.spec.tie_word_embeddings:
        return model.model.embed_tokens.weight.data[ids].float()
    if isinstance(head, QuantLinear):
        if head.method == "int8":
            return dequantize_int8(head.qweight[ids], head.scales[ids], head.in_features)
        return dequantize_q4(head.qweight[ids], head.scales[ids], head.mins[ids], head.in_features)
    assert isinstance(head.weight, torch.Tensor)
    return head.weight.data[ids].float()


class PrunedHead(nn.Module):
    """logits over the kept ids: hidden [N, E] -> [N, P]; ``ids`` [P] maps a column to its token id.
    quantization: the kept rows' format ('none', 'int8' or 'q4'; the drafter's own by default)."""

    ids: torch.Tensor  # buffer (registered in __init__)

    def __init__(self, model: LlamaForCausalLM, ids: torch.Tensor, quantization: str) -> None:
        super().__init__()
        rows = _head_rows(model, ids)  # [P, E]
        self._model = (model,)  # a tuple: not registered as a child
        self.register_buffer("ids", ids)
        self.kept = torch.zeros(int(ids.max()) + 1, dtype=torch.bool)
        self.kept[ids] = True
        self.linear = make_linear(rows.shape[1], rows.shape[0], False, quantization)
        if isinstance(self.linear, QuantLinear):
            self.linear.load_weight(rows)
        else:
            self.linear.weight.data.copy_(rows)  # type: ignore[operator]  # a Linear: its weight Parameter

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, E] -> [N, P]
        return self.linear(hidden)

    def is_kept(self, token: int) -> bool:
        return token < len(self.kept) and bool(self.kept[token])

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Float head rows [X, E] of any ids (for a request's context vocabulary)."""
        return _head_rows(self._model[0], torch.tensor(ids, dtype=torch.long))

    def score(self, hidden: torch.Tensor, contexts: list[ContextVocab]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per row of hidden [N, E]: (token ids, logits), both [P + X], over the kept ids and that
        row's request's context ids."""
        base = self(hidden)  # [N, P]
        out = []
        for r, ctx in enumerate(contexts):
            if ctx.ids:
                extra = ctx.weight @ hidden[r]  # [X]
                out.append((torch.cat([self.ids, torch.tensor(ctx.ids)]), torch.cat([base[r], extra])))
            else:
                out.append((self.ids, base[r]))
        return out


class ContextVocab:
    """One request's context tokens outside a PrunedHead's kept ids, with their head rows: ``ids``
    (X), ``weight`` [X, E]. ``update`` scans the tokens added since the last call; ``rewind``
    follows a rollback of the context (ids already added stay: they cost only their row)."""

    def __init__(self, head: PrunedHead) -> None:
        self.head = head
        self.ids: list[int] = []
        self.weight = torch.empty(0)
        self._known: set[int] = set()
        self._scanned = 0

    def rewind(self, num_tokens: int) -> None:
        self._scanned = min(self._scanned, num_tokens)

    def update(self, token_ids: list[int]) -> None:
        new = [t for t in dict.fromkeys(token_ids[self._scanned :]) if t not in self._known and not self.head.is_kept(t)]
        self._scanned = len(token_ids)
        if new:
            self._known.update(new)
            rows = self.head.rows(new)  # [len(new), E]
            self.weight = torch.cat([self.weight, rows]) if self.ids else rows
            self.ids.extend(new)


def expand(ids: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [S] over ``ids`` [S] -> [vocab_size] with -inf elsewhere (probability 0 after softmax)."""
    full = logits.new_full((vocab_size,), float("-inf"))
    full[ids] = logits
    return full
