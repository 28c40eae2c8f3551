"""`eaglenest plan`, the command: its flags, each checked (a positive, finite number, the flag
named when not), the config with `--set` overrides, and the plan printed (run/plan.py)."""

from __future__ import annotations

import math
from typing import Any

from eaglenest.run.plan import DEFAULT_CACHE_GB, DEMO_RATES, Assumptions, Rates, plan_run
from eaglenest.run.plan_text import format_plan
from eaglenest.run.store import target_hidden_size, with_captured_layers


def add_arguments(parser: Any) -> None:
    parser.add_argument("--configfile", nargs="+", required=True, help="the run's config files")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. prompts.max_samples=500000 (repeatable)",
    )
    parser.add_argument("--samples", type=whole_number, help="prompts.max_samples")
    parser.add_argument("--tokens-per-sample", type=float, help="default: generation.max_tokens/2")
    parser.add_argument("--hidden-size", type=int, help="default: the target's config")
    parser.add_argument(
        "--num-layers",
        type=int,
        help="the target's decoder layers, which set the captured layers' count where "
        "hidden.aux_layer_ids is null; default: the target's config",
    )
    parser.add_argument("--cache-gb", type=float, help="hidden.cache_gb of the budget mode")
    for name, help_text in (
        ("generate", "per endpoint"),
        ("capture", "per capture engine"),
        ("train", "per training process (GPU)"),
    ):
        key = f"{name}_tokens_per_s"
        parser.add_argument(
            f"--{name}-tokens-per-s",
            type=float,
            default=DEMO_RATES[key],
            help=f"{help_text}; default {DEMO_RATES[key]:,.0f}: the CPU demo's, two cores",
        )


def overridden(config: dict[str, Any], settings: list[str]) -> dict[str, Any]:
    """`config` with `section.key=value` overrides (values read as YAML)."""
    import yaml

    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return config


# The numeric flags, each a positive, finite number when given: a zero rate was a traceback,
# negative ones printed negative disk and hours, and zeros were read as "not given".
NUMBERS = (
    "samples",
    "tokens_per_sample",
    "hidden_size",
    "num_layers",
    "cache_gb",
    "generate_tokens_per_s",
    "capture_tokens_per_s",
    "train_tokens_per_s",
)


def whole_number(text: str) -> int | float:
    """A count as users write it, 500000 or 5e5; a fraction or NaN is left for check_numbers and
    the config check to refuse by name."""
    try:
        return int(text)
    except ValueError:
        value = float(text)  # argparse names the flag when this fails too
        return int(value) if value.is_integer() else value


def check_numbers(args: Any) -> None:
    for name in NUMBERS:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: a positive, finite number")


def run(args: Any) -> int:
    import yaml

    from eaglenest.common.config import ConfigError, merged_config, validate_config

    try:
        check_numbers(args)
        config = merged_config(args.configfile)
        samples = [] if args.samples is None else [f"prompts.max_samples={args.samples}"]
        config = overridden(yaml.safe_load(yaml.safe_dump(config)), list(args.set) + samples)
        validate_config(config)
        if args.num_layers:
            config = with_captured_layers(config, args.num_layers)
        hidden_size = args.hidden_size or target_hidden_size(config)
        tokens_per_sample = args.tokens_per_sample or config["generation"]["max_tokens"] / 2
        cache_gb = args.cache_gb or config["hidden"].get("cache_gb") or DEFAULT_CACHE_GB
        rates = Rates(
            args.generate_tokens_per_s, args.capture_tokens_per_s, args.train_tokens_per_s
        )
        # the split refuses a config that holds out every shard, naming train.eval_shards
        plan = plan_run(config, Assumptions(tokens_per_sample, hidden_size, rates, cache_gb))
    except (ConfigError, ValueError) as err:
        print(f"eaglenest plan: {err}")
        return 2
    print(format_plan(plan))
    return 0
