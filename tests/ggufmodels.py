"""Tiny llama-architecture GGUF models, written with gguf.GGUFWriter, for tests that run the real engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import gguf
import numpy as np

# A chat template in the Hugging Face Jinja dialect, as a model's tokenizer_config would carry it.
TINY_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

UNK_ID: Final = 0
BOS_ID: Final = 1
EOS_ID: Final = 2
N_VOCAB: Final = 3 + 256  # <unk>, <s>, </s> and one token per byte


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape and identity of a tiny model; equal specs give byte-identical files."""

    seed: int = 0
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_layer: int = 2
    n_ff: int = 128
    context_length: int = 4096
    chat_template: str | None = TINY_CHAT_TEMPLATE
    name: str = "tiny-llama"
    # Scale of the output projection: large enough that greedy choices are not near-ties.
    output_scale: float = 2.0
    # Extra control tokens after the byte tokens (ids from N_VOCAB on), as a chat model's
    # turn markers are: llama.cpp parses their text into one token when told to.
    control_tokens: tuple[str, ...] = ()


# A chat template whose markup is control tokens, as real chat models' templates are.
CONTROL_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONTROL_TOKENS: Final = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")


def _vocab(spec: TinyModelSpec) -> tuple[list[bytes], list[float], list[int]]:
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    tokens += [t.encode() for t in spec.control_tokens]
    scores = [0.0] * len(tokens)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.CONTROL] * len(spec.control_tokens)
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(path: Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny random-weight llama GGUF (about 0.4 MB) to `path` and return it."""
    spec = spec or TinyModelSpec()
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.n_embd // spec.n_head
    n_embd_kv = head_dim * spec.n_head_kv

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, scores, types = _vocab(spec)
    n_vocab = len(tokens)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if spec.chat_template is not None:
        writer.add_chat_template(spec.chat_template)

    # NumPy shapes are ggml's dimensions reversed.
    writer.add_tensor("token_embd.weight", weight(n_vocab, spec.n_embd, scale=1.0))
    writer.add_tensor("output_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, spec.n_embd, scale=spec.output_scale))
    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_q.weight", weight(spec.n_embd, spec.n_embd))
        writer.add_tensor(f"{blk}.attn_k.weight", weight(n_embd_kv, spec.n_embd))
        writer.add_tensor(f"{blk}.attn_v.weight", weight(n_embd_kv, spec.n_embd))
        writer.add_tensor(f"{blk}.attn_output.weight", weight(spec.n_embd, spec.n_embd))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weight(spec.n_ff, spec.n_embd))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(spec.n_ff, spec.n_embd))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(spec.n_embd, spec.n_ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
