"""What `hidden.store: budget` weighs: a hidden-state shard's bytes as estimated from the config
alone (no data is read, so the DAG is the same at every parse), and how many of a list of shards
fit in `hidden.cache_gb` (run/split.py splits the run with them).

A sample's estimate is `generation.max_tokens / 2` tokens at the exact bytes per token of the
shard layout (formats/hidden_shard.py) for the target's hidden size. Real shards differ from the
estimate and the split does not move with them: `budget` is a fixed split decided up front, a
guide for the disk, not a cache that evicts or measures itself into `cache_gb` (a split that
moved with the files written would change the training's inputs, and rerun it, at the next
run). What it does measure: the shards already written (`measured_shard_bytes`), set against
`cache_gb` and the estimate by `budget_warnings`, with a warning when not one shard fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def hidden_bytes_per_token(config: Mapping[str, Any], hidden_size: int) -> int:
    """Bytes a token takes in a hidden-state shard: the layout formats/hidden_shard.py writes,
    with the captured layers' n (`captured_layer_count`) in its aux [T, n·H]."""
    # Imported here: the rules parse this module, and the shard layout imports torch.
    from eaglenest.formats.hidden_shard import bytes_per_token, tensor_specs
    from eaglenest.settings.hidden_states import HiddenSettings

    settings = HiddenSettings.from_config(config)
    n_aux = captured_layer_count(config)
    return bytes_per_token(tensor_specs(1, 1, hidden_size, n_aux, settings))


def captured_layer_count(config: Mapping[str, Any]) -> int:
    """The layers the capture keeps: hidden.aux_layer_ids', else the union of train.families'
    defaults for the target's layers (settings/families.py `captured_layer_ids`; vLLM's three
    where no other family's default is asked, whatever the target)."""
    from eaglenest.settings.families import captured_layer_ids
    from eaglenest.settings.hidden_states import HiddenSettings

    settings = HiddenSettings.from_config(config)
    if settings.aux_layer_ids is not None:
        return len(settings.aux_layer_ids)
    if settings.layer_rules == ("vllm",):
        return 3
    layers = config["demo_target"]["num_layers"] if config["demo_target"]["enabled"] else None
    if layers is None:
        flags = "--num-layers N (its decoder layers) or --set hidden.aux_layer_ids=[...]"
        layers = target_text_config(config, flags).num_hidden_layers
    return len(captured_layer_ids(None, settings.layer_rules, layers))


def with_captured_layers(config: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    """`config` with a null hidden.aux_layer_ids set to what the capture would keep of a target
    of `num_hidden_layers` (`eaglenest plan --num-layers`, for a target not on disk)."""
    from eaglenest.settings.families import captured_layer_ids
    from eaglenest.settings.hidden_states import HiddenSettings

    hidden = config["hidden"]
    if hidden["aux_layer_ids"] is not None:
        return dict(config)
    rules = HiddenSettings.from_config(config).layer_rules
    layers = list(captured_layer_ids(None, rules, num_hidden_layers))
    return {**config, "hidden": {**hidden, "aux_layer_ids": layers}}


def target_hidden_size(config: Mapping[str, Any]) -> int:
    """The target's hidden size: the demo's from its section, else from its config.json."""
    if config["demo_target"]["enabled"]:
        return int(config["demo_target"]["hidden_size"])
    return int(target_text_config(config, "--hidden-size").hidden_size)


def target_text_config(config: Mapping[str, Any], flags: str) -> Any:
    """The target's (text) config, or a ValueError naming the `eaglenest plan` flags that
    stand in for it."""
    from eaglenest.target_model.loading import load_text_config  # transformers: see above

    try:
        return load_text_config(config["target"]["path"], config["target"]["trust_remote_code"])
    except Exception as err:
        raise ValueError(
            f"target.path {config['target']['path']}: its config is not readable here "
            f"({type(err).__name__}); give the target's sizes with {flags}"
        ) from err


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


def measured_shard_bytes(hidden_dir: str | Path, shards: Iterable[str]) -> dict[str, int]:
    """The bytes of the hidden-state files of `shards` already written in `hidden_dir`."""
    sizes = {}
    for shard in shards:
        path = Path(hidden_dir) / f"{shard}.safetensors"
        if path.is_file():
            sizes[shard] = path.stat().st_size
    return sizes


def budget_warnings(
    cache_gb: float,
    training_bytes: list[float],
    stored: list[str],
    measured: Mapping[str, int],
) -> list[str]:
    """What a user of `hidden.store: budget` should know: that no shard fits (every state then
    comes from the servers, as with none), and how the stored shards written so far weigh
    against their estimate and `cache_gb`. `training_bytes`: the estimates of the training
    shards in order; `stored`: those the split stores; `measured`: written files' bytes."""
    notes = []
    if not stored and training_bytes:
        notes.append(
            f"hidden.store budget: hidden.cache_gb {cache_gb:g} holds not one shard (the first "
            f"is estimated at {training_bytes[0] / 1e9:,.3g} GB): every training shard's states "
            "come from the capture servers every epoch, as with hidden.store none"
        )
    written = [s for s in stored if s in measured]
    if written:
        total = sum(measured[s] for s in written)
        estimate = sum(training_bytes[i] for i, s in enumerate(stored) if s in measured)
        over = total > cache_gb * 1e9
        notes.append(
            f"hidden.store budget: the {len(written)} stored shard(s) written so far take "
            f"{total / 1e9:,.3g} GB measured against {estimate / 1e9:,.3g} GB estimated"
            + (
                f", over hidden.cache_gb {cache_gb:g}: the split is fixed from the config, so "
                "lower cache_gb (or generation.max_tokens) to store fewer"
                if over
                else f" (hidden.cache_gb {cache_gb:g})"
            )
        )
    return notes
