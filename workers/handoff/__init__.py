"""Who moves which KV blocks, and when: the services built on the engine and the KV transport.

    disagg.py             P/D: the prefill side computes a prompt and sends its KV straight into the
                          blocks the decode side reserved
    prefix_pull.py        a worker pulls a long prompt prefix from a peer that holds it
    migration_service.py  live migration of running requests between decode workers
    drain.py              empty a worker by migrating everything it runs
"""
