"""GPU claims of jobs sharing a machine: distinct GPUs, waiting when none is free, nothing done
when a scheduler already chose (the locking is real; the GPU count is given)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglenest.common.gpus import claim_gpus


def test_jobs_get_distinct_gpus_and_a_released_gpu_is_free_again(tmp_path: Path):
    first_env, second_env, third_env = {}, {}, {}
    first = claim_gpus(2, total=3, lock_dir=tmp_path, environ=first_env)
    second = claim_gpus(1, total=3, lock_dir=tmp_path, environ=second_env)
    assert first.indices == [0, 1] and first_env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert second.indices == [2] and second_env["CUDA_VISIBLE_DEVICES"] == "2"
    with pytest.raises(TimeoutError, match="no 1 free GPU"):
        claim_gpus(1, total=3, lock_dir=tmp_path, environ={}, timeout_s=0.1)
    first.release()
    assert claim_gpus(2, total=3, lock_dir=tmp_path, environ=third_env).indices == [0, 1]


def test_a_claim_is_held_for_its_block_as_the_job_scripts_hold_it(tmp_path: Path):
    with claim_gpus(2, total=2, lock_dir=tmp_path, environ={}) as claim:
        assert claim.indices == [0, 1]
        with pytest.raises(TimeoutError, match="no 1 free GPU"):
            claim_gpus(1, total=2, lock_dir=tmp_path, environ={}, timeout_s=0.1)
    assert claim_gpus(2, total=2, lock_dir=tmp_path, environ={}).indices == [0, 1]


def test_a_scheduler_choice_or_no_gpu_claims_nothing(tmp_path: Path):
    chosen = {"CUDA_VISIBLE_DEVICES": "3"}
    assert claim_gpus(1, total=4, lock_dir=tmp_path, environ=chosen).indices == []
    assert chosen["CUDA_VISIBLE_DEVICES"] == "3"
    none: dict[str, str] = {}
    assert claim_gpus(1, total=0, lock_dir=tmp_path, environ=none).indices == []
    assert "CUDA_VISIBLE_DEVICES" not in none
    with pytest.raises(RuntimeError, match="needs 3 GPUs but the machine has 2"):
        claim_gpus(3, total=2, lock_dir=tmp_path, environ={})
