"""Duet's deployment side: configuration, deployment on Ray / Kubernetes, autoscaling, simulation,
benchmarks and the ``duet`` CLI.

    config/     the one DuetConfig: sections, sources (defaults < YAML < env < flags), checks
    autoscale/  the SLO and queue-length policies, forecasts, capacity profiles, the control loop
    deploy/     ``duet serve``: pools of worker actors, controller and membership, preflight, actuators
                (Ray, KubeRay), the standalone router process, ``duet status`` / ``duet drain``
    sim/        the discrete-event simulator the autoscaler is judged on
    bench/      ``duet bench`` and ``duet profile``
    cli.py      the ``duet`` entry point; client_args.py the router-client flags it shares
"""
