"""Which training shards `hidden.store: budget` stores as files: the first ones that fit in
`hidden.cache_gb`, decided from the config alone, so the DAG is the same at every parse whatever
the data (the rest come from the capture servers every epoch; held-out shards always do).

A shard's size is the plan's estimate (common/plan.py, `eaglenest plan`): `prompts.shard_size`
samples of `generation.max_tokens / 2` tokens, at the exact bytes per token of the shard layout
(formats/hidden_shard.py) for the target's hidden size. Real shards differ from the estimate;
the split does not move with them (a budget is a guide, the disk's own limit is the hard one).
"""

from __future__ import annotations

from typing import Any

AUX_LAYERS = 3


def hidden_bytes_per_token(config: dict[str, Any], hidden_size: int) -> int:
    """Bytes a token takes in a hidden-state shard: the layout formats/hidden_shard.py writes."""
    from eaglenest.formats.hidden_shard import bytes_per_token, tensor_specs
    from eaglenest.settings.hidden_states import HiddenSettings

    settings = HiddenSettings.from_config(config)
    return bytes_per_token(tensor_specs(1, 1, hidden_size, AUX_LAYERS, settings))


def target_hidden_size(config: dict[str, Any]) -> int:
    """The target's hidden size: the demo's from its section, else from its config.json."""
    if config["demo_target"]["enabled"]:
        return int(config["demo_target"]["hidden_size"])
    from eaglenest.target_model.loading import load_text_config

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


def shards_that_fit(cache_gb: float, shard_bytes: float, shards: int) -> int:
    """How many shards of `shard_bytes` fit in `cache_gb` GB (1e9 bytes), at most `shards`."""
    if shard_bytes <= 0:
        return shards
    return max(0, min(shards, int(cache_gb * 1e9 // shard_bytes)))


def estimated_shard_bytes(config: dict[str, Any], hidden_size: int) -> float:
    """A hidden-state shard's bytes as the plan estimates them (see the module's docstring)."""
    tokens = config["prompts"]["shard_size"] * config["generation"]["max_tokens"] / 2
    return tokens * hidden_bytes_per_token(config, hidden_size)


def stored_training_shards(config: dict[str, Any], training_shards: list[str]) -> list[str]:
    """The training shards stored as files under the config's `hidden.store`: all of them
    (files), none (none), or the first that fit in `hidden.cache_gb` (budget)."""
    store = config["hidden"]["store"]
    if store == "files":
        return list(training_shards)
    if store == "none":
        return []
    shard_bytes = estimated_shard_bytes(config, target_hidden_size(config))
    fit = shards_that_fit(config["hidden"]["cache_gb"], shard_bytes, len(training_shards))
    return list(training_shards[:fit])
