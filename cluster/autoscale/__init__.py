"""Autoscaling: what to scale to and why; deploy/ does the acting.

    slo.py           the SLO autoscaler's decision (per pool: forecast, capacity, SLO breaches)
    queue_length.py  the simpler queue-length policy
    forecast.py      arrival-rate forecasts from the metrics buckets
    profile.py       capacity profiles measured by ``duet profile``
    metrics.py       pool metrics scraped from the router
    actuator.py      the Actuator protocol (apply a pool size, report its status)
    loop.py          the control loop: metrics -> policy -> actuator
"""
