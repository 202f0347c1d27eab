"""prefix_aware: send a request where its prompt prefix is likely cached, unless that worker is
much busier than the idlest one (after SGLang's cache-aware policy with balance thresholds).

Where matched(w) comes from:
  * ``holdings`` given (router/prefix_index.py, what ``duet serve`` and ``duet router`` wire in):
    the blocks worker w *reports* holding (its prefix cache's block events, read on every load
    poll), so every router of a deployment matches against the same truth; plus the blocks this
    router itself sent to w in the last ``pending_s`` seconds, which w's next report may not show
    yet (a burst of one new prefix would otherwise scatter before the first copy is computed).
    Those pending entries expire by age; nothing this router guesses outlives them.
  * a worker that does not report holdings (prefix caching off, an older worker), or no
    ``holdings``: the PrefixTree of what this router sent there (router/prefix_tree.py).

Tiers: a worker with lower KV tiers (workers/engine/kv_tiers.py) reports each block with the tier
it holds it in (device cache, host memory, local disk); its own recent sends and the PrefixTree count
as device. A matched block is worth, in blocks of prefill saved:

    tier      weight  why
    device    1.0     nothing to do: the block is reused in place
    host      0.9     loaded back with one copy plus a checksum before the step: on CPU ~1.4 ms per
                      16-token block against ~140 ms to recompute it (benchmarks/README.md,
                      kv_tiers), so it saves nearly as much as a device hit; 0.1 off keeps device
                      first among equals and prices a GPU's faster prefill, where a copy over PCIe
                      is a larger share of what it saves
    disk      0.5     read on the disk thread while the request waits parked (TTFT pays the read)
                      and recomputed if the read misses cache.tier_load_timeout_s; it also
                      displaces host blocks on its way in. Half a block: a disk hit beats
                      recomputing but loses to a device or host hit of half the length
    pending   1.0     a prompt the worker admitted and is computing (pushed on its WatchBlocks
                      stream within milliseconds, router/block_watch.py): on its device by the
                      time a request sent now runs, like this router's own recent sends. This is
                      what makes N routers agree on a new prefix: the first router's choice is
                      every router's match before any of them polls again
    (none)    0       recompute

(``host_weight`` and ``disk_weight`` set them; 0 <= disk <= host <= 1.) So for one prompt of 8
blocks: w0 holding 4 on device scores 4.0; w1 holding all 8 in host, 7.2; w2 all 8 on disk, 4.0
(a tie with w0, broken by load). Load enters as before: by the balance thresholds of step 3, and
as the tie-break.

Algorithm, per request (P = the prompt's token ids, load = WorkerState.load_tokens, plus with
``holdings`` the prompt tokens the worker reports pending -- admitted, not computed yet, pushed as
they happen: the other routers' sends of the last poll interval, which its load report may not
show yet; once it does, they count twice until the prompt is computed, a bias toward workers with
fewer queued prompts; a request under
a LoRA adapter hashes P from its adapter's root, RouteRequest.prefix_root, so it matches only
prefixes computed under the same adapter, as the workers key them):
 1. Cut P into full blocks of ``block_size`` tokens (= the workers' KV block size): matched(w) =
    leading blocks of P that worker w holds (above), score(w) = the sum of their tier weights.
 2. best  = the healthy worker with the highest score; ties -> lower load (so a popular
            prefix held by several workers is spread by load), then fewer in-flight, then id.
    least = the least-loaded healthy worker (as router/policies/least_loaded.py, on this load).
 3. matched(best) == 0        -> least      (nothing cached anywhere: plain least-loaded; with
                                             ``cold_home``, its home: among the workers whose
                                             reported load is within this request's cost of the
                                             least, the one its first block hashes to, the same
                                             from every router: router/policies/cold_home.py)
    load(best) - load(least) > balance_abs_tokens
      and load(best) > balance_rel * load(least)
                              -> least      (imbalance fallback: logged, counted)
    otherwise                 -> best       (prefix hit)
 4. Insert P's blocks under the chosen worker (most recently used), evicting that worker's least
    recently used blocks beyond its cap: ``max_blocks_per_worker``, or by default its reported KV
    capacity (kv_blocks_total, converted to our block size), or 4096 blocks before its first report.

Why both thresholds (as SGLang): the absolute one ignores imbalance too small to matter (at low
load any ratio is noise); the relative one stops a large but proportionally small difference from
throwing away a cache hit. Why fall back at all: a popular prefix (a shared system prompt) would
otherwise pin all traffic to the first worker that saw it, the hot-spotting Dynamo and SGLang
users report. After a fallback the least-loaded worker holds the prefix too, so it replicates to
as many workers as the load needs, and step 2's tie-break spreads it among them.

Example (block_size=16, thresholds 4096 tokens and 1.5x): w0 was sent a 512-token system prompt,
w1 was not. A request with that prompt + a question goes to w0 while load(w0) - load(w1) <= 4096
tokens (or load(w0) <= 1.5 * load(w1)); past that, to w1, which from then on matches it too.

The tree is forgotten for a worker that leaves the pool (absent from ``workers``) or restarts
(its LoadReport.incarnation changes); an unhealthy worker keeps its entries (a restart shows).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import ClassVar

import time
from collections import deque
from collections.abc import Callable

from router.policies.base import PolicyConfigError, RouteRequest, WorkerState, healthy_workers, log_fallback
from router.policies.cold_home import cold_home
from router.prefix_index import PrefixIndex
from router.prefix_tree import PrefixTree, block_hashes
from workers.block_hash import ROOT, Tier, chain_hashes

logger = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS_PER_WORKER = 4096  # before a worker reports its KV capacity


class PrefixAwarePolicy:
    name: ClassVar[str] = "prefix_aware"

    def __init__(self, holdings: PrefixIndex | None = None, clock: Callable[[], float] = time.monotonic, *,
                 block_size: int = 16, balance_abs_tokens: int = 4096, balance_rel: float = 1.5,
                 max_blocks_per_worker: int | None = None, pending_s: float = 1.0, cold_home: bool = False,
                 host_weight: float = 0.9, disk_weight: float = 0.5) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise PolicyConfigError(f"prefix_aware.block_size={block_size!r}: must be an integer >= 1 "
                                    "(use the workers' KV block size)")
        if not isinstance(balance_abs_tokens, int) or balance_abs_tokens < 0:
            raise PolicyConfigError(f"prefix_aware.balance_abs_tokens={balance_abs_tokens!r}: must be an integer >= 0")
        if not isinstance(balance_rel, (int, float)) or not balance_rel >= 1.0:
            raise PolicyConfigError(f"prefix_aware.balance_rel={balance_rel!r}: must be a number >= 1.0")
        if max_blocks_per_worker is not None and (not isinstance(max_blocks_per_worker, int)
                                                  or max_blocks_per_worker < 1):
            raise PolicyConfigError(f"prefix_aware.max_blocks_per_worker={max_blocks_per_worker!r}: must be an "
                                    "integer >= 1, or unset to follow each worker's KV capacity")
        if not isinstance(pending_s, (int, float)) or not pending_s >= 0:
            raise PolicyConfigError(f"prefix_aware.pending_s={pending_s!r}: must be a number of seconds >= 0 "
                                    "(how long this router's own sends count before the workers' reports show them)")
        for key, w in (("host_weight", host_weight), ("disk_weight", disk_weight)):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
                raise PolicyConfigError(f"prefix_aware.{key}={w!r}: must be a number in [0, 1] (blocks of "
                                        "prefill a hit in that tier saves, a device hit saving 1)")
        if disk_weight > host_weight:
            raise PolicyConfigError(f"prefix_aware.disk_weight={disk_weight!r} > prefix_aware.host_weight="
                                    f"{host_weight!r}: a disk hit is never worth more than a host hit")
        self.tier_weights = {Tier.DEVICE: 1.0, Tier.HOST: float(host_weight), Tier.DISK: float(disk_weight),
                             Tier.PENDING: 1.0}
        if not isinstance(cold_home, bool):
            raise PolicyConfigError(f"prefix_aware.cold_home={cold_home!r}: must be true (a new prefix goes to its "
                                    "home, the same worker from every router) or false (to the least loaded)")
        self.cold_home = cold_home
        self.block_size = block_size
        self.holdings = holdings
        self.pending_s = float(pending_s)
        self._clock = clock
        # (sent at, worker id, chain hashes) of this router's recent sends, oldest first, and
        # worker id -> hash -> how many of those entries hold it.
        self._pending: deque[tuple[float, str, tuple[int, ...]]] = deque()
        self._pending_held: dict[str, dict[int, int]] = {}
        self.balance_abs_tokens = balance_abs_tokens
        self.balance_rel = float(balance_rel)
        self.max_blocks_per_worker = max_blocks_per_worker
        self.tree = PrefixTree()
        self._incarnations: dict[str, str] = {}
        self._warned_block_size: set[str] = set()
        # Counters (exported as metrics by the router).
        self.num_prefix_hits = 0  # routed to the best-matching worker
        self.num_matched_tokens = 0  # prompt tokens those hits matched
        self.num_matched_blocks = dict.fromkeys(Tier, 0)  # ... their blocks, by the tier the chosen worker held them in
        self.num_no_match = 0  # no worker held the first block: routed least-loaded
        self.num_imbalance_fallbacks = 0  # best match too loaded: routed least-loaded
        self.num_worker_resets = 0  # tree entries dropped because a worker left or restarted

    def select(self, request: RouteRequest, workers: Sequence[WorkerState]) -> str:
        healthy = healthy_workers(workers)
        self._sync_membership(workers)
        root = request.prefix_root  # an adapter's prefixes are its own (workers/block_hash.py)
        hashes = block_hashes(request.prompt_token_ids, self.block_size, root)
        matched = self._match(request.prompt_token_ids, hashes, healthy, root)
        score = {wid: sum(self.tier_weights[Tier(t)] for t in tiers) for wid, tiers in matched.items()}
        load = self._loads(healthy)
        least = min(healthy, key=lambda w: (load[w.worker_id], w.in_flight_requests, w.worker_id))
        best = min(healthy, key=lambda w: (-score.get(w.worker_id, 0.0), load[w.worker_id],
                                           w.in_flight_requests, w.worker_id))
        best_tiers = matched.get(best.worker_id, [])
        best_blocks = len(best_tiers)
        if score.get(best.worker_id, 0.0) == 0.0:
            self.num_no_match += 1
            chosen = cold_home(request, hashes[0] if hashes else None, healthy, least) if self.cold_home else least
            logger.debug("request %s: no cached prefix on any worker -> %s (%s)", request.request_id,
                         chosen.worker_id, "its home" if self.cold_home else "least loaded")
        elif best is not least and self._imbalanced(load[best.worker_id], load[least.worker_id]):
            self.num_imbalance_fallbacks += 1
            log_fallback(logger, self.num_imbalance_fallbacks,
                         "request %s: %s holds %d prefix tokens but its load %d exceeds %s's %d beyond the "
                         "balance thresholds (+%d tokens and x%.2f); routing to %s",
                         request.request_id, best.worker_id, best_blocks * self.block_size, load[best.worker_id],
                         least.worker_id, load[least.worker_id], self.balance_abs_tokens, self.balance_rel,
                         least.worker_id)
            chosen = least
        else:
            self.num_prefix_hits += 1
            self.num_matched_tokens += best_blocks * self.block_size
            for t in best_tiers:
                self.num_matched_blocks[Tier(t)] += 1
            chosen = best
        if self.holdings is not None and self.holdings.knows(chosen.worker_id):
            self._add_pending(chosen.worker_id, request.prompt_token_ids, root)
        else:
            self.tree.insert(chosen.worker_id, hashes, self._max_blocks(chosen))
        return chosen.worker_id

    def on_request_complete(self, worker_id: str, request_id: str) -> None:
        pass  # a finished request's blocks stay cached on the worker (its LRU), so they stay here too

    def counters(self) -> dict[str, int]:
        return {
            "prefix_hits": self.num_prefix_hits,
            "matched_tokens": self.num_matched_tokens,
            **{f"matched_{t.name.lower()}_blocks": n for t, n in self.num_matched_blocks.items()},
            "no_match": self.num_no_match,
            "imbalance_fallbacks": self.num_imbalance_fallbacks,
            "worker_resets": self.num_worker_resets,
            "tree_blocks": self.tree.num_blocks(),
            "reported_blocks": self.holdings.num_blocks() if self.holdings is not None else 0,
        }

    # ------------------------------------------------------------- internals
    def _match(self, token_ids: Sequence[int], hashes: list[int], healthy: Sequence[WorkerState],
               root: int = ROOT) -> dict[str, list[int]]:
        """The tiers of matched(w)'s blocks for each healthy worker (module docstring): reported +
        pending, or the tree (both device)."""
        if self.holdings is None:
            return {wid: [Tier.DEVICE] * n for wid, n in self.tree.match(hashes).items()}
        reporting = [w.worker_id for w in healthy if self.holdings.knows(w.worker_id)]
        matched = self.holdings.match_tiers(token_ids, reporting, root)
        self._expire_pending()
        for wid in reporting:
            pending = self._pending_held.get(wid)
            if pending:
                n = 0
                for h in chain_hashes(token_ids, self.holdings.block_size(wid), root=root):
                    if h not in pending:
                        break
                    n += 1
                if n:  # sent there just now: its first n blocks will be on its device
                    matched[wid] = [Tier.DEVICE] * n + matched.get(wid, [])[n:]
        if len(reporting) < len(healthy):
            tree = self.tree.match(hashes)
            known = set(reporting)
            matched.update({wid: [Tier.DEVICE] * n for wid, n in tree.items() if wid not in known})
        return matched

    def _add_pending(self, worker_id: str, token_ids: Sequence[int], root: int = ROOT) -> None:
        if self.pending_s <= 0:
            return
        assert self.holdings is not None
        hashes = tuple(chain_hashes(token_ids, self.holdings.block_size(worker_id), root=root))
        if not hashes:
            return
        self._pending.append((self._clock(), worker_id, hashes))
        held = self._pending_held.setdefault(worker_id, {})
        for h in hashes:
            held[h] = held.get(h, 0) + 1

    def _expire_pending(self) -> None:
        horizon = self._clock() - self.pending_s
        while self._pending and self._pending[0][0] < horizon:
            _, wid, hashes = self._pending.popleft()
            held = self._pending_held[wid]
            for h in hashes:
                if held[h] == 1:
                    del held[h]
                else:
                    held[h] -= 1

    def _loads(self, healthy: Sequence[WorkerState]) -> dict[str, int]:
        """Each worker's load_tokens plus, with ``holdings``, the prompt tokens it reports pending
        (admitted, not computed): pushed within milliseconds, so N routers see each other's fresh
        sends in the load too, not only their own until the next poll (module docstring)."""
        if self.holdings is None:
            return {w.worker_id: w.load_tokens for w in healthy}
        return {w.worker_id: w.load_tokens + self.holdings.pending_tokens(w.worker_id) for w in healthy}

    def _imbalanced(self, hi: int, lo: int) -> bool:
        return hi - lo > self.balance_abs_tokens and hi > self.balance_rel * lo

    def _max_blocks(self, w: WorkerState) -> int:
        if self.max_blocks_per_worker is not None:
            return self.max_blocks_per_worker
        if w.kv_blocks_total and w.kv_block_size:
            return max(1, w.kv_blocks_total * w.kv_block_size // self.block_size)
        return DEFAULT_MAX_BLOCKS_PER_WORKER

    def _sync_membership(self, workers: Sequence[WorkerState]) -> None:
        """Forget workers that left or restarted; warn once per worker on a block-size mismatch."""
        present = {w.worker_id: w for w in workers}
        for wid in self.tree.workers:
            if wid not in present:
                self._forget(wid, "left the pool")
        for wid in [wid for wid in self._incarnations if wid not in present]:
            del self._incarnations[wid]
        for wid, w in present.items():
            if w.incarnation:  # "" = no report yet
                old = self._incarnations.get(wid)
                if old is not None and old != w.incarnation:
                    self._forget(wid, f"restarted (incarnation {old} -> {w.incarnation})")
                self._incarnations[wid] = w.incarnation
            if w.kv_block_size and w.kv_block_size != self.block_size and wid not in self._warned_block_size:
                self._warned_block_size.add(wid)
                logger.warning("worker %s uses KV blocks of %d tokens but prefix_aware.block_size is %d: "
                               "prefix matches are approximate; set block_size to %d",
                               wid, w.kv_block_size, self.block_size, w.kv_block_size)

    def _forget(self, worker_id: str, why: str) -> None:
        n = self.tree.remove_worker(worker_id)
        self.num_worker_resets += 1
        logger.info("prefix tree: forgot %d blocks of worker %s: it %s", n, worker_id, why)
