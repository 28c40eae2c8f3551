"""A prompts file line that is not UTF-8 is skipped and counted with its line number (JSON lines),
or stops the stage naming file and line (a whole JSON file)."""

from __future__ import annotations

import json

import pytest

from eaglenest.common.config import validate_config


def test_a_prompts_line_that_is_not_utf8_is_counted_with_its_line_number(tmp_path):
    from eaglenest.stages.prompts.prompts import prepare_prompts
    from eaglenest.stages.prompts.sources import PromptSourceError

    jsonl = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"question {i}"}).encode() for i in range(4)]
    lines[2] = b'{"prompt": "caf\xe9"}'  # Latin-1, not UTF-8
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    config = validate_config(
        {"seed": 0, "prompts": {"source": str(jsonl), "shuffle": False, "max_samples": 3}}
    )
    report = prepare_prompts(config, tmp_path / "all.parquet", tmp_path / "report.json")
    assert report["skipped"]["invalid_json"] == 1
    (example,) = report["skipped_examples"]["invalid_json"]
    assert "line 3: not UTF-8" in example
    whole = tmp_path / "prompts.json"
    whole.write_bytes(b'[\n{"prompt": "a"},\n{"prompt": "caf\xe9"}\n]\n')
    config = validate_config({"seed": 0, "prompts": {"source": str(whole)}})
    with pytest.raises(PromptSourceError, match=r"prompts\.json: line 3: not UTF-8"):
        prepare_prompts(config, tmp_path / "all2.parquet", tmp_path / "report2.json")
