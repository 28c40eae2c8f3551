"""Which vLLM version serves which family, and raises which drafts' positions (the refusal of a
family the configured vLLM cannot decode: tests/unit/common/test_vllm_python_checked.py)."""

from __future__ import annotations

from eaglenest.settings.vllm_versions import raises_draft_positions, serves


def test_which_version_raises_a_drafts_positions_to_the_targets():
    """0.32 raises the eagle/eagle3 methods' (P-EAGLE is eagle3), never DFlash's (vllm#57941);
    0.33 every draft's but a YaRN one's."""
    assert raises_draft_positions("eagle3", "default", (0, 32, 0))
    assert raises_draft_positions("p_eagle", "yarn", (0, 32, 0))
    assert not raises_draft_positions("dflash", "default", (0, 32, 0))
    assert raises_draft_positions("dflash", "default", (0, 33, 0))
    assert not raises_draft_positions("dflash", "yarn", (0, 33, 0))
    assert not raises_draft_positions("eagle3", "yarn", (0, 34))
    assert not raises_draft_positions("eagle3", "default", (0, 31))


def test_which_version_serves_which_family():
    assert serves("p_eagle", (0, 32)) and serves("p_eagle", (0, 33, 2))
    assert not serves("p_eagle", (0, 34)) and not serves("eagle3", (0, 31))
    assert serves("dflash", (0, 34)) and serves("eagle3", (1, 0))
