"""The deployment's configuration: ``load_config`` in duet.py (sections, validation), where each
value came from (sources.py), settings derived from the worker and router config types
(derive.py), checks across sections (combinations.py) and the autoscaling section (autoscale.py)."""
