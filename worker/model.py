"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain torch, gpt-fast style.

The KV cache deliberately lives outside the model: `Transformer.forward` hands each
layer's new K/V rows to a caller-owned `KVView` callback and attends over whatever it
returns. That keeps cache layout, paging and commit/rollback policy out of this file;
`SimpleKV` is the minimal reference implementation of the protocol.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn
from torch.types import Device

__all__ = [
    "DEFAULT_CONFIG", "KVView", "ModelConfig", "SimpleKV", "Transformer", "causal_mask",
]

# MKL's vector math, behind torch's CPU cos and sin, sets itself up on first use, and a
# first use split across torch's threads races: one thread's share can come out ~1e-4
# off, so that process's RoPE table, and every K/V row from it, differs from any other
# process's and its journal fails re-execution. One first call on one thread, here.
torch.ones(1).cos()


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # H_q
    num_kv_heads: int  # H_kv; H_q // H_kv query heads share each K/V head
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only, never on o_proj
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    eos_token_id: int | None = None
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        # msgspec only type-checks when decoding, so direct construction is checked here.
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:  # config.json: any JSON values
        """Read a Hugging Face config.json dict (model_type llama, mistral or qwen2).

        Refuses anything whose math this file does not implement rather than
        silently producing different logits.
        """
        mt = d.get("model_type")
        _check_supported(d, mt)
        theta = _rope_theta(d)
        n_layers = _size(d, "num_hidden_layers")
        max_pos = _size(d, "max_position_embeddings", 2048)
        _check_window(d, mt, n_layers, max_pos)
        vocab = _size(d, "vocab_size")
        _first_token_id(d, "pad_token_id", vocab)  # read by transformers' loader: held to the same type
        tied = d.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, got {tied!r}")
        hidden, heads = _size(d, "hidden_size"), _size(d, "num_attention_heads")
        kv_heads = _size(d, "num_key_value_heads", heads)
        head_dim = _head_dim(d, hidden, heads)
        return cls(
            vocab_size=vocab, hidden_size=hidden, num_layers=n_layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=_size(d, "intermediate_size"), rope_theta=theta,
            rms_norm_eps=_real(d.get("rms_norm_eps", 1e-6), "rms_norm_eps"), qkv_bias=mt == "qwen2",
            tie_word_embeddings=tied, max_position_embeddings=max_pos,
            eos_token_id=_first_token_id(d, "eos_token_id", vocab),
            bos_token_id=_first_token_id(d, "bos_token_id", vocab),
        )


_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
# A size in config.json: a positive int below this (a bound on what a header can describe).
MAX_SIZE = 1 << 40
_REQUIRED = object()


def _size(d: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """d[key] as a positive int (KeyError if required and absent; None counts as absent)."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not 0 < v < MAX_SIZE:
        raise ValueError(f"{key} must be a positive int below 2**40, got {v!r}"[:200])
    return v


def _real(v: object, key: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"{key} must be a number, got {v!r}"[:200])
    x = float(v)  # an int too large for a float raises OverflowError: an ArithmeticError the caller names
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{key} must be a positive finite number, got {v!r}"[:200])
    return x


def _check_supported(d: dict[str, Any], mt: object) -> None:
    """Refuse an architecture, activation, bias, quantization or dtype ModelConfig does not run."""
    if mt not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"unsupported model_type {mt!r} (expected llama, mistral or qwen2)")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}")
    if d.get("mlp_bias") or (mt != "qwen2" and d.get("attention_bias")):
        raise ValueError("mlp_bias / attention_bias (bias on o_proj) are not implemented")
    if d.get("quantization_config") is not None:
        raise ValueError("quantized checkpoints (quantization_config) are not implemented")
    for key in ("torch_dtype", "dtype"):  # what the weights were saved in: the loaders cast them
        if d.get(key) not in (None, "auto", *_DTYPE_NAMES):
            raise ValueError(f"{key} must be one of {', '.join(_DTYPE_NAMES)}, got {d[key]!r}"[:200])


def _rope_theta(d: dict[str, Any]) -> float:
    """The RoPE base, once the config is shown to ask for plain (unscaled, full) RoPE."""
    # transformers >= 5 writes rope_parameters={"rope_type", "rope_theta"}; older
    # configs have top-level rope_theta plus an optional rope_scaling dict.
    rp, rs = d.get("rope_parameters") or {}, d.get("rope_scaling") or {}
    if not isinstance(rp, dict) or not isinstance(rs, dict):
        raise ValueError("rope_parameters / rope_scaling must be JSON objects")
    rope_type = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    if rope_type != "default" or rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope scaling {rope_type!r} / partial rotary is not implemented")
    return _real(rp.get("rope_theta", d.get("rope_theta", 10000.0)), "rope_theta")


def _check_window(d: dict[str, Any], mt: object, n_layers: int, max_pos: int) -> None:
    """A sliding window only changes the math once a sequence outgrows it."""
    sw, layer_types = d.get("sliding_window"), d.get("layer_types")
    if layer_types is not None:
        sliding = "sliding_attention" in layer_types
    elif mt == "qwen2":
        sliding = bool(d.get("use_sliding_window")) and d.get("max_window_layers", 0) < n_layers
    else:
        sliding = mt == "mistral"
    if sliding and sw is not None and sw < max_pos:
        raise ValueError(f"sliding_window={sw} < max_position_embeddings={max_pos} "
                         "is not implemented (attention would differ past the window)")


def _first_token_id(d: dict[str, Any], key: str, vocab: int) -> int | None:
    """Llama 3 style lists: keep the primary id."""
    tok = d.get(key)
    ids = tok if isinstance(tok, list) else [] if tok is None else [tok]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise ValueError(f"{key} must be a token id below vocab_size or a list of them, got {tok!r}"[:200])
    return ids[0] if ids else None


def _head_dim(d: dict[str, Any], hidden: int, heads: int) -> int:
    head_dim = _size(d, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
        head_dim = hidden // heads
    return int(head_dim)


DEFAULT_CONFIG = ModelConfig(
    vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=344, rope_theta=10000.0, max_position_embeddings=2048, eos_token_id=None,
)


class KVView(Protocol):
    def __call__(self, layer: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """k_new, v_new: [B, H_kv, T_new, d_h] (K already RoPE'd, V not).

        Returns (k_used, v_used, mask): [B, H_kv, T_kv, d_h] = committed history + this
        call's rows, and a bool mask broadcastable to [B, 1, T_new, T_kv] (True = may
        attend), or None meaning plain causal over the new rows with no history.
        """
        ...


def causal_mask(past_lengths: Tensor, new_lengths: Tensor, T_kv: int, T_new: int) -> Tensor:
    """Mask for a ragged batch laid out as [history padded to T_kv - T_new | new rows].

    Query row i of sequence b sees history columns < past_lengths[b] and new column j
    when j <= i and j < new_lengths[b]. Padding rows (i >= new_lengths[b]) also see
    themselves so SDPA never normalises over an empty set; their outputs are garbage
    that only flows into other padding rows, which the caller must not commit or read.
    Returns bool [B, 1, T_new, T_kv].
    """
    dev = past_lengths.device
    T_past = T_kv - T_new
    hist = torch.arange(T_past, device=dev)[None, :] < past_lengths[:, None]  # [B, T_past]
    i = torch.arange(T_new, device=dev)[:, None]
    j = torch.arange(T_new, device=dev)[None, :]
    new = (j <= i) & ((j < new_lengths[:, None, None]) | (j == i))  # [B, T_new, T_new]
    hist = hist[:, None, :].expand(-1, T_new, -1)
    return torch.cat([hist, new], dim=-1)[:, None]


class SimpleKV:
    """Reference KVView: per-layer concatenated K/V, stage-then-commit.

    A forward only stages its rows; `commit()` makes all layers' rows visible at once
    and `discard()` drops them, so a forward that fails half-way (or a speculative
    step that is rejected) never leaves the layers disagreeing about the length.
    Every sequence in the batch must have the same length (use batch 1 for ragged work).
    """

    def __init__(self, num_layers: int):
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.staged: list[tuple[Tensor, Tensor] | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def __call__(self, layer: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.staged[layer] is not None:
            raise RuntimeError(f"layer {layer} already has staged rows; commit() or discard() first")
        self.staged[layer] = (k_new, v_new)
        k_old, v_old = self.k[layer], self.v[layer]
        if k_old is None or v_old is None:  # both, or neither: commit() sets them together
            return k_new, v_new, None
        B, _, P, _ = k_old.shape
        T = k_new.shape[2]

        def lens(n: int) -> Tensor:
            return torch.full((B,), n, dtype=torch.long, device=k_new.device)

        mask = causal_mask(lens(P), lens(T), P + T, T)
        return torch.cat([k_old, k_new], 2), torch.cat([v_old, v_new], 2), mask

    def commit(self) -> None:
        staged = [s for s in self.staged if s is not None]
        if len(staged) < len(self.staged):
            raise RuntimeError("commit() needs rows staged by every layer (incomplete forward?)")
        for layer, (k, v) in enumerate(staged):
            old_k, old_v = self.k[layer], self.v[layer]
            self.k[layer] = k if old_k is None else torch.cat([old_k, k], 2)
            self.v[layer] = v if old_v is None else torch.cat([old_v, v], 2)
        self.discard()

    def discard(self) -> None:
        self.staged = [None] * len(self.staged)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # one op instead of seven; the same arithmetic in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and multiply by the weight after casting back, exactly as HF.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [B, 1, T, d_h] of `positions` [B, T], computed in fp32 and cast to
    `dtype` (model.to(bf16) must not quantise the frequencies)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float,
                                             device=positions.device) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # [B, T, d_h/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d_h]; dim i pairs with i + d_h/2
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat([-x2, x1], dim=-1), sin)


class Attention(nn.Module):
    """q, k and v come from one fused projection (one GEMM, and one RoPE pass over the
    query and key heads together), as in gpt-fast; the state dict still speaks HF's
    q_proj / k_proj / v_proj, split and joined at the boundary below."""

    _PARTS = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.sizes = (hq * d, hkv * d, hkv * d)
        self.qkv_weight = nn.Parameter(torch.empty(sum(self.sizes), cfg.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(sum(self.sizes))) if cfg.qkv_bias else None
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)

    def _save_to_state_dict(self, destination: dict[str, Tensor], prefix: str, keep_vars: bool) -> None:
        # HF's names and order (each projection's weight, then its bias), as views of
        # the fused tensors: writing into them writes the model.
        fused = [(p if keep_vars else p.detach()).split_with_sizes(self.sizes)
                 for p in (self.qkv_weight, self.qkv_bias) if p is not None]
        for i, part in enumerate(self._PARTS):
            for kind, pieces in zip(("weight", "bias"), fused):
                destination[f"{prefix}{part}.{kind}"] = pieces[i]

    def _load_from_state_dict(self, state_dict: dict[str, Tensor], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        absent = []
        for kind, p in (("weight", self.qkv_weight), ("bias", self.qkv_bias)):
            keys = [f"{prefix}{part}.{kind}" for part in self._PARTS]
            if p is None:
                continue
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}qkv_{kind}"] = torch.cat([state_dict.pop(k) for k in keys])
            else:  # reported under HF's names, not the fused one
                absent.append(f"{prefix}qkv_{kind}")
                missing_keys.extend(k for k in keys if state_dict.pop(k, None) is None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        missing_keys[:] = [k for k in missing_keys if k not in absent]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVView | None) -> Tensor:
        B, T, _ = x.shape
        c = self.cfg
        hq, hkv = c.num_heads, c.num_kv_heads
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(B, T, hq + 2 * hkv, c.head_dim)
        qk = apply_rope(qkv[:, :, :hq + hkv], cos, sin)
        q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
        v = qkv[:, :, hq + hkv:].transpose(1, 2)
        mask = None
        if kv is not None:
            k, v, mask = kv(layer, k, v)
            if mask is None and k.shape[2] != T:
                raise ValueError("KVView returned history rows but mask=None")
        # enable_gqa broadcasts the H_kv heads over H_q inside the kernel, so nothing
        # expanded is ever stored. (Checked on CPU for torch 2.13: identical to an explicit
        # repeat_interleave with bool masks, is_causal, and fp32/bf16/fp16.)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)
        out: Tensor = self.o_proj(o.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVView | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, kv)
        mlp: Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp


class Transformer(nn.Module):
    # Module names mirror HF's, so a checkpoint maps by stripping the "model." prefix.
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # An explicit, uninitialised weight: Embedding's own init is normal_, whose meta
        # kernel imports torch._dynamo (over a second) when built under torch.device("meta").
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied: no lm_head module at all, so there is exactly one tensor to load and
        # no parameter-aliasing subtleties under .to() or a state-dict load.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope_table: Tensor | None = None  # fp32, not a buffer: .to(bf16) must not touch it

    def forward(self, input_ids: Tensor, positions: Tensor, kv: KVView | None = None,
                logits_rows: Tensor | Literal["all", "last"] = "all") -> Tensor:
        """input_ids, positions: [B, T_new]. Returns float32 logits [B, R, V].

        logits_rows: "all" (R = T_new), "last" (R = 1), or a LongTensor of row indices,
        [B] (R = 1; e.g. the last valid row of each right-padded sequence) or [B, R].
        Rows are picked before the final norm and lm_head, which dominate at large V.
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, i, kv)
        if isinstance(logits_rows, Tensor):
            idx = logits_rows[:, None] if logits_rows.dim() == 1 else logits_rows
            x = x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
        elif logits_rows == "last":
            x = x[:, -1:]
        elif logits_rows != "all":
            raise ValueError(f"logits_rows must be 'all', 'last' or a tensor, got {logits_rows!r}")
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(x), w).float()

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [B, T, 1, d_h] for `positions` [B, T], looked up in an fp32 table
        that grows to the largest position asked for (one lookup per forward instead
        of ten small ops)."""
        need = int(positions.max()) + 1
        table = self._rope_table
        if table is None or table.shape[0] < need or table.device != positions.device:
            n = max(need, 256, 2 * table.shape[0] if table is not None else 0)
            cos, sin = rope_tables(torch.arange(n, device=positions.device)[None],
                                   self.cfg.head_dim, self.cfg.rope_theta, torch.float32)
            table = self._rope_table = torch.cat([cos, sin], dim=-1)[0, 0]  # [n, 2 d_h]
        cs = F.embedding(positions, table)[:, :, None]
        d = self.cfg.head_dim
        return cs[..., :d].to(dtype), cs[..., d:].to(dtype)

    @classmethod
    def _empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: Device) -> Transformer:
        # Build on meta so construction neither allocates twice nor consumes global RNG.
        with torch.device("meta"):
            model = cls(cfg)
        # torch.empty, not to_empty's empty_like: on meta tensors that imports sympy and
        # torch.fx, 0.6 s of every process that loads a model.
        model.load_state_dict({name: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                                 device=device) for name, t in model.state_dict().items()},
                              assign=True)
        # Inference only: no autograd graph can pin cached K/V tensors.
        return model.eval().requires_grad_(False)

    @classmethod
    def from_config(cls, cfg: ModelConfig = DEFAULT_CONFIG, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: Device = "cpu") -> Transformer:
        """Deterministic random init: same seed -> same weights on any device/dtype."""
        model = cls._empty(cfg, dtype, device)
        g = torch.Generator().manual_seed(seed)  # CPU fp32 draws, then cast/copy
        with torch.no_grad():
            for name, p in model.state_dict().items():  # HF's names and order: same draws as ever
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=g))
        return model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: Device = "cpu") -> Transformer:
        """Load a HF Llama/Mistral/Qwen2 directory: config.json + (sharded) safetensors."""
        path = Path(path)
        cfg = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        model = cls._empty(cfg, dtype, device)
        expected = dict(model.state_dict())
        state: dict[str, Tensor] = {}
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for key in fh.keys():
                    name = key.removeprefix("model.")
                    if name.endswith("rotary_emb.inv_freq"):  # old checkpoints stored it
                        continue
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints still ship a copy; HF ignores it too
                    state[name] = fh.get_tensor(key)
        missing = sorted(expected.keys() - state.keys())
        unexpected = sorted(state.keys() - expected.keys())
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match {cfg}: "
                             f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                             f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
        for name, t in state.items():
            if t.shape != expected[name].shape:
                raise ValueError(f"tensor {name}: checkpoint shape {tuple(t.shape)} "
                                 f"!= model shape {tuple(expected[name].shape)}")
        with torch.no_grad():
            for name, p in model.state_dict().items():
                p.copy_(state[name])  # copy_ casts to the requested dtype/device
        return model
