"""Facts of the target's tokenizer that every stage agrees on: the think token ids, the end-of-turn
token, the vocabulary size, and loading the tokenizer (local directory or hub name, from the local
cache only)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.common.reasoning import (
    THINK_END,
    THINK_START,
)
from eaglenest.target_model.files import resolve_target_dir, tokenizer_dir
from eaglenest.target_model.remote_code import remote_code_errors

if TYPE_CHECKING:
    from eaglenest.settings.target import TargetSettings

log = logging.getLogger(__name__)


class TokenizeError(RuntimeError):
    """The shard cannot be tokenized as configured; the message says which key or sample."""


def target_vocab_size_of(target: TargetSettings) -> int | None:
    """Rows of the target's embedding, the bound of every token id: config.json `vocab_size`
    (also under `text_config`) of `target.path`, else the tokenizer's length; None when the
    config names neither a path nor a tokenizer (ids are then only checked to be >= 0).

    Read without loading the tokenizer when config.json says it (the embedding, not the
    tokenizer, is what an id must fit: hidden-state extraction looks every id up in it)."""
    model_dir = resolve_target_dir(target.path, "target.path") if target.path else None
    config_json = model_dir / "config.json" if model_dir is not None else None
    if config_json is not None and config_json.is_file():
        config = json.loads(config_json.read_text())
        for section in (config, config.get("text_config") or {}):
            if isinstance(section.get("vocab_size"), int):
                return int(section["vocab_size"])
    if not (target.tokenizer or target.path):
        return None
    from eaglenest.target_model.tokenizer import load_tokenizer  # transformers: only when needed

    return len(load_tokenizer(target))


def tokenizer_path(target: TargetSettings) -> str:
    """The local directory of the target's tokenizer (a hub name resolved in the local cache)."""
    path = tokenizer_dir(target)
    if path is None:
        raise TokenizeError(
            "tokenizing needs the target's tokenizer: set target.tokenizer or target.path"
        )
    return str(path)


def model_dir(target: TargetSettings) -> Path | None:
    """The local directory of target.path (a hub name resolved in the local cache), if set."""
    return resolve_target_dir(target.path, "target.path") if target.path else None


def open_tokenizer(path: str | Path, trust_remote_code: bool, target_name: str = "") -> Any:
    """AutoTokenizer of a local directory; remote code that fails to import is a RemoteCodeError
    naming the target, transformers' version and the import."""
    from transformers import AutoTokenizer

    with remote_code_errors("tokenizer", target_name, Path(path)):
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_tokenizer(target: TargetSettings) -> Any:
    named = target.tokenizer or target.path or ""  # as the config names it
    return open_tokenizer(tokenizer_path(target), target.trust_remote_code, named)


def named_tokenizer_class(tokenizer_dir: str | Path) -> str | None:
    """The tokenizer class the target names (tokenizer_config.json `tokenizer_class`), if any."""
    path = Path(tokenizer_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    named = json.loads(path.read_text()).get("tokenizer_class")
    return named if isinstance(named, str) and named else None


def transformers_class(named: str) -> type | None:
    """transformers' own class of that name (a `Fast` suffix is the same class in transformers
    5, which has one tokenizer class per model), or None: remote code, or unknown."""
    import transformers

    for name in (named, named.removesuffix("Fast")):
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    return None


def check_tokenizer_class(tokenizer: Any, tokenizer_dir: str | Path) -> None:
    """The tokenizer must be of the class the target names (tokenizer_config.json): when that
    class is remote code that did not load, transformers falls back to a generic tokenizer, whose
    special-token ids can differ from the model's. A class transformers knows but replaced itself
    (DeepSeek-V3 names LlamaTokenizerFast over a byte-level tokenizer.json, which transformers 5
    loads as TokenizersBackend) reads the same files: a warning."""
    named = named_tokenizer_class(tokenizer_dir)
    if named is None:
        return
    loaded = type(tokenizer)
    if any(c.__name__.removesuffix("Fast") == named.removesuffix("Fast") for c in loaded.__mro__):
        return
    known = transformers_class(named)
    if known is not None and isinstance(tokenizer, known):  # an alias (PreTrainedTokenizerFast)
        return
    if known is not None:
        log.warning(
            "%s names tokenizer_class %s; transformers loaded %s from the same files",
            Path(tokenizer_dir) / "tokenizer_config.json",
            named,
            loaded.__name__,
        )
        return
    raise TokenizeError(
        f"{Path(tokenizer_dir) / 'tokenizer_config.json'} names tokenizer_class {named}, but "
        f"transformers loaded {loaded.__name__}: the target's own tokenizer did not load (its "
        "class is not transformers': remote code needs target.trust_remote_code), and another "
        "tokenizer's ids need not be the model's"
    )


def _single_token_id(tokenizer: Any, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
        return None
    return int(token_id)


def _generation_eos_id(model_path: str | Path | None) -> tuple[int | None, str]:
    """The first eos id of the model's generation_config.json (what servers stop on), or None
    with the reason there is none."""
    if not model_path:
        return None, "target.path is not set"
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return None, f"{path} does not exist"
    eos = json.loads(path.read_text()).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        return None, f"{path} has no eos_token_id"
    return int(eos), str(path)


def target_vocab_size(tokenizer: Any, model_path: str | Path | None) -> int:
    """Rows of the target's embedding (config.json `vocab_size`, also under `text_config`), which
    may exceed the tokenizer's length; the tokenizer's length when there is no model config."""
    size = len(tokenizer)
    path = Path(model_path) / "config.json" if model_path else None
    if path is not None and path.is_file():
        config = json.loads(path.read_text())
        for section in (config, config.get("text_config") or {}):
            if isinstance(section.get("vocab_size"), int):
                return max(size, int(section["vocab_size"]))
    elif path is not None:
        log.warning("%s does not exist: the target vocabulary is the tokenizer's (%d)", path, size)
    return size


def end_of_turn(
    tokenizer: Any, configured: str | None, model_path: str | Path | None
) -> tuple[str, int, str]:
    """(token, id, where it came from): tokenize.end_of_turn_token, else the model's
    generation_config eos, else the tokenizer's eos."""
    if configured is not None:
        token_id = _single_token_id(tokenizer, configured)
        if token_id is None:
            raise TokenizeError(
                f"tokenize.end_of_turn_token '{configured}' is not a single token of the target's "
                "tokenizer; set it to the token the model ends its turn with (e.g. <|im_end|>)"
            )
        return configured, token_id, "config"
    generation_eos, where = _generation_eos_id(model_path)
    if generation_eos is not None:
        log.info("end of turn: id %d, the first eos of %s", generation_eos, where)
        return tokenizer.convert_ids_to_tokens(generation_eos), generation_eos, "generation_config"
    if tokenizer.eos_token_id is None:
        raise TokenizeError(
            f"no end-of-turn token: the model's generation config gives none ({where}) and the "
            "target's tokenizer has no eos token; set tokenize.end_of_turn_token (e.g. <|im_end|>)"
        )
    # Servers stop on generation_config's eos, which can differ from the tokenizer's (base
    # tokenizers often say <|endoftext|>): say which one the samples end with.
    log.warning(
        "end of turn: the tokenizer's eos %r (id %d), since the model's generation config gives "
        "none (%s); set tokenize.end_of_turn_token if the model ends its turn with another token",
        tokenizer.eos_token,
        tokenizer.eos_token_id,
        where,
    )
    return tokenizer.eos_token, int(tokenizer.eos_token_id), "tokenizer"


def special_token_ids(tokenizer: Any, *extra: int) -> tuple[int, ...]:
    ids = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return tuple(sorted(int(i) for i in ids | set(extra)))


def think_token_ids(
    tokenizer_path: str | None,
    *,
    trust_remote_code: bool = False,
    start: str = THINK_START,
    end: str = THINK_END,
    start_id: int | None = None,
    end_id: int | None = None,
) -> dict[str, Any]:
    """Ids of the think tokens: from config when given, else from the tokenizer (one id each)."""
    result: dict[str, Any] = {"start": start, "end": end, "start_id": start_id, "end_id": end_id}
    if start_id is not None and end_id is not None:
        return result | {"source": "config"}
    if tokenizer_path is None:
        return result | {"source": "unknown (no tokenizer configured)"}
    tokenizer = open_tokenizer(
        resolve_target_dir(tokenizer_path, "target.tokenizer (or target.path)"),
        trust_remote_code,
        tokenizer_path,
    )
    for name, token, override in (("start", start, start_id), ("end", end, end_id)):
        if override is not None:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise TokenizeError(
                f"tokenizer '{tokenizer_path}' has no single token for '{token}': set "
                f"target.think_tokens.{name} to the model's think token or "
                f"target.think_tokens.{name}_id to its id"
            )
        result[f"{name}_id"] = int(token_id)
    return result | {"source": "tokenizer"}
