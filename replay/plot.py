"""`--plot`: the byte trajectory (logical, materialized, reserved, physical,
instantaneous) over monotonic time. matplotlib is the optional extra `plot`."""

from __future__ import annotations

from pathlib import Path

from kvledger.replay.ledger import LedgerPoint
from kvledger.schemas.errors import ErrorCode, KvLedgerError

SERIES = ("logical", "materialized", "reserved", "physical", "instantaneous")


def plot_trajectory(points: list[LedgerPoint], out: str | Path, title: str) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                            "--plot needs matplotlib: pip install 'kvledger[plot]'") from None
    out = Path(out)
    if not out.parent.is_dir():
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"directory {out.parent} does not exist")
    t0 = points[0].t_ns if points else 0
    xs = [(p.t_ns - t0) / 1e6 for p in points]
    fig, ax = plt.subplots(figsize=(9, 4.5), constrained_layout=True)
    for name in SERIES:
        # Ledgers hold their value until the next event: a post step, not a line.
        ax.step(xs, [getattr(p.ledger, name) for p in points], where="post", label=name)
    ax.set_xlabel("monotonic time since the first event (ms)")
    ax.set_ylabel("bytes")
    ax.set_title(title)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
