"""The discrete-event simulator of pools, routing and autoscaling (judged at up to 1,000 replicas).

    simulator.py  Simulation: arrivals, routing, replicas' service, the autoscaler's ticks
    pool.py       SimPool settings, MigrationModel, and PoolState while running
    replica.py    one simulated replica's queues and batch
    spec.py       speculation settings (SpecModel, DraftCost) and counters; drafting.py its state
    control.py    simulated metrics and actuator; migration.py the migrator and rebalancer
    trace.py      request traces (synthetic shapes, bursts); report.py tables and plots
"""
