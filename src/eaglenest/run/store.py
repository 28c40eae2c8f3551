"""What `hidden.store: budget` weighs: a hidden-state shard's bytes as estimated from the config
alone (no data is read, so the DAG is the same at every parse), and how many of a list of shards
fit in `hidden.cache_gb` (run/split.py splits the run with them).

A sample's estimate is `generation.max_tokens / 2` tokens at the exact bytes per token of the
shard layout (formats/hidden_shard.py) for the target's hidden size. Real shards differ from the
estimate and the split does not move with them: `budget` is a fixed split decided up front, a
guide for the disk, not a cache that evicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

AUX_LAYERS = 3


def hidden_bytes_per_token(config: Mapping[str, Any], hidden_size: int) -> int:
    """Bytes a token takes in a hidden-state shard: the layout formats/hidden_shard.py writes."""
    # Imported here: the rules parse this module, and the shard layout imports torch.
    from eaglenest.formats.hidden_shard import bytes_per_token, tensor_specs
    from eaglenest.settings.hidden_states import HiddenSettings

    settings = HiddenSettings.from_config(config)
    return bytes_per_token(tensor_specs(1, 1, hidden_size, AUX_LAYERS, settings))


def target_hidden_size(config: Mapping[str, Any]) -> int:
    """The target's hidden size: the demo's from its section, else from its config.json."""
    if config["demo_target"]["enabled"]:
        return int(config["demo_target"]["hidden_size"])
    from eaglenest.target_model.loading import load_text_config  # transformers: see above

    try:
        model_config = load_text_config(
            config["target"]["path"], config["target"]["trust_remote_code"]
        )
    except Exception as err:
        raise ValueError(
            f"target.path {config['target']['path']}: its config is not readable here "
            f"({type(err).__name__}); give the target's hidden size with --hidden-size"
        ) from err
    return int(model_config.hidden_size)


def estimated_sample_bytes(config: Mapping[str, Any], hidden_size: int | None = None) -> float:
    """A sample's hidden states as the split estimates them: half of `generation.max_tokens`
    tokens at the shard layout's bytes per token (`hidden_size`: the target's by default)."""
    size = target_hidden_size(config) if hidden_size is None else hidden_size
    return config["generation"]["max_tokens"] / 2 * hidden_bytes_per_token(config, size)


def shards_that_fit(cache_gb: float, shard_bytes: list[float]) -> int:
    """How many of the shards, in order, fit in `cache_gb` GB (1e9 bytes) together."""
    total, fit = 0.0, 0
    for size in shard_bytes:
        total += size
        if total > cache_gb * 1e9:
            break
        fit += 1
    return fit
