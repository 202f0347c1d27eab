"""What hosts an engine in a worker process: the internal gRPC service and the Ray actor shells.

    service.py      duet.worker.v1.Worker and grpc health over one EngineLoop
    block_watch.py  WatchBlocks: the prefix-cache block events pushed to routers as they happen
    actor.py        WorkerActor: lifecycle only; resolves the model (the edge) and serves
    gang_actor.py   the actors of a TP / EP / SP gang: a leader that serves, followers that follow
    threads.py      a worker process's threads: torch threads, OpenMP wait policy, niceness
"""
