"""Reading a config file, and the shape every config must have before the schema walks it.

PyYAML's safe loader lets three things through that a config never means: a key written twice
in one mapping (the first silently dropped: a section written twice lost its first half), an
alias bomb (nine lines of anchors expand to 10^9 values, which the finite-number check then
walks for hours) and nesting thousands deep (RecursionError in every walk after it). The file
reader refuses the first, naming the key, its line and the file; `check_shape` refuses the other
two on the values themselves, so a config Snakemake loaded with its own loader is held to it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# A config is a few hundred values, nested five or six deep; a prompt set's data_files list or
# an extra_body may hold some thousands. Anchors that expand past this are a bomb, not a config.
MAX_VALUES = 100_000
MAX_DEPTH = 32


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type; the message names the key."""


_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a key that a mapping already holds."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the base loader says so, with its line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(key, first, again)
        self.key, self.first, self.again = key, first, again


def read_config_file(path: str | Path) -> dict[str, Any]:
    """One `--configfile`: a YAML mapping of sections (empty: none), or a ConfigError naming the
    file and what is wrong: unreadable, not UTF-8, not YAML, a key written twice, an alias bomb
    or nesting past MAX_DEPTH, or a value other than a mapping."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {path}: not UTF-8 ({err.reason} at byte {err.start}); save it as UTF-8"
        ) from None
    values = _load(path, text)
    if values is not None and not isinstance(values, dict):
        raise ConfigError(
            f"config file {path}: holds a {type(values).__name__}, not a mapping of config "
            "sections (run:, prompts:, ...)"
        )
    try:
        check_shape(values or {})
    except ValueError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    return values or {}


def _load(path: str | Path, text: str) -> Any:
    loader = _UniqueKeyLoader(text)
    try:
        # Composed first and checked before anything is built from it: an alias bomb's nodes
        # are few, its expansion is what is huge.
        node = loader.get_single_node()
        if node is None:
            return None
        check_node_shape(node)
        return loader.construct_document(node)
    except _DuplicateKey as err:
        raise ConfigError(
            f"config file {path}: key {err.key!r} written twice in one mapping (lines "
            f"{err.first} and {err.again}); YAML keeps only the last, so give it once"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path}: not valid YAML: {err}") from None
    except ValueError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    except RecursionError:  # the pure-Python composer, past Python's recursion limit
        raise ConfigError(f"config file {path}: {_too_deep('')}") from None
    finally:
        loader.dispose()


def check_node_shape(root: yaml.Node) -> None:
    """The composed YAML within MAX_DEPTH and MAX_VALUES once its aliases are expanded
    (ValueError); each node is sized once, so the check costs the file, not the expansion."""
    _check_sizes(root, lambda node: node.value if isinstance(node, yaml.CollectionNode) else ())


def check_shape(config: Any) -> None:
    """The config's values within MAX_DEPTH and MAX_VALUES, a list or mapping shared by
    reference (a YAML alias) counted each time it appears, and none inside itself (ValueError)."""
    _check_sizes(config, _children)


def _children(value: Any) -> Any:
    if isinstance(value, dict):
        return value.items()
    return value if isinstance(value, list) else ()


def _check_sizes(root: Any, children: Any) -> None:
    """Depth-first without recursion: a stack of (node, its pending (key, child) pairs, its key
    path, its expanded size so far); `sizes` memoises each collection's size by identity."""
    sizes: dict[int, int] = {}
    stack: list[list[Any]] = [[root, iter(_pairs(children(root))), "", 1]]
    on_stack = {id(root)}
    while stack:
        node, pending, where, _ = top = stack[-1]
        for key, child in pending:
            path = _path(where, key)
            if not _pairs(children(child)):
                top[3] += 1
            elif id(child) in sizes:
                top[3] += sizes[id(child)]
            elif id(child) in on_stack:
                raise ValueError(
                    f"{_named(path)}: refers to itself (a YAML alias inside its anchor)"
                )
            elif len(stack) >= MAX_DEPTH:
                raise ValueError(_too_deep(path))
            else:
                stack.append([child, iter(_pairs(children(child))), path, 1])
                on_stack.add(id(child))
                break
            _check_total(sum(entry[3] for entry in stack), path)
        else:
            stack.pop()
            on_stack.discard(id(node))
            sizes[id(node)] = top[3]
            if stack:
                stack[-1][3] += top[3]


def _path(where: str, key: Any) -> str:
    if isinstance(key, str) and key.startswith("["):
        return where + key
    return f"{where}.{key}" if where else str(key)


def _pairs(items: Any) -> list[tuple[Any, Any]]:
    """(key, child) of a mapping's items (YAML node pairs: the key node's value) or a list's."""
    pairs = []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            key, child = item
            pairs.append((getattr(key, "value", key), child))
        else:
            pairs.append((f"[{i}]", item))
    return pairs


def _check_total(total: int, where: str) -> None:
    if total > MAX_VALUES:
        raise ValueError(
            f"{_named(where)}: expands to more than {MAX_VALUES:,} values (YAML aliases repeating "
            "anchors inside each other); write the values out, or fewer of them"
        )


def _too_deep(where: str) -> str:
    return (
        f"{_named(where)}: nested more than {MAX_DEPTH} levels deep (lists or mappings inside "
        "each other); a config's sections are a few levels"
    )


def _named(where: str) -> str:
    return f"config key '{where}'" if where else "the config"
