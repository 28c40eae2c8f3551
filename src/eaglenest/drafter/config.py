"""The drafter's configuration: its sizes, EAGLE-3 variant and attention (exported as
config.json, eaglenest.drafter.eagle3.export), made from the target's config and train.drafter."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only (typing.Self is Python 3.11)
    from typing_extensions import Self


class ConfigDict:
    """A drafter config as the dict a checkpoint and a report record (every family's config:
    aux_layer_ids a list there, a tuple here; keys of another config ignored on reading)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in values.items() if k in names}
        return cls(**{**values, "aux_layer_ids": tuple(values["aux_layer_ids"])})


@dataclass(frozen=True)
class DrafterConfig(ConfigDict):
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # The EAGLE-3 variants vLLM loads (model_executor/models/llama_eagle3.py), all off in the
    # original EAGLE-3 layout: an RMSNorm over fc's whole input (`input_norm`), one RMSNorm per
    # aux state before fc (`fc_norm.{i}`), the residual taken after hidden_norm instead of
    # before it, and the final norm's output (not its input) fed to the next draft step.
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # The drafter's attention: `llama` (vLLM's Eagle3LlamaForCausalLM) or `mla`, DeepSeek-V3's
    # multi-head latent attention (vLLM's Eagle3DeepseekV3ForCausalLM): queries through a
    # low-rank `q_lora_rank` (None: one projection), keys and values from one latent of
    # `kv_lora_rank` per token, the rotary part (`qk_rope_head_dim`, interleaved pairs as
    # DeepSeek rotates them) shared by all heads. An MLA target on vLLM's CPU build can only be
    # served beside an MLA drafter (both need its block size of 16).
    attention: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # A sliding window of the decoder layer's attention, in positions (None: full attention);
    # eaglenest.drafter.attention's module doc says what a TTT step sees through it.
    sliding_window: int | None = None

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...],
        overrides: dict[str, Any] | None = None,
    ) -> DrafterConfig:
        """Sizes from the target's (text) config, as EAGLE-3 drafters use, unless overridden."""
        c = (
            target_config.get_text_config()
            if hasattr(target_config, "get_text_config")
            else target_config
        )
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        heads = overrides.get("num_attention_heads", c.num_attention_heads)
        hidden = overrides.get("hidden_size", c.hidden_size)
        rope = getattr(c, "rope_parameters", None) or {}
        values = {
            "hidden_size": hidden,
            "target_hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or hidden // heads,
            "vocab_size": c.vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "aux_layer_ids": tuple(aux_layer_ids),
            "rms_norm_eps": getattr(c, "rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
            "max_position_embeddings": getattr(c, "max_position_embeddings", 4096),
        }
        if overrides.get("attention") == "mla":
            values.update(_mla_sizes(c, heads))
        values.update(overrides)
        if values["hidden_size"] != c.hidden_size:
            raise ValueError(
                f"drafter hidden_size {values['hidden_size']} differs from the target's "
                f"{c.hidden_size}: the drafter shares the target's token embedding"
            )
        return cls(**{**values, "aux_layer_ids": tuple(values["aux_layer_ids"])})


MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _mla_sizes(target: Any, heads: int) -> dict[str, Any]:
    """An MLA drafter's sizes from an MLA target (DeepSeek-V3, Kimi-K2); its head_dim is the
    query/key head size."""
    if not getattr(target, "kv_lora_rank", None):
        raise ValueError(
            "train.drafter.attention mla: the target's config has no MLA sizes (kv_lora_rank, "
            "qk_rope_head_dim, ...); set them under train.drafter or use attention llama"
        )
    sizes = {name: getattr(target, name, None) for name in MLA_SIZES}
    sizes["head_dim"] = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    sizes["num_key_value_heads"] = heads
    return sizes
