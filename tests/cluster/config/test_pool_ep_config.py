"""The pool's ep_size key (expert-parallel gangs): default 1, set from YAML-style overrides, and a
bad value stops config loading with a message naming the key and the fix."""

from __future__ import annotations

import pytest

from cluster.config.duet import ClusterConfigError, load_config


def test_default_and_override():
    assert load_config(env={}, overrides={}).pool.ep_size == 1
    assert load_config(env={}, overrides={"pool.ep_size": 4}).pool.ep_size == 4


def test_bad_ep_size_names_the_key():
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.ep_size=0 .*must be .*>= 1"):
        load_config(env={}, overrides={"pool.ep_size": 0})
