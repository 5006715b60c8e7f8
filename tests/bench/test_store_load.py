"""bench/store_load.py (``cupycoll-bench --scenario store``): its counts are the store calls
cupycoll's code makes, on a real TCPStore server, and its projection is a straight line
through them."""

from __future__ import annotations

import pytest

from bench import store_load

pytestmark = pytest.mark.launches


@pytest.fixture(scope="module")
def server():
    with store_load.Server() as running:
        yield running


def test_a_creation_and_a_diagnosis_are_counted_per_rank(server):
    created = store_load.creation(server, 6, 0.2, lambda r: ("world", r, 6), "t-create")
    assert len(created) == 6 and max(created) <= 8 and min(created) >= 1, created
    diagnosed = store_load.diagnosis(server, 6, "t-diagnose")
    assert len(diagnosed) == 6 and 1 <= max(diagnosed) <= 16, diagnosed


def test_an_idle_minute_makes_almost_no_store_call(server):
    assert max(store_load.idle(server, 4, 2.0, "t-idle")) <= 60  # at most one per second, scaled


def test_the_projection_is_a_line_through_the_counts():
    assert store_load.fit([8, 16], [3.0, 5.0]) == pytest.approx((1.0, 0.25))
    assert store_load.fit([8, 16, 32], [4.0, 4.0, 4.0]) == pytest.approx((4.0, 0.0))


def test_counts_that_do_not_grow_project_as_a_constant():
    assert store_load.model([8, 16, 32, 64], [9.4, 9.6, 9.8, 9.9]) == (9.9, 0.0)
    a, b = store_load.model([8, 16, 32, 64], [49.0, 89.4, 166.3, 312.3])
    assert b == pytest.approx(4.7, abs=0.1) and a == pytest.approx(13.7, abs=0.1)
