"""A run name stays inside results/: one that leaves it is a config error."""

from __future__ import annotations

import pytest

from eaglenest.common.config import ConfigError, validate_config


@pytest.mark.parametrize("run", ["..", ".", ".hidden", "a/b"])
def test_a_run_name_that_leaves_results_is_refused(run):
    with pytest.raises(ConfigError, match="run"):
        validate_config({"run": run})
    assert validate_config({"run": "my-run.v2"})["run"] == "my-run.v2"
