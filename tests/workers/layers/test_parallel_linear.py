"""Tensor-parallel building blocks: the shard rules (pure functions) and the layers in a real
2-rank gloo gang against the unsharded math (column-parallel fused gate/up with biases and an
uneven split, row-parallel with its all-reduce and a bias added once, vocabulary-parallel
embedding over a vocabulary that does not divide, untied and tied parallel LM heads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testkit.tolerance import assert_within, linear_error_bound, product_error_bound
from testkit.tp_layer_cases import full_weights, layers_rank
from workers.errors import ConfigError
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang
from workers.parallel.sharding import AttentionShard, Shard, attention_shard, even_shard, take, vocab_shard


def test_even_shard_covers_everything_once():
    for n, w in [(1536, 2), (5, 2), (7, 3), (2, 4)]:
        shards = [even_shard(n, w, r) for r in range(w)]
        assert shards[0].start == 0 and all(a.end == b.start for a, b in zip(shards, shards[1:]))
        assert shards[-1].end == n and max(s.size for s in shards) - min(s.size for s in shards) <= 1
    assert even_shard(5, 2, 0) == Shard(0, 3) and even_shard(5, 2, 1) == Shard(3, 2)


def test_attention_shard_keeps_gqa_groups_whole():
    # SmolLM2: 9 query heads, 3 kv heads
    assert attention_shard(9, 3, 2, 0) == AttentionShard(Shard(0, 6), Shard(0, 2))
    assert attention_shard(9, 3, 2, 1) == AttentionShard(Shard(6, 3), Shard(2, 1))
    assert [attention_shard(9, 3, 3, r) for r in range(3)] == [AttentionShard(Shard(3 * r, 3), Shard(r, 1))
                                                              for r in range(3)]
    # fewer kv heads than ranks: each kv head replicated, its query heads split
    assert [attention_shard(4, 2, 4, r) for r in range(4)] == [
        AttentionShard(Shard(0, 1), Shard(0, 1)), AttentionShard(Shard(1, 1), Shard(0, 1)),
        AttentionShard(Shard(2, 1), Shard(1, 1)), AttentionShard(Shard(3, 1), Shard(1, 1))]
    for h, g, w in [(9, 3, 4), (8, 2, 3), (6, 2, 4)]:
        with pytest.raises(ConfigError, match="tp_size"):
            attention_shard(h, g, w, 0)


def test_vocab_shard_pads_the_last_rank():
    assert [vocab_shard(11, 2, r) for r in range(2)] == [Shard(0, 6), Shard(6, 5)]
    assert [vocab_shard(49152, 3, r).size for r in range(3)] == [16384] * 3
    assert vocab_shard(3, 4, 3) == Shard(3, 0)  # a rank past the end holds only padding
    t = torch.arange(12).view(3, 4)
    assert take(t, 1, Shard(1, 2)).tolist() == [[1, 2], [5, 6], [9, 10]]


def test_parallel_layers_match_unsharded_math():
    # Tolerances are forward-error bounds (tests/testkit/tolerance.py), not guesses: each output is a
    # float32 dot product (plus a bias) that the ranks and the reference below sum in different
    # orders (BLAS blocking, FMA, vector width), so each side is within gamma_n * sum|x_k w_k| (+|b|)
    # of the exact value and the two agree within twice that, elementwise. A relative tolerance alone
    # fails on outputs near zero (on AVX-512/AMX a 1.5e-4 output came out 2.4e-7 off).
    w = full_weights()
    x = w["x"]
    gate, up = x @ w["gate"].T + w["gate_b"], x @ w["up"].T + w["up_b"]  # [5, 7]
    y = (gate * up) @ w["down"].T + w["down_b"]  # [5, 8]
    r0, r1 = spawn_gang(layers_rank, ParallelConfig(tp_size=2))
    gate_err = linear_error_bound(x, w["gate"], w["gate_b"])  # [5, 7], each side's error
    up_err = linear_error_bound(x, w["up"], w["up_b"])
    assert_within(np.concatenate([r0["gate_up"][:, :4], r1["gate_up"][:, :3]], 1), gate, 2 * gate_err, "gate")
    assert_within(np.concatenate([r0["gate_up"][:, 4:], r1["gate_up"][:, 3:]], 1), up, 2 * up_err, "up")
    # y = (gate * up) W_down^T + b: the rounding of gate and up carries through the product and the
    # row-parallel matmul (whose two partial sums and all-reduce are one more summation order)
    prod_err = product_error_bound(gate, up, gate_err, up_err)  # [5, 7]
    y_err = linear_error_bound(gate * up, w["down"], w["down_b"], x_err=prod_err)
    for r in (r0, r1):
        assert_within(r["y"], y, 2 * y_err, "y")
        np.testing.assert_array_equal(r["emb"], w["emb"][w["ids"]])  # a row gather: exact
    assert_within(r0["logits"], x @ w["head"].T, 2 * linear_error_bound(x, w["head"]), "logits")
    assert_within(r0["tied"], x @ w["emb"].T, 2 * linear_error_bound(x, w["emb"]), "tied logits")
    assert r1["logits"] is None and r1["tied"] is None  # logits are gathered to tp rank 0 only
    assert r0["params"] == ["weight"]  # the tied head registers no second copy of the embedding
