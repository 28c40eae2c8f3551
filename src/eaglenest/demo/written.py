"""What the written demo targets share (demo/long_target.py, demo/cite_target.py): their layer
and head layout, the gate and score scales of their hand-set weights, and identities as Fourier
features, which adding a step turns (a rotation a frequency)."""

from __future__ import annotations

from typing import Any

import numpy as np

from eaglenest.demo.long_tasks import STATES
from eaglenest.demo.tasks import END_OF_TURN, PAD_TOKEN

# Layers 0-3 compute; layer 4 is there so that EAGLE-3's aux layers (2, 3, 4), the INPUTS of
# those layers, are the outputs of layers 1, 2 and 3 (the config sets hidden.aux_layer_ids).
NUM_LAYERS = 5
LOOKAHEAD = 4  # OUT ... OUT4: the features at position t hold the states t+1 ... t+4
HEAD_DIM = 128
KV_HEADS = 1
PREV_PLANES = 8  # RoPE planes of the previous-token head: its fastest
KEY_PLANE = HEAD_DIM // 2 - 1  # RoPE's slowest plane: under 0.02 rad over 16K positions
GATE = 40.0  # a SwiGLU gate's input: +GATE/2 open, -GATE/2 or less shut (silu ~ 1e-8)
PREV_SCALE = 20.0  # the previous-token head's scores: one position back wins by ~16 (e^-16)
CONTENT_SCORE = 32.0  # the key and start heads' score on what they look for (0 elsewhere)
STATE_LOGIT = 1.0  # per Fourier frequency: the next state's logit is N_FREQ times this
FLAG_LOGIT = 40.0  # the next special token's logit
# The slots of the states ahead: AHEAD[j - 1] holds the state j steps on (OUT: the next).
AHEAD = ["OUT"] + [f"OUT{j}" for j in range(2, LOOKAHEAD + 1)]


def fourier(states: np.ndarray, freqs: np.ndarray, space: int = STATES) -> np.ndarray:
    """[len(states), 2 * len(freqs)]: cos then sin of each frequency's angle (identities of a
    space of `space`: the walk's states, or the cite target's words)."""
    angle = 2 * np.pi * np.outer(states, freqs) / space
    return np.concatenate([np.cos(angle), np.sin(angle)], axis=1)


def rotation(step: int, freqs: np.ndarray, space: int = STATES) -> np.ndarray:
    """The linear map of Fourier features that adds `step` to the state: a rotation a frequency."""
    angle = 2 * np.pi * freqs * step / space
    c, s = np.diag(np.cos(angle)), np.diag(np.sin(angle))
    return np.block([[c, -s], [s, c]])


def written_model(
    tokenizer: Any,
    weights: dict[str, np.ndarray],
    *,
    hidden: int,
    intermediate: int,
    heads: int,
    rope_theta: float,
    max_position_embeddings: int,
) -> Any:
    """A Qwen3 causal LM of these sizes whose tensors are `weights` (by state-dict name; every
    other tensor zero), float32, in eval mode: an ordinary checkpoint, written by hand."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN),
        bos_token_id=None,
        use_cache=True,
        torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    state.update({k: torch.tensor(v, dtype=torch.float32) for k, v in weights.items()})
    model.load_state_dict(state)
    return model.eval()
