"""A run whose vLLM jobs' interpreter (vllm.python) is missing is refused when the workflow reads
the config, a dry run too, naming the key and the path: it planned every job, and the first
vLLM job failed after generation, capture and training."""

from __future__ import annotations

from support.workflow import copy_workflow, planned_jobs, snakemake


def test_a_missing_vllm_python_is_refused_before_any_job(tmp_path):
    workdir = copy_workflow(tmp_path / "workflow")
    config = {"evaluate": {"engine": "vllm"}, "vllm": {"python": "envs/absent/bin/python"}}
    dry = snakemake(workdir, "-n", config=config)
    assert dry.returncode != 0
    said = dry.stdout + dry.stderr
    assert "vllm.python 'envs/absent/bin/python': no such interpreter" in said, said[-2000:]
    assert "Traceback" not in said
    # capture servers started by hand and no vLLM evaluation: no job runs it, nothing refused
    served = {
        "hidden": {"backend": "vllm"},
        "vllm": {**config["vllm"], "capture_url": "http://127.0.0.1:9"},
    }
    assert planned_jobs(snakemake(workdir, "-n", config=served))
