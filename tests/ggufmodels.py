"""Tiny llama-architecture GGUF models, written with gguf.GGUFWriter, for tests that run the real engine.

The default shape (n_embd 64, 4 heads of 16, F32 matrices) keeps the CPU suite fast, and is
one no real model has: llama.cpp's CUDA flash-attention kernels take head sizes 40 to 256
(and 320, 512, 576) only, and its F32 weight matrices take kernel paths (TF32 tensor-core
`mul_mat_f`, F32 `mul_mat_vec_f`) that quantized and F16 models never reach. Runs on a GPU
use `GPU_SHAPED` (head size 64, F16 matrices) or `weight_type="Q8_0"`; tests/gpu/ has the
live check that decides which shape a CUDA build cannot take (README: "GPU boxes").
"""

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
    # Type of the embedding, output and block matrices: "F32", "F16" or "Q8_0" (rows of 32s).
    # Norms stay F32, as in real models.
    weight_type: str = "F32"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Real models' shapes, still small (about 5 MB): head size 64 (Llama 3.2 1B, Gemma 3 270M
# has 256), grouped-query attention 2:1, F16 matrices. For GPU runs (tests/gpu/).
GPU_SHAPED: Final = TinyModelSpec(
    n_embd=256, n_head=4, n_head_kv=2, n_ff=512, weight_type="F16", name="tiny-llama-gpu-shaped"
)
_FILE_TYPES: Final = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


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
    if spec.weight_type not in _FILE_TYPES:
        raise ValueError(f"weight_type must be one of {sorted(_FILE_TYPES)}, not {spec.weight_type!r}")
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.head_dim
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
    writer.add_file_type(_FILE_TYPES[spec.weight_type])

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

    def matrix(name: str, data: np.ndarray) -> None:
        """A weight matrix in spec.weight_type (F32 as given: the default files stay byte-identical)."""
        if spec.weight_type == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif spec.weight_type == "Q8_0":
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)

    # NumPy shapes are ggml's dimensions reversed.
    matrix("token_embd.weight", weight(n_vocab, spec.n_embd, scale=1.0))
    writer.add_tensor("output_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
    matrix("output.weight", weight(n_vocab, spec.n_embd, scale=spec.output_scale))
    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        matrix(f"{blk}.attn_q.weight", weight(spec.n_embd, spec.n_embd))
        matrix(f"{blk}.attn_k.weight", weight(n_embd_kv, spec.n_embd))
        matrix(f"{blk}.attn_v.weight", weight(n_embd_kv, spec.n_embd))
        matrix(f"{blk}.attn_output.weight", weight(spec.n_embd, spec.n_embd))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        matrix(f"{blk}.ffn_gate.weight", weight(spec.n_ff, spec.n_embd))
        matrix(f"{blk}.ffn_up.weight", weight(spec.n_ff, spec.n_embd))
        matrix(f"{blk}.ffn_down.weight", weight(spec.n_embd, spec.n_ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The prompt a reranking model's GGUF may carry (`tokenizer.chat_template.rerank`), as Qwen3's
# rerankers do; the server puts the query and the document in place of the markers.
TINY_RERANK_TEMPLATE: Final = "<s>query: {query}\ndocument: {document}"


@dataclass(frozen=True, slots=True)
class TinyReranker:
    """A tiny Qwen3-architecture reranker whose score can be computed by hand (`score`).

    Its query projections are zero, so every position attends to all before it equally, and its
    feed-forward blocks add nothing: the last token's state is its own embedding plus the mean
    of every token's value, through the output projection. The rank head (`cls.output`, two
    labels) reads that state after the output norm; llama.cpp takes the softmax of the two and
    the score is the first label's probability, as for Qwen3-Reranker.
    """

    embeddings: np.ndarray  # (n_vocab, n_embd)
    values: list[np.ndarray]  # per layer (n_embd_kv, n_embd)
    outputs: list[np.ndarray]  # per layer (n_embd, n_embd)
    head: np.ndarray  # (2, n_embd)
    n_head: int
    n_head_kv: int
    eps: float

    def score(self, tokens: list[int]) -> float:
        """The model's score of one token sequence, as llama.cpp computes it (float64 here)."""
        h = self.embeddings[tokens].astype(np.float64)
        for wv, wo in zip(self.values, self.outputs, strict=True):
            v = _rms(h, self.eps) @ wv.T  # (T, n_embd_kv)
            mean = np.cumsum(v, axis=0) / np.arange(1, len(tokens) + 1)[:, None]  # causal, uniform
            group = self.n_head // self.n_head_kv
            head_dim = v.shape[1] // self.n_head_kv
            heads = [
                mean[:, (i // group) * head_dim : (i // group + 1) * head_dim] for i in range(self.n_head)
            ]
            h = h + np.concatenate(heads, axis=1) @ wo.T
        logits = self.head @ _rms(h[-1], self.eps)
        odds = np.exp(logits - logits.max())
        return float(odds[0] / odds.sum())


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    scaled: np.ndarray = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return scaled


def write_tiny_reranker(
    path: Path, seed: int = 0, template: str | None = TINY_RERANK_TEMPLATE
) -> TinyReranker:
    """Write a tiny reranking GGUF (Qwen3 architecture, rank pooling) and return its weights."""
    spec = TinyModelSpec(seed=seed, chat_template=None, name="tiny-reranker")
    rng = np.random.default_rng(seed)
    head_dim = spec.head_dim
    n_embd_kv = head_dim * spec.n_head_kv
    eps = 1e-6

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(["yes", "no"])
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
    if template is not None:
        writer.add_chat_template([{"name": "rerank", "template": template}])

    embeddings = weight(n_vocab, spec.n_embd, scale=1.0)
    head = weight(2, spec.n_embd, scale=0.3)  # scores spread over (0, 1), not saturated
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
    writer.add_tensor("cls.output.weight", head)
    values, outputs = [], []
    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        wv, wo = weight(n_embd_kv, spec.n_embd), weight(spec.n_embd, spec.n_embd)
        values.append(wv)
        outputs.append(wo)
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_q.weight", np.zeros((spec.n_embd, spec.n_embd), dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_k.weight", weight(n_embd_kv, spec.n_embd))
        writer.add_tensor(f"{blk}.attn_v.weight", wv)
        writer.add_tensor(f"{blk}.attn_output.weight", wo)
        writer.add_tensor(f"{blk}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weight(spec.n_ff, spec.n_embd))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(spec.n_ff, spec.n_embd))
        writer.add_tensor(f"{blk}.ffn_down.weight", np.zeros((spec.n_embd, spec.n_ff), dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyReranker(embeddings, values, outputs, head, spec.n_head, spec.n_head_kv, eps)
