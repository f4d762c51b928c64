"""A checkpoint directory checked before anything is allocated for it.

Only headers are read: config.json and a sharded checkpoint's index (each read up to a
bound), and each safetensors file's header (its 8-byte length, then the JSON that
names every tensor's dtype, shape and byte extent). Every tensor must lie inside its
file, exactly as long as its shape and dtype say, the files' data fully covered, and
the set of tensors exactly the one the config implies (names and shapes). So a model
is only ever built as large as the weights on disk: an absurd config.json (a vocabulary
or a layer count the weights do not hold) and a truncated or corrupt file are refused
here with INVALID_ARGUMENT, in one line, before any tensor is allocated. Both runtimes
load through this check (the worker's Transformer and transformers' own loader).
"""

from __future__ import annotations

import json
import math
import re
import stat
import struct
from pathlib import Path
from typing import Any

from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.worker.model import ModelConfig

MAX_JSON_BYTES = 16 << 20  # config.json, model.safetensors.index.json: real ones are kilobytes
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header
MAX_FILES = 10_000
# Floating dtypes a Llama-family checkpoint holds; both loaders cast them to the run's dtype.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_IGNORED = re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # old checkpoints kept it


def _bad(message: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, message)


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A regular JSON file read up to `limit` bytes (a device, a FIFO or a huge file is
    refused, not read); FileNotFoundError if there is none."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise _bad(f"{str(path)!r} is not a regular file")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _bad(f"cannot read {str(path)!r}: {exc.strerror or type(exc).__name__}") from None
    if len(data) > limit:
        raise _bad(f"{str(path)!r} is larger than {limit} bytes: not a model's JSON file")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"{str(path)!r} is not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama/Mistral/Qwen2 checkpoint of `cfg` holds, by its name in the
    checkpoint (transformers' names), and its shape."""
    h, hd, inter, vocab = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter)})
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (vocab, h)
    return out


def expected_count(cfg: ModelConfig) -> int:
    """len(expected_tensors(cfg)), without building it (a config may claim 10**12 layers)."""
    return 2 + (0 if cfg.tie_word_embeddings else 1) + cfg.num_layers * (12 if cfg.qkv_bias else 9)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its index names (plain
    file names in the directory), else every *.safetensors in it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        doc = read_json(index)
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise _bad(f"{str(index)!r} has no weight_map")
        names = set(wmap.values())
        if not all(isinstance(n, str) and n and Path(n).name == n and n not in (".", "..") for n in names):
            raise _bad(f"{str(index)!r} names a weight file outside the directory")
        files = sorted(path / n for n in names)
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _bad(f"{str(path)!r} holds no weights (*.safetensors)")
    if len(files) > MAX_FILES:
        raise _bad(f"{str(path)!r} names {len(files)} weight files")
    for f in files:
        if not f.is_file():
            raise _bad(f"weight file {str(f)!r} is missing or not a regular file")
    return files


def read_header(f: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors file's tensors (name -> dtype, shape), once its header is shown to
    describe the file exactly: every extent inside the data, as long as its shape and
    dtype say, no overlap, no byte uncovered."""
    data, doc = _header_json(f)
    extents: list[tuple[int, int]] = []
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in doc.items():
        if name == "__metadata__":
            continue
        dtype, shape, extent = _tensor(f, name, t, data)
        extents.append(extent)
        out[name] = (dtype, shape)
    _check_covered(f, extents, data)
    return out


def _header_json(f: Path) -> tuple[int, dict[str, Any]]:
    """The size of the file's data section and its header, a JSON object."""
    try:
        with open(f, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            head = fh.read(8)
            if len(head) < 8:
                raise _bad(f"{str(f)!r} is truncated: {size} bytes, no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise _bad(f"{str(f)!r} is truncated or not safetensors: a header of {n} bytes in a file of {size}")
            raw = fh.read(n)
    except OSError as exc:
        raise _bad(f"cannot read {str(f)!r}: {exc.strerror or type(exc).__name__}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad(f"{str(f)!r}: the safetensors header is not JSON (truncated or corrupt)") from None
    if not isinstance(doc, dict):
        raise _bad(f"{str(f)!r}: the safetensors header is not a JSON object")
    return size - 8 - n, doc


def _tensor(f: Path, name: str, t: object, data: int) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """One tensor's dtype, shape and byte extent, once they agree and lie inside the data."""
    if not isinstance(t, dict):
        raise _bad(f"{str(f)!r}: tensor {name!r} is not described")
    dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise _bad(f"{str(f)!r}: tensor {name!r} has dtype {dtype!r}, not a float a model runs in "
                   f"({', '.join(DTYPE_BYTES)})")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(_count(d) for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise _bad(f"{str(f)!r}: tensor {name!r} has a malformed shape or extent")
    begin, end = offsets
    if not begin <= end <= data:
        raise _bad(f"{str(f)!r} is truncated: tensor {name!r} ends at byte {end} of {data} data bytes")
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise _bad(f"{str(f)!r}: tensor {name!r} of shape {shape} ({dtype}) spans {end - begin} bytes")
    return dtype, tuple(shape), (begin, end)


def _check_covered(f: Path, extents: list[tuple[int, int]], data: int) -> None:
    """The extents tile the data section: no overlap, no gap, nothing after the last."""
    at = 0
    for begin, end in sorted(extents):
        if begin != at:
            raise _bad(f"{str(f)!r}: tensor data overlaps or leaves a gap at byte {min(begin, at)}")
        at = end
    if at != data:
        raise _bad(f"{str(f)!r}: {data - at} bytes after the last tensor (not a safetensors file as written)")


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def check(path: Path, cfg: ModelConfig) -> list[Path]:
    """The weight files of `path`, once their headers are shown to hold exactly the
    tensors `cfg` implies; INVALID_ARGUMENT naming the first difference otherwise."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = weight_files(path)
    for f in files:
        for name, t in read_header(f).items():
            if name in tensors:
                raise _bad(f"tensor {name!r} is in more than one weight file")
            tensors[name] = t
    names = {k for k in tensors if not _IGNORED.fullmatch(k)}
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints still ship a copy; both loaders ignore it
    names = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}" for k in names}
    want = expected_count(cfg)
    if len(names) != want:
        raise _bad(f"{str(path)!r}: config.json implies {want} tensors ({cfg.num_layers} layers), the weights "
                   f"hold {len(names)}")
    expected = expected_tensors(cfg)
    shapes = {(k if k.startswith(("model.", "lm_head.")) else f"model.{k}"): s for k, (_, s) in tensors.items()}
    missing = sorted(expected.keys() - names)
    if missing:
        raise _bad(f"{str(path)!r}: the weights lack {missing[0]!r}"
                   f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} that config.json implies")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise _bad(f"{str(path)!r}: tensor {name!r} is {list(shapes[name])} in the weights, {list(shape)} "
                       "by config.json")
    return files
