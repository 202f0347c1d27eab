"""Which eviction policy pays for the host KV tier: ``tier_policy`` lru vs arc (the orders HostTier
uses: workers/kv/tiers/policy.py), trace-driven, on block-level traces of chat, RAG and mixed workloads.

    python -m benchmarks.tier_policy_sim [--device-blocks 256] [--host-ratios 0.5,1,2,4] [--seed 0] [--out PATH]

The model is the engine's: a prompt's blocks are looked up in order; a block in the device cache is a
device hit (and the most recently used there); else one in the host tier is a host hit (loaded back;
the host keeps its copy, as HostTier.get does); else it is computed. Every block of the request then
sits in the device cache (LRU over ``--device-blocks``), and what the device evicts is put into the
host tier (a block already there counts as a use), whose policy decides what falls out. One request at
a time, so nothing is pinned. Block identity is the prefix: block i of a conversation's history or of a
document is the same block for every request that shares that prefix. Deterministic (``--seed``).

Workloads (blocks of 16 tokens):
    chat   conversations arriving over time (a few active at once), each turn adding 6 blocks of user
           text and answer to its history; the next turn goes to an active conversation, the more
           recent the likelier (users answer fast or come back later)
    rag    documents of 32-160 blocks with Zipf(1.1) popularity, each request a document + a
           2-block question of its own
    mixed  chat, with one request in three a one-off long prompt (a 64-192-block document nobody
           asks about again: summarise this file): the scans that LRU lets flush the tier
Reported per (workload, host size as a multiple of the device cache, policy): the share of prompt
blocks that were device hits, host hits and computed; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

from workers.kv.tiers.policy import ORDERS, Order, make_order

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "tier_policy_sim.json"

Block = tuple[str, int]  # (prefix owner, index): the same block for every prompt sharing that prefix


def _put(order: Order, key: Block, capacity: int) -> list[Hashable]:
    """A tier of ``capacity`` blocks keeps ``key``, as HostTier.put does; -> what fell out."""
    if key in order:
        order.refresh(key)
        return []
    order.prepare(key)
    out = []
    while len(order) >= capacity:
        out.append(order.evict())
    order.admit(key)
    return out


def simulate(requests: list[list[Block]], device_blocks: int, host_blocks: int, policy: str) -> dict[str, float]:
    device = make_order("lru", device_blocks)  # the device's prefix cache gives up its least recently used block
    host = make_order(policy, host_blocks) if host_blocks > 0 else None
    n = {"device": 0, "host": 0, "computed": 0}
    for prompt in requests:
        for b in prompt:
            if b in device:
                device.use(b)
                n["device"] += 1
                continue
            if host is not None and b in host:
                host.use(b)  # loaded back; host keeps its copy
                n["host"] += 1
            else:
                n["computed"] += 1
            for victim in _put(device, b, device_blocks):
                if host is not None:
                    _put(host, victim, host_blocks)  # type: ignore[arg-type]  # the device's keys are Blocks
    total = sum(n.values())
    return {k: v / total for k, v in n.items()}


def chat(rng: random.Random, requests: int, tag: str = "c") -> Iterator[list[Block]]:
    """Conversations: a new one every few requests; each turn extends one active conversation."""
    history: dict[str, int] = {}
    active: list[str] = []
    made = 0
    for _ in range(requests):
        if not active or rng.random() < 0.2:
            cid = f"{tag}{made}"
            made += 1
            history[cid] = rng.randint(4, 12)  # system prompt and first question
            active.append(cid)
        else:  # the more recent the conversation, the likelier its next turn
            cid = active[-1 - min(int(rng.expovariate(0.25)), len(active) - 1)]
            history[cid] += 6
        if len(active) > 64:
            active.pop(0)
        yield [(cid, i) for i in range(history[cid])]


def rag(rng: random.Random, requests: int, docs: int = 400) -> Iterator[list[Block]]:
    sizes = [rng.randint(32, 160) for _ in range(docs)]
    weights = [1.0 / (k + 1) ** 1.1 for k in range(docs)]
    for r in range(requests):
        d = rng.choices(range(docs), weights)[0]
        yield [(f"d{d}", i) for i in range(sizes[d])] + [(f"q{r}", 0), (f"q{r}", 1)]


def mixed(rng: random.Random, requests: int) -> Iterator[list[Block]]:
    turns = chat(rng, requests)
    for r in range(requests):
        if rng.random() < 1 / 3:
            yield [(f"s{r}", i) for i in range(rng.randint(64, 192))]
        else:
            yield next(turns)


WORKLOADS: dict[str, Callable[[random.Random, int], Iterator[list[Block]]]] = {"chat": chat, "rag": rag, "mixed": mixed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device-blocks", type=int, default=256)
    ap.add_argument("--host-ratios", default="0.5,1,2,4", help="host tier sizes as multiples of the device cache")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    ratios = [float(x) for x in args.host_ratios.split(",")]
    rows: list[dict[str, Any]] = []
    for name, make in WORKLOADS.items():
        trace = list(make(random.Random(args.seed), args.requests))
        base = simulate(trace, args.device_blocks, 0, "lru")
        rows.append({"workload": name, "host_ratio": 0.0, "policy": "-", **base})
        for ratio in ratios:
            for policy in ORDERS:
                r = simulate(trace, args.device_blocks, int(ratio * args.device_blocks), policy)
                rows.append({"workload": name, "host_ratio": ratio, "policy": policy, **r})
    print(f"{'workload':8s} {'host':>5s} {'policy':6s} {'device':>7s} {'host':>7s} {'computed':>9s}")
    for row in rows:
        print(f"{row['workload']:8s} {row['host_ratio']:5.1f} {row['policy']:6s} {row['device']:7.1%} {row['host']:7.1%} "
              f"{row['computed']:9.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)
                                    | {"out": str(args.out)}, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
