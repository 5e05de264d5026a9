"""Tiny llama-architecture GGUF models, written with gguf.GGUFWriter, for tests that run the real engine.

The default shape (n_embd 64, 4 heads of 16, F32 matrices) keeps the CPU suite fast, and is
one no real model has: llama.cpp's CUDA flash-attention kernels take head sizes 40 to 256
(and 320, 512, 576) only, and its F32 weight matrices take kernel paths (TF32 tensor-core
`mul_mat_f`, F32 `mul_mat_vec_f`) that quantized and F16 models never reach. Runs on a GPU
use `GPU_SHAPED` (head size 64, F16 matrices) or `weight_type="Q8_0"`; tests/gpu/ has the
live check that decides which shape a CUDA build cannot take (README: "GPU boxes").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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


def _add_shape(writer: gguf.GGUFWriter, spec: TinyModelSpec) -> None:
    writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)


def _add_vocab(writer: gguf.GGUFWriter, spec: TinyModelSpec) -> int:
    """The byte vocabulary (`_vocab`) with its special ids; its size."""
    tokens, scores, types = _vocab(spec)
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
    return len(tokens)


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
    _add_shape(writer, spec)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(_FILE_TYPES[spec.weight_type])

    n_vocab = _add_vocab(writer, spec)
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
    _add_shape(writer, spec)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(["yes", "no"])
    n_vocab = _add_vocab(writer, spec)
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


@dataclass(frozen=True, slots=True)
class TinyProjectorSpec:
    """A tiny LLaVA-style vision projector (`clip` architecture, projector_type `mlp`) for a
    text model of width `text_embd`: a ViT of `v_layer` blocks over `patch_size` patches of an
    `image_size` square, then a two-layer MLP. An image becomes (image_size / patch_size)^2
    tokens. llama.cpp's mlp graph runs the first v_layer - 1 blocks (the last is loaded, unused);
    `v_ff` must differ from `v_embd` (clip.cpp swaps up and down otherwise, for old files)."""

    seed: int = 1
    image_size: int = 28
    patch_size: int = 14
    v_embd: int = 32
    v_head: int = 2
    v_ff: int = 48
    v_layer: int = 2
    mm_hidden: int = 48
    text_embd: int = 64  # TinyModelSpec's n_embd: the projector's output width must match it

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def write_tiny_projector(path: Path, spec: TinyProjectorSpec | None = None) -> Path:
    """Write a tiny multimodal projector GGUF (about 150 KB, F32) that libmtmd loads beside a
    tiny text model; random weights, equal specs give identical files."""
    spec = spec or TinyProjectorSpec()
    rng = np.random.default_rng(spec.seed)
    e, n_pos = spec.v_embd, spec.image_tokens

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("tiny-projector")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.image_size", spec.image_size)
    writer.add_uint32("clip.vision.patch_size", spec.patch_size)
    writer.add_uint32("clip.vision.embedding_length", e)
    writer.add_uint32("clip.vision.feed_forward_length", spec.v_ff)
    writer.add_uint32("clip.vision.block_count", spec.v_layer)
    writer.add_uint32("clip.vision.projection_dim", spec.text_embd)
    writer.add_uint32("clip.vision.attention.head_count", spec.v_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])  # optional by name; the loader needs them
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)
    # NumPy shapes are ggml's reversed: the patch kernel is ggml [p, p, 3, e].
    writer.add_tensor("v.patch_embd.weight", weight(e, 3, spec.patch_size, spec.patch_size, scale=0.1))
    writer.add_tensor("v.patch_embd.bias", weight(e, scale=0.1))
    writer.add_tensor("v.position_embd.weight", weight(n_pos, e))
    writer.add_tensor("v.pre_ln.weight", np.ones(e, dtype=np.float32))
    writer.add_tensor("v.pre_ln.bias", np.zeros(e, dtype=np.float32))
    for i in range(spec.v_layer):
        blk = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{blk}.{name}.weight", weight(e, e))
            writer.add_tensor(f"{blk}.{name}.bias", weight(e, scale=0.05))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{blk}.{name}.weight", np.ones(e, dtype=np.float32))
            writer.add_tensor(f"{blk}.{name}.bias", np.zeros(e, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(spec.v_ff, e))
        writer.add_tensor(f"{blk}.ffn_up.bias", weight(spec.v_ff, scale=0.05))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(e, spec.v_ff))
        writer.add_tensor(f"{blk}.ffn_down.bias", weight(e, scale=0.05))
    # The projector: mm.0, GELU, mm.2 (both biases required: the graph adds them unchecked).
    writer.add_tensor("mm.0.weight", weight(spec.mm_hidden, e))
    writer.add_tensor("mm.0.bias", weight(spec.mm_hidden, scale=0.05))
    writer.add_tensor("mm.2.weight", weight(spec.text_embd, spec.mm_hidden, scale=0.5))
    writer.add_tensor("mm.2.bias", weight(spec.text_embd, scale=0.05))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


AUDIO_POSITIONS: Final = 1500  # Whisper's: every 30 s chunk of 3000 mel frames, after the stride-2 conv


@dataclass(frozen=True, slots=True)
class TinyAudioProjectorSpec:
    """A tiny Whisper-style audio encoder with an Ultravox projector (`clip` architecture,
    projector_type `ultravox`) for a text model of width `text_embd`. libmtmd cuts audio into
    30 s chunks of 3000 frames, so even a short clip is 1500 / `stack` tokens per chunk (375);
    1500 must divide by `stack` (8 aborts inside clip_encode)."""

    seed: int = 2
    a_embd: int = 32
    a_head: int = 2
    a_ff: int = 48
    a_layer: int = 1
    n_mel: int = 16
    stack: int = 4
    hidden: int = 32
    text_embd: int = 64

    @property
    def chunk_tokens(self) -> int:
        return AUDIO_POSITIONS // self.stack


def write_tiny_audio_projector(path: Path, spec: TinyAudioProjectorSpec | None = None) -> Path:
    """Write a tiny audio projector GGUF (about 250 KB) that libmtmd loads beside a tiny text model."""
    spec = spec or TinyAudioProjectorSpec()
    rng = np.random.default_rng(spec.seed)
    e = spec.a_embd

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("tiny-audio-projector")
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_string("clip.projector_type", "ultravox")
    writer.add_uint32("clip.audio.embedding_length", e)
    writer.add_uint32("clip.audio.feed_forward_length", spec.a_ff)
    writer.add_uint32("clip.audio.block_count", spec.a_layer)
    writer.add_uint32("clip.audio.projection_dim", spec.text_embd)
    writer.add_uint32("clip.audio.attention.head_count", spec.a_head)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.audio.num_mel_bins", spec.n_mel)
    writer.add_uint32("clip.audio.projector.stack_factor", spec.stack)
    # Conv kernels: ggml [3, in, out], F16 as the converter writes them; biases ggml [1, e].
    writer.add_tensor("a.conv1d.1.weight", weight(e, spec.n_mel, 3).astype(np.float16))
    writer.add_tensor("a.conv1d.1.bias", weight(e, 1, scale=0.05))
    writer.add_tensor("a.conv1d.2.weight", weight(e, e, 3).astype(np.float16))
    writer.add_tensor("a.conv1d.2.bias", weight(e, 1, scale=0.05))
    writer.add_tensor("a.position_embd.weight", weight(AUDIO_POSITIONS, e, scale=0.1))
    for i in range(spec.a_layer):
        blk = f"a.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{blk}.{name}.weight", weight(e, e))
            if name != "attn_k":  # Whisper's keys have no bias (the loader asserts it)
                writer.add_tensor(f"{blk}.{name}.bias", weight(e, scale=0.05))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{blk}.{name}.weight", np.ones(e, dtype=np.float32))
            writer.add_tensor(f"{blk}.{name}.bias", np.zeros(e, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(spec.a_ff, e))
        writer.add_tensor(f"{blk}.ffn_up.bias", weight(spec.a_ff, scale=0.05))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(e, spec.a_ff))
        writer.add_tensor(f"{blk}.ffn_down.bias", weight(e, scale=0.05))
    writer.add_tensor("a.post_ln.weight", np.ones(e, dtype=np.float32))
    writer.add_tensor("a.post_ln.bias", np.zeros(e, dtype=np.float32))
    # Ultravox: RMS norm, mlp.1, SwiGLU over its halves, RMS norm, mlp.2; no biases.
    writer.add_tensor("mm.a.norm_pre.weight", np.ones(e * spec.stack, dtype=np.float32))
    writer.add_tensor("mm.a.mlp.1.weight", weight(2 * spec.hidden, e * spec.stack))
    writer.add_tensor("mm.a.norm_mid.weight", np.ones(spec.hidden, dtype=np.float32))
    writer.add_tensor("mm.a.mlp.2.weight", weight(spec.text_embd, spec.hidden, scale=0.5))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- learned absolute positions -------------------------------------------------------------------

# Positions the tiny BERT and GPT-2 models learned: a table of this many rows, which llama.cpp
# reads a position's row from without a bound of its own (tests/test_models_positions.py).
LEARNED_POSITIONS: Final = 64


def write_tiny_bert(
    path: Path, *, positions: int = LEARNED_POSITIONS, rank: bool = False, seed: int = 0
) -> Path:
    """A tiny BERT-architecture embedder (mean pooling), or reranker (`rank`: rank pooling and
    a one-label head, as BGE's rerankers), with `positions` learned absolute positions."""
    rng = np.random.default_rng(seed)
    n_embd, n_ff = 32, 64

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(name: str) -> None:
        writer.add_tensor(f"{name}.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{name}.bias", np.zeros(n_embd, dtype=np.float32))

    spec = TinyModelSpec(
        seed=seed, n_embd=n_embd, n_head=2, n_head_kv=2, n_layer=1, n_ff=n_ff, chat_template=None
    )
    writer = gguf.GGUFWriter(str(path), "bert")
    _add_shape(writer, replace(spec, context_length=positions, name="tiny-bert"))
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_pooling_type(gguf.PoolingType.RANK if rank else gguf.PoolingType.MEAN)
    if rank:
        writer.add_classifier_output_labels(["relevance"])
    n_vocab = _add_vocab(writer, spec)
    writer.add_token_type_count(2)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    writer.add_tensor("token_types.weight", weight(2, n_embd))
    writer.add_tensor("position_embd.weight", weight(positions, n_embd))  # ggml's (n_embd, positions)
    norm("token_embd_norm")
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", weight(n_embd, n_embd))
    norm("blk.0.attn_output_norm")
    writer.add_tensor("blk.0.ffn_up.weight", weight(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_down.weight", weight(n_embd, n_ff))
    norm("blk.0.layer_output_norm")
    if rank:
        writer.add_tensor("cls.output.weight", weight(1, n_embd))
        writer.add_tensor("cls.output.bias", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gpt2(path: Path, *, positions: int = LEARNED_POSITIONS, seed: int = 0) -> Path:
    """A tiny GPT-2-architecture generator with `positions` learned absolute positions."""
    rng = np.random.default_rng(seed)
    n_embd, n_ff = 32, 64

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(name: str) -> None:
        writer.add_tensor(f"{name}.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{name}.bias", np.zeros(n_embd, dtype=np.float32))

    spec = TinyModelSpec(
        seed=seed, n_embd=n_embd, n_head=2, n_head_kv=2, n_layer=1, n_ff=n_ff, chat_template=None
    )
    writer = gguf.GGUFWriter(str(path), "gpt2")
    _add_shape(writer, replace(spec, context_length=positions, name="tiny-gpt2"))
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = _add_vocab(writer, spec)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    writer.add_tensor("position_embd.weight", weight(positions, n_embd))
    norm("output_norm")
    writer.add_tensor("output.weight", weight(n_vocab, n_embd, scale=2.0))
    norm("blk.0.attn_norm")
    writer.add_tensor("blk.0.attn_qkv.weight", weight(3 * n_embd, n_embd))
    writer.add_tensor("blk.0.attn_qkv.bias", np.zeros(3 * n_embd, dtype=np.float32))
    writer.add_tensor("blk.0.attn_output.weight", weight(n_embd, n_embd))
    writer.add_tensor("blk.0.attn_output.bias", np.zeros(n_embd, dtype=np.float32))
    norm("blk.0.ffn_norm")
    writer.add_tensor("blk.0.ffn_up.weight", weight(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_up.bias", np.zeros(n_ff, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_down.weight", weight(n_embd, n_ff))
    writer.add_tensor("blk.0.ffn_down.bias", np.zeros(n_embd, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
