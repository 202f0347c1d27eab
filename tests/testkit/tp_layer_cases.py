"""Rank function for the parallel-layer tests: every rank loads its shards of the same full
weights (seeded) and returns its outputs, which the test compares with the unsharded math."""

from __future__ import annotations

import torch

from workers.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from workers.parallel.groups import get_group
from workers.parallel.sharding import even_shard


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"x": r(5, 8), "gate": r(7, 8), "up": r(7, 8), "gate_b": r(7), "up_b": r(7), "down": r(8, 7),
            "down_b": r(8), "emb": r(11, 8), "ids": torch.tensor([0, 10, 5, 6, 3]), "head": r(11, 8)}


@torch.inference_mode()
def layers_rank(rank: int) -> dict:
    tp = get_group("tp")
    w = full_weights()
    i = even_shard(7, tp.world_size, tp.rank)  # 7 columns: uneven over 2 ranks (4 + 3)
    col = MergedColumnParallelLinear(8, {"gate": i, "up": i}, bias=True)
    for name in ("gate", "up"):
        col.weight.weight_loader(col.weight, w[name], name)
        col.bias.weight_loader(col.bias, w[name + "_b"], name)
    row = RowParallelLinear(7, 8, bias=True, shard=i)
    row.weight.weight_loader(row.weight, w["down"])
    row.bias.weight_loader(row.bias, w["down_b"])
    gu = col(w["x"])  # [5, 2 * |i|]: this rank's gate and up columns
    y = row(gu[:, : i.size] * gu[:, i.size:])  # [5, 8], all-reduced
    emb = VocabParallelEmbedding(11, 8)  # 11 rows over 2 ranks: 6 + 5 (+1 padding row)
    emb.weight.weight_loader(emb.weight, w["emb"])
    head = ParallelLMHead(11, 8)
    head.weight.weight_loader(head.weight, w["head"])
    tied = ParallelLMHead(11, 8, tied=emb)
    return {"gate_up": gu.numpy(), "y": y.numpy(), "emb": emb(w["ids"]).numpy(),
            "logits": None if (lg := head(w["x"])) is None else lg.numpy(),
            "tied": None if (lt := tied(w["x"])) is None else lt.numpy(),
            "params": sorted(n for n, _ in head.named_parameters()) + sorted(n for n, _ in tied.named_parameters())}
