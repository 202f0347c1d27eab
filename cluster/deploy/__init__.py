"""Running a deployment.

    serve.py              ``duet serve``: Ray, pools, controller, router, autoscaler in one process
    pools.py              a pool of worker actors (or gangs): create, resize, restart, placement
    controller.py         membership and health of every worker; membership_service.py serves it
    preflight.py          checks before anything starts (model, architecture, parallel layout)
    cpu_share.py          the embedded default's CPU split; ray_conn.py joining or starting Ray
    ray_actuator.py, kuberay_actuator.py, k8s_actuator.py   the autoscaler's actuators
    router_main.py        ``duet router``: a router in its own process following a controller
    status.py, drain.py   ``duet status`` and ``duet drain``
"""
