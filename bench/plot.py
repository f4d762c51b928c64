"""python -m bench.plot BENCH.json OUT.png: the scaling runs of a bench JSON as a plot
(cost per event at the small and the large size, per backend), for docs/PERFORMANCE.md."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, out = argv
    d = json.load(open(src))
    scale, replay = d["figures"]["scale"], d["figures"]["replay"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    sizes = [scale["small_handles"], scale["large_handles"]]
    for backend in ("sqlite", "postgres"):
        rates = [scale[f"{backend}_{n}_handles_per_s"] for n in sizes]
        a.plot(sizes, [1e6 / r for r in rates], "o-", label=backend)
    a.set(xscale="log", xlabel="live handles", ylabel="us per publication (batches of 64)",
          title="Append cost vs live handles", ylim=(0, None))
    a.legend()
    events = sorted(int(k.split("_")[2]) for k in replay
                    if k.startswith("replay_events_") and k.endswith("_file_per_s"))
    costs = [1e6 / replay[f"replay_events_{n}_file_per_s"] for n in events]
    b.plot(events, costs, "o-", color="C2", label="full projection")
    b.set(xscale="log", xlabel="journal events", ylabel="us per event", title="Replay cost vs journal length",
          ylim=(0, max(costs) * 1.3))
    for n, c in zip(events, costs):
        b.annotate(f"{c:.2f} us", (n, c), textcoords="offset points", xytext=(0, 6), ha="center")
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
