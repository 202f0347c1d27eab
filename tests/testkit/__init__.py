"""Support code the tests share across folders: tiny random checkpoints, the per-rank bodies of
multi-process tests (module-level functions, so spawned rank processes can import them by name),
in-process fake workers for the router, a throwaway PKI and the chart helpers.

Importable as ``testkit`` because tests/conftest.py's folder is on ``sys.path`` while pytest runs
(pytest's default "prepend" import mode), and spawned child processes inherit that path. Fixtures
built on these live in the conftest.py files beside the tests that use them.
"""
