"""The controller's view of its pools as Prometheus metrics, on the router's /metrics in ``duet serve``
(registered into the router's registry; a scrape reads the controller's state, nothing is counted
twice):

    duet_pool_replicas{pool,state}          gauge: replicas by state (up, starting, down, failed,
                                            draining, preparing, standby, standby_failed)
    duet_pool_standby_target{pool}          gauge: the standby replicas the pool keeps
    duet_pool_standby_promoted_total        counter: standby replicas promoted to serving
    duet_pool_standby_replaced_total        counter: standby replicas that died and were replaced
    duet_pool_join_seconds{pool,how}        gauge: the latest replica's time from the scale-up decision
                                            to serving, how = started (a new replica) | promoted (a standby)

Example::

    registry.register(PoolStateCollector(controller))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class PoolStateCollector:
    """A prometheus_client custom collector over ``Controller.pool_states()`` (module docstring)."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller

    def collect(self) -> Iterator[Metric]:
        c = self._controller
        states = c.pool_states()
        replicas = GaugeMetricFamily("duet_pool_replicas", "replicas of the pool by state", labels=["pool", "state"])
        target = GaugeMetricFamily("duet_pool_standby_target", "standby replicas the pool keeps", labels=["pool"])
        for pool, counts in states.items():
            for state, n in counts.items():
                if state != "standby_target":
                    replicas.add_metric([pool, state], n)
            target.add_metric([pool], counts["standby_target"])
        yield replicas
        yield target
        yield CounterMetricFamily("duet_pool_standby_promoted", "standby replicas promoted to serving",
                                  value=c.num_promoted)
        yield CounterMetricFamily("duet_pool_standby_replaced", "standby replicas that died and were replaced",
                                  value=c.num_standby_replaced)
        join = GaugeMetricFamily("duet_pool_join_seconds", "the latest replica's scale-up decision to serving",
                                 labels=["pool", "how"])
        latest: dict[tuple[str, str], float] = {}
        for worker_id, how, seconds in list(c.joins):
            latest[(worker_id.rsplit("-", 1)[0], how)] = seconds
        for (pool, how), seconds in sorted(latest.items()):
            join.add_metric([pool, how], seconds)
        yield join
