"""Hidden states of the target, packed per shard and streamed to disk (the `hidden` stage).

For every sample of a tokens shard the target runs once and we keep:
- `aux` [T, 3H]: the INPUT of the decoder layers `aux_layer_ids` (vLLM's
  `eagle_aux_hidden_state_layer_ids`, default (2, N//2, N-3)) = transformers
  `output_hidden_states[k]`, captured with forward pre-hooks (all hidden states are never kept);
- the target signal of the loss: `final_hidden` [T, H] (output of the final norm) or the top-k
  logits (`topk_ids` int32 + `topk_values` float32, [T, k]); the LM head runs only for top-k;
- `input_ids` [T] int64, `loss_mask` [T] uint8 and `offsets` [N+1] int64 (sample i is rows
  offsets[i]:offsets[i+1]), samples in the order of the tokens shard.

Storage dtypes of aux/final_hidden: `bf16`, `fp32` (exact; tests) or `fp8` = float8_e4m3fn with a
float32 scale per token and per layer block (`aux_scale` [T, 3], `final_hidden_scale` [T]),
scale = amax / 448, so each layer's row keeps its own range (layers differ in magnitude).

The file is a plain safetensors file laid out before the forward passes (shapes follow from the
tokens shard), then filled in place with positioned writes as batches come: memory stays bounded
by one batch whatever the shard size. Positioned writes (os.pwrite) rather than a memmap, because
a memmap's dirty pages count in the job's resident memory until they are flushed. It is written
to a temporary file beside the target and renamed at the end, so a killed job leaves nothing that
passes as complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from eaglenest.io import atomic_path, write_json
from eaglenest.target_files import resolve_target_dir
from eaglenest.tokenize import loss_mask

log = logging.getLogger(__name__)

FORMAT = "eaglenest-hidden/1"
FP8_MAX = 448.0
TOPK_CHUNK_ROWS = 2048  # rows of logits computed at once for top-k  # largest finite float8_e4m3fn
STORAGE_DTYPES = ("bf16", "fp8", "fp32")
# safetensors dtype name, torch dtype, bytes per element
_ST_DTYPES = {
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "U8": (torch.uint8, 1),
}
_MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HiddenSettings:
    aux_layer_ids: tuple[int, ...] | None = None
    target_signal: str = "final_hidden"
    top_k: int = 32
    dtype: str = "bf16"
    model_dtype: str = "auto"
    max_batch_tokens: int = 16384
    device: str = "auto"

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> HiddenSettings:
        values = {k: section[k] for k in cls.__dataclass_fields__ if k in section}
        if values.get("aux_layer_ids") is not None:
            values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
        return cls(**values)


# --- small helpers ----------------------------------------------------------------------------


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, int, int]:
    """vLLM's default `eagle_aux_hidden_state_layer_ids`."""
    n = num_hidden_layers
    return (2, n // 2, n - 3)


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def target_config_hash(target_path: str | Path) -> str:
    return sha256_file(resolve_target_dir(target_path) / "config.json")


def library_versions() -> dict[str, str]:
    import transformers

    import eaglenest

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "eaglenest": eaglenest.__version__,
    }


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_model_dtype(model_dtype: str, device: str) -> torch.dtype:
    if model_dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _MODEL_DTYPES[model_dtype]


def load_target(path: str | Path, settings: HiddenSettings, trust_remote_code: bool = False):
    """The target in eval mode, on the configured device (device_map=auto over several GPUs)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(settings.device)
    dtype = resolve_model_dtype(settings.model_dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    several_gpus = device == "cuda" and torch.cuda.device_count() > 1
    if several_gpus:
        kwargs["device_map"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(str(resolve_target_dir(path)), **kwargs)
    if not several_gpus:
        model.to(device)
    model.eval()
    return model


def decoder_layers(model) -> Any:
    return model.model.layers


# --- batching ---------------------------------------------------------------------------------


def pack_batches(lengths: list[int] | np.ndarray, max_batch_tokens: int) -> list[list[int]]:
    """Sample indices in batches, longest first, each under max_batch_tokens padded tokens
    (batch size x its longest sample); a sample longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) + 1) * longest > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


# --- capture ----------------------------------------------------------------------------------


class AuxCapture:
    """Forward pre-hooks that keep the input of the chosen decoder layers."""

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.layer_ids = layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        self.handles = [
            layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True) for k in layer_ids
        ]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            self.captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def take(self) -> list[torch.Tensor]:
        states = [self.captured.pop(k) for k in self.layer_ids]
        return states

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.inference_mode()
def forward_batch(
    model, capture: AuxCapture, batch_ids: list[np.ndarray], settings: HiddenSettings
) -> dict[str, torch.Tensor]:
    """One right-padded batch through the target: padded [B, L, ...] tensors on the model's device."""
    device = model.model.embed_tokens.weight.device
    longest = max(len(ids) for ids in batch_ids)
    input_ids = torch.zeros((len(batch_ids), longest), dtype=torch.long)
    attention_mask = torch.zeros((len(batch_ids), longest), dtype=torch.long)
    for row, ids in enumerate(batch_ids):
        input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    outputs = model.model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    )
    final = outputs.last_hidden_state  # output of model.model.norm
    aux = capture.take()
    result = {"aux": torch.cat([a.to(final.device) for a in aux], dim=-1)}
    if settings.target_signal == "topk":
        # Logits a chunk of rows at a time: [B, L, V] in float32 would not fit for a large vocabulary.
        rows = final.reshape(-1, final.shape[-1])
        values, ids = [], []
        for chunk in rows.split(TOPK_CHUNK_ROWS):
            top = torch.topk(model.lm_head(chunk).float(), settings.top_k, dim=-1)
            values.append(top.values)
            ids.append(top.indices.to(torch.int32))
        shape = (*final.shape[:2], settings.top_k)
        result["topk_ids"] = torch.cat(ids).reshape(shape)
        result["topk_values"] = torch.cat(values).reshape(shape)
    else:
        result["final_hidden"] = final
    # One transfer per batch, not one per sample and tensor.
    return {name: value.cpu() for name, value in result.items()}


# --- the file layout --------------------------------------------------------------------------


def tensor_specs(
    n_samples: int, n_tokens: int, hidden_size: int, n_aux: int, settings: HiddenSettings
) -> list[tuple[str, str, list[int]]]:
    """(name, safetensors dtype, shape) of every tensor of a shard file, in file order."""
    stored = {"bf16": "BF16", "fp8": "F8_E4M3", "fp32": "F32"}[settings.dtype]
    specs = [("aux", stored, [n_tokens, n_aux * hidden_size])]
    if settings.dtype == "fp8":
        specs.append(("aux_scale", "F32", [n_tokens, n_aux]))
    if settings.target_signal == "topk":
        specs += [
            ("topk_ids", "I32", [n_tokens, settings.top_k]),
            ("topk_values", "F32", [n_tokens, settings.top_k]),
        ]
    else:
        specs.append(("final_hidden", stored, [n_tokens, hidden_size]))
        if settings.dtype == "fp8":
            specs.append(("final_hidden_scale", "F32", [n_tokens]))
    specs += [
        ("input_ids", "I64", [n_tokens]),
        ("loss_mask", "U8", [n_tokens]),
        ("offsets", "I64", [n_samples + 1]),
    ]
    return specs


def safetensors_header(
    specs: list[tuple[str, str, list[int]]], metadata: dict[str, str]
) -> tuple[bytes, dict[str, int]]:
    """The header bytes (8-byte length + JSON padded to 8 bytes) and each tensor's file offset."""
    header: dict[str, Any] = {"__metadata__": metadata}
    begin = 0
    for name, dtype, shape in specs:
        size = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + size]}
        begin += size
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    data_start = 8 + len(text)
    positions = {name: data_start + header[name]["data_offsets"][0] for name, _, _ in specs}
    positions["__end__"] = data_start + begin
    return struct.pack("<Q", len(text)) + text, positions


def fp8_quantize(x: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, blocks*H] -> float8_e4m3fn values and float32 scales [T, blocks] (amax / 448)."""
    rows = x.float().reshape(x.shape[0], blocks, -1)
    scale = rows.abs().amax(dim=-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (rows / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape[0], -1), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = scale.shape[-1] if scale.dim() == 2 else 1
    rows = q.float().reshape(q.shape[0], blocks, -1)
    return (rows * scale.reshape(q.shape[0], blocks, 1)).reshape(q.shape[0], -1)


def _as_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn):
        t = t.view(torch.uint8)
    return t.numpy().tobytes()


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """`os.pwrite` until every byte is written: one call may write less (Linux stops at
    0x7ffff000 bytes, ~2 GiB, and one 32K-token sample of fp32 aux at H=7168 is 2.8 GB)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:  # no progress: a retry would loop forever
            raise OSError(f"pwrite wrote {written} bytes at offset {offset} ({len(view)} left)")
        view, offset = view[written:], offset + written


class ShardWriter:
    """Positioned writes of one sample's rows into the laid-out file."""

    def __init__(self, fd: int, specs, positions: dict[str, int], settings: HiddenSettings):
        self.fd = fd
        self.positions = positions
        self.row_bytes = {
            name: int(np.prod(shape[1:], dtype=np.int64)) * _ST_DTYPES[dtype][1]
            for name, dtype, shape in specs
        }
        self.stored = {name: dtype for name, dtype, _ in specs}
        self.settings = settings

    def write(self, name: str, first_row: int, values: torch.Tensor) -> None:
        data = _as_bytes(values)
        pwrite_all(self.fd, data, self.positions[name] + first_row * self.row_bytes[name])

    def write_states(self, name: str, first_row: int, values: torch.Tensor, blocks: int) -> None:
        """aux / final_hidden rows in the storage dtype (with their scales for fp8)."""
        dtype = self.stored[name]
        if dtype == "F8_E4M3":
            q, scale = fp8_quantize(values, blocks)
            self.write(name, first_row, q)
            self.write(f"{name}_scale", first_row, scale if blocks > 1 else scale[:, 0])
        else:
            self.write(name, first_row, values.to(_ST_DTYPES[dtype][0]))


# --- the stage --------------------------------------------------------------------------------


def read_tokens(tokens_path: str | Path) -> pl.DataFrame:
    return pl.read_parquet(tokens_path, columns=["id", "input_ids", "prompt_len", "n_tokens"])


def shard_metadata(
    *,
    model,
    target_path: str | Path,
    target_name: str,
    layer_ids: tuple[int, ...],
    settings: HiddenSettings,
    tokens_sha256: str,
    sample_ids: list[str],
    model_dtype: torch.dtype,
) -> dict[str, str]:
    return {
        "format": FORMAT,
        "target_name": target_name,
        "target_path": str(target_path),
        "target_config_sha256": target_config_hash(target_path),
        "aux_layer_ids": json.dumps(list(layer_ids)),
        "num_hidden_layers": str(model.config.num_hidden_layers),
        "hidden_size": str(model.config.hidden_size),
        "vocab_size": str(model.config.vocab_size),
        "dtype": settings.dtype,
        "model_dtype": str(model_dtype).removeprefix("torch."),
        "target_signal": settings.target_signal,
        "top_k": str(settings.top_k),
        "tokens_sha256": tokens_sha256,
        "versions": json.dumps(library_versions(), sort_keys=True),
        "sample_ids": json.dumps(sample_ids),
    }


def extract_hidden_states(
    *,
    tokens: str | Path,
    target_path: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    target_name: str = "",
    trust_remote_code: bool = False,
    summary_out: str | Path | None = None,
    model=None,
) -> dict[str, Any]:
    """Run the target over a tokens shard and write its hidden-state shard; returns the summary."""
    started = time.perf_counter()
    frame = read_tokens(tokens)
    if model is None:
        model = load_target(target_path, settings, trust_remote_code)
    n_layers = model.config.num_hidden_layers
    hidden_size = model.config.hidden_size
    layer_ids = settings.aux_layer_ids or default_aux_layer_ids(n_layers)
    if len(layer_ids) != 3 or not all(0 <= k < n_layers for k in layer_ids):
        raise ValueError(f"hidden.aux_layer_ids {list(layer_ids)}: need 3 ids in [0, {n_layers})")
    if settings.target_signal == "topk" and settings.top_k > model.config.vocab_size:
        raise ValueError(f"hidden.top_k {settings.top_k} > vocabulary {model.config.vocab_size}")

    lengths = frame["n_tokens"].to_numpy()
    offsets = np.zeros(len(frame) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n_tokens = int(offsets[-1])
    specs = tensor_specs(len(frame), n_tokens, hidden_size, len(layer_ids), settings)
    metadata = shard_metadata(
        model=model,
        target_path=target_path,
        target_name=target_name,
        layer_ids=tuple(layer_ids),
        settings=settings,
        tokens_sha256=sha256_file(tokens),
        sample_ids=frame["id"].to_list(),
        model_dtype=next(model.parameters()).dtype,
    )
    header, positions = safetensors_header(specs, metadata)
    capture = AuxCapture(model, tuple(layer_ids))
    forward_s = 0.0
    try:
        with atomic_path(out) as tmp, open(tmp, "r+b") as f:
            f.truncate(positions["__end__"])
            fd = f.fileno()
            pwrite_all(fd, header, 0)
            writer = ShardWriter(fd, specs, positions, settings)
            writer.write("offsets", 0, torch.from_numpy(offsets))
            input_ids = frame["input_ids"].to_list()
            prompt_lens = frame["prompt_len"].to_list()
            for batch in pack_batches(lengths, settings.max_batch_tokens):
                batch_ids = [np.asarray(input_ids[i], dtype=np.int64) for i in batch]
                tick = time.perf_counter()
                result = forward_batch(model, capture, batch_ids, settings)
                forward_s += time.perf_counter() - tick
                for row, i in enumerate(batch):
                    first, n = int(offsets[i]), int(lengths[i])
                    writer.write_states("aux", first, result["aux"][row, :n], len(layer_ids))
                    if settings.target_signal == "topk":
                        writer.write("topk_ids", first, result["topk_ids"][row, :n])
                        writer.write("topk_values", first, result["topk_values"][row, :n])
                    else:
                        writer.write_states(
                            "final_hidden", first, result["final_hidden"][row, :n], 1
                        )
                    writer.write("input_ids", first, torch.from_numpy(batch_ids[row]))
                    mask = loss_mask(prompt_lens[i], n).astype(np.uint8)
                    writer.write("loss_mask", first, torch.from_numpy(mask))
            f.flush()
            os.fsync(fd)
            check_readable(tmp)
    finally:
        capture.remove()
    seconds = time.perf_counter() - started
    size = Path(out).stat().st_size
    summary = {
        "samples": len(frame),
        "tokens": n_tokens,
        "bytes": size,
        "bytes_per_token": size / n_tokens if n_tokens else None,
        "hidden_size": hidden_size,
        "aux_layer_ids": list(layer_ids),
        "dtype": settings.dtype,
        "target_signal": settings.target_signal,
        "seconds": round(seconds, 3),
        "forward_seconds": round(forward_s, 3),
        "tokens_per_s": round(n_tokens / seconds, 1) if seconds else None,
    }
    log.info(
        "hidden states: %d samples, %d tokens, %.1f bytes/token (%s, %s), %.1f tokens/s",
        len(frame), n_tokens, summary["bytes_per_token"] or 0, settings.dtype,
        settings.target_signal, summary["tokens_per_s"] or 0,
    )  # fmt: skip
    if summary_out is not None:
        write_json(summary_out, summary)
    return summary


def check_readable(path: str | Path) -> None:
    """The file opens with safetensors and every tensor is where its header says."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            f.get_slice(name).get_shape()


# --- the target head (once per run) -----------------------------------------------------------


class TargetHeadError(RuntimeError):
    """The target's checkpoint does not hold the head as expected; the message names the file."""


# The head's tensors in the checkpoint, by name with any prefix (multimodal wrappers such as
# Kimi-K2.5 put the language model under `language_model.`; transformers' own ones use
# `model.language_model.`), and how an error describes them.
HEAD_TENSORS = {
    "embed_tokens.weight": (
        re.compile(r"^(?:.+\.)?(?:model|language_model)\.embed_tokens\.weight$"),
        "model.embed_tokens.weight or language_model.embed_tokens.weight",
    ),
    "norm.weight": (
        re.compile(r"^(?:.+\.)?(?:model|language_model)\.norm\.weight$"),
        "model.norm.weight or language_model.norm.weight",
    ),
    "lm_head.weight": (re.compile(r"^(?:.+\.)?lm_head\.weight$"), "lm_head.weight"),
}
# Towers of multimodal targets, whose tensors may end like the language model's.
_TOWER_TENSOR = re.compile(
    r"(?:^|\.)(?:vision|visual|audio|speech|mm_projector|multi_modal_projector)[^.]*\."
)


def checkpoint_weight_map(target_dir: Path) -> tuple[dict[str, str], Path]:
    """(tensor name -> safetensors file, the file that says so): the index of a sharded
    checkpoint, else the single `model.safetensors`."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"], index
    single = target_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single.name), single
    raise TargetHeadError(
        f"{target_dir}: neither model.safetensors.index.json nor model.safetensors; the target "
        "head is read from the checkpoint's safetensors files"
    )


def find_head_tensors(weight_map: dict[str, str], listing: Path) -> dict[str, str | None]:
    """Checkpoint name of each head tensor (None when absent); several candidates are an error."""
    found: dict[str, str | None] = {}
    for name, (pattern, _) in HEAD_TENSORS.items():
        matches = sorted(k for k in weight_map if pattern.match(k) and not _TOWER_TENSOR.search(k))
        if len(matches) > 1:
            raise TargetHeadError(
                f"{listing}: several tensors could be the target's {name}: {matches}"
            )
        found[name] = matches[0] if matches else None
    return found


def read_checkpoint_tensors(
    target_dir: Path, weight_map: dict[str, str], listing: Path, names: dict[str, str]
) -> dict[str, torch.Tensor]:
    """{our name: tensor} read by checkpoint name, opening each safetensors file once."""
    from safetensors import safe_open

    by_file: dict[str, dict[str, str]] = {}
    for ours, key in names.items():
        by_file.setdefault(weight_map[key], {})[ours] = key
    tensors = {}
    for file_name, wanted in by_file.items():
        path = target_dir / file_name
        if not path.is_file():
            raise TargetHeadError(
                f"{listing} puts {sorted(wanted.values())} in {path}: no such file"
            )
        with safe_open(str(path), framework="pt") as f:
            for ours, key in wanted.items():
                tensor = f.get_tensor(key)
                if not tensor.is_floating_point() or tensor.element_size() < 2:
                    raise TargetHeadError(
                        f"{path}: {key} is {tensor.dtype}; the target head needs unquantized "
                        "weights (bf16, fp16 or fp32)"
                    )
                tensors[ours] = tensor.contiguous()
    return tensors


def checkpoint_head_tensors(
    target_dir: str | Path, tied_config: bool
) -> tuple[dict[str, torch.Tensor], bool]:
    """(embedding, final norm and LM head unless tied, whether tied), read by name from the
    target's safetensors files: only these tensors are read, the model is never built.

    Tying follows transformers: with `tie_word_embeddings` the LM head is the embedding, unless
    the checkpoint holds both with different values (then they stay apart, as transformers
    leaves them); without it the checkpoint must hold the LM head."""
    target_dir = Path(target_dir)
    weight_map, listing = checkpoint_weight_map(target_dir)
    names = find_head_tensors(weight_map, listing)
    if tied_config and names["embed_tokens.weight"] is None:
        names["embed_tokens.weight"] = names["lm_head.weight"]  # transformers ties either way
    wanted = ["embed_tokens.weight", "norm.weight"] + ([] if tied_config else ["lm_head.weight"])
    missing = [name for name in wanted if names[name] is None]
    if missing:
        looked_for = "; ".join(f"{name}: {HEAD_TENSORS[name][1]}" for name in missing)
        tie = "" if tied_config else " (config.json: tie_word_embeddings is false)"
        raise TargetHeadError(
            f"{listing}: no tensor for the target's {', '.join(missing)}{tie}; looked for "
            f"{looked_for} (with any prefix, e.g. language_model.)"
        )
    present = {name: key for name, key in names.items() if key is not None}
    tensors = read_checkpoint_tensors(target_dir, weight_map, listing, present)
    head = tensors.get("lm_head.weight")
    tied = tied_config and (head is None or torch.equal(head, tensors["embed_tokens.weight"]))
    if tied_config and not tied:
        log.warning(
            "%s: config.json ties the LM head to the embedding, but the checkpoint holds both "
            "with different values; as transformers does, they stay apart",
            listing,
        )
    if tied:
        tensors.pop("lm_head.weight", None)
    log.info("target head from %s: %s", listing, {n: present[n] for n in sorted(tensors)})
    return tensors, tied


def save_target_head(
    *,
    target_path: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    trust_remote_code: bool = False,
) -> dict[str, str]:
    """Input embedding, LM head (unless tied to the embedding) and final norm of the target, read
    from its checkpoint files without loading the model (Kimi-K2.5 is hundreds of GB)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    target_dir = resolve_target_dir(target_path)
    config = AutoConfig.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tensors, tied = checkpoint_head_tensors(
        target_dir, bool(getattr(config, "tie_word_embeddings", False))
    )
    layer_ids = settings.aux_layer_ids or default_aux_layer_ids(config.num_hidden_layers)
    metadata = {
        "format": FORMAT,
        "target_path": str(target_path),
        "target_config_sha256": target_config_hash(target_dir),
        "aux_layer_ids": json.dumps(list(layer_ids)),
        "hidden_size": str(config.hidden_size),
        "vocab_size": str(config.vocab_size),
        "tied_word_embeddings": json.dumps(tied),
        "rms_norm_eps": str(getattr(config, "rms_norm_eps", "")),
        "source": "checkpoint",
        "versions": json.dumps(library_versions(), sort_keys=True),
    }
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    log.info("target head: %s (tied embeddings: %s)", sorted(tensors), tied)
    return metadata
