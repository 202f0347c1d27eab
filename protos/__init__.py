"""Protocol buffers of Duet and their generated Python stubs.

    protos/duet/v1/duet.proto              public API (package duet.v1): Generate, ListModels
    protos/duet/worker/v1/worker.proto     internal router <-> worker API (package duet.worker.v1)

Import the stubs as ``from protos.duet.v1 import duet_pb2, duet_pb2_grpc``. They are generated
(``python -m protos.generate``) and checked in; ``python -m protos.generate --check`` fails on drift.
"""
