"""Model loading with its artifact identity: what the cache ABI says produced the rows."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import torch
from safetensors import SafetensorError

from kvledger.schemas.canonical import digest
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.manifest import ArtifactIdentity
from kvledger.worker import checkpoint
from kvledger.worker.model import DEFAULT_CONFIG, ModelConfig, Transformer

# The dtypes a model runs in, by the name --dtype and a cache schema's ScalarType give them.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {t: name for name, t in DTYPES.items()}


def load_model(model_dir: str | None = None, *, device: str = "cpu", dtype: str = "fp32",
               seed: int = 0, config: ModelConfig = DEFAULT_CONFIG) -> tuple[Transformer, ArtifactIdentity]:
    """The default small random model (seeded), or a Hugging Face checkpoint directory."""
    if dtype not in DTYPES:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"dtype must be one of {', '.join(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--device cuda but no CUDA device is available")
    torch_dtype = DTYPES[dtype]
    if model_dir is None:
        model = Transformer.from_config(config, seed=seed, dtype=torch_dtype, device=device)
        cfg_digest = digest(msgspec.to_builtins(config))
        artifact = ArtifactIdentity(
            model_artifact_sha256=digest({"init": "kvledger-random-normal-0.02", "seed": seed,
                                          "config_sha256": cfg_digest}),
            model_config_sha256=cfg_digest,
            weight_transforms=() if dtype == "fp32" else (f"cast:{dtype}",))
        return model, artifact
    path = Path(model_dir)
    checkpoint.check(path, read_config(path))  # before any tensor is allocated
    try:
        model = Transformer.from_pretrained(path, dtype=torch_dtype, device=device)
    except (ValueError, KeyError, TypeError, OSError, SafetensorError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot load {path}: {exc}") from None
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    artifact = ArtifactIdentity(
        model_artifact_sha256=h.hexdigest(),
        model_config_sha256=digest(checkpoint.read_json(path / "config.json")),
        weight_transforms=() if dtype == "fp32" else (f"cast:{dtype}",))
    return model, artifact


def require_context(cfg: ModelConfig, slots: int) -> None:
    """Refuse sequences longer than the model's positions (RoPE past them is untrained, and
    the store would be preallocated for them) before anything is allocated or written."""
    if slots > cfg.max_position_embeddings:
        raise KvLedgerError(ErrorCode.CONTEXT_TOO_LONG, f"{slots} token slots per sequence exceed the "
                                                        f"model's {cfg.max_position_embeddings} positions")


def read_config(path: Path) -> ModelConfig:
    """The model config of a checkpoint directory, or INVALID_ARGUMENT saying why not (no
    directory, no config.json, not JSON, a missing or mistyped key, a model this code does
    not implement). No weights are read: checkpoint.check holds them to this config."""
    if not path.is_dir():
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{str(path)!r} is not a model directory")
    try:
        raw = checkpoint.read_json(path / "config.json")
        if not isinstance(raw, dict):
            raise ValueError("config.json is not a JSON object")
        return ModelConfig.from_hf_config(raw)
    except FileNotFoundError:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{str(path)!r} has no config.json") from None
    except KeyError as exc:  # from_hf_config reads the required keys by name
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                            f"{str(path)!r}: config.json lacks {exc.args[0]!r}") from None
    except (ValueError, TypeError, ArithmeticError, OSError, RecursionError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                            f"{str(path)!r}: unusable config.json ({type(exc).__name__}: {exc})") from None
