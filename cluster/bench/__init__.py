"""The serving benchmark behind `duet bench` and `duet profile`: workload and senders (load_gen.py),
metric definitions (metrics.py), phases and CLI (serving.py), report and plot (report.py), and the
zero-compute echo worker (echo_worker.py). benchmarks/ holds scripts that use it."""
