"""The garbage-collector settings the workflow uses while Snakemake plans (eaglenest.common.planning_gc)."""

import gc

import pytest

from eaglenest.common.planning_gc import (
    PLANNING_FULL_COLLECTION_THRESHOLD,
    postpone_full_collections,
    resume_full_collections,
)


def full_collections_while_building(n: int = 300_000) -> tuple[int, list]:
    """Full collections that happen while `n` long-lived containers are built (like a DAG)."""
    before = gc.get_stats()[2]["collections"]
    kept = [[i] for i in range(n)]
    return gc.get_stats()[2]["collections"] - before, kept


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield thresholds
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_planning_postpones_full_collections_then_restores_the_thresholds(restore_gc):
    saved = postpone_full_collections()
    assert saved == restore_gc
    assert gc.get_threshold() == (*saved[:2], max(saved[2], PLANNING_FULL_COLLECTION_THRESHOLD))

    # While planning, a growing heap of long-lived objects sets off no full collection.
    postponed, planned = full_collections_while_building()
    assert postponed == 0

    resume_full_collections(saved)
    assert gc.get_threshold() == saved
    assert gc.get_freeze_count() >= len(planned)  # the planned objects are out of its reach


def test_with_the_default_thresholds_the_same_growth_sets_off_full_collections(restore_gc):
    gc.set_threshold(700, 10, 10)
    gc.collect()
    collections, _ = full_collections_while_building()
    assert collections > 0  # what postponing saves (a check that the test above can fail)


def test_a_higher_threshold_set_by_the_user_is_kept(restore_gc):
    gc.set_threshold(700, 10, 5000)
    assert postpone_full_collections() == (700, 10, 5000)
    assert gc.get_threshold() == (700, 10, 5000)
