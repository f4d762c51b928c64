"""python -m bench [--quick | --smoke | --full] [--json] [--only SECTION ...]

Runs every registered section in this process tree (plus one throwaway PostgreSQL with
fsync on), prints a table of the headline figures against their goals, and with
--json prints one JSON object on stdout (the table then goes to stderr).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback
from typing import Any

from bench import MODES, SECTIONS, Context
from bench.machine import machine_info


def _goal_met(value: Any, goal: tuple[str, float] | None) -> bool | None:
    if goal is None or not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        return None
    op, threshold = goal
    return value >= threshold if op == ">=" else value <= threshold


def run_sections(ctx: Context, only: list[str] | None = None) -> dict[str, Any]:
    """Run the sections; returns the report object (also what --json prints)."""
    started = time.perf_counter()
    keys: dict[str, Any] = {}
    figures: dict[str, dict[str, Any]] = {}
    goals: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    missing: dict[str, str] = {}  # headline key -> why it has no value
    sections: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        if only and section.name not in only:
            continue
        status: dict[str, Any] = {"title": section.title}
        result: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(section.module)
        except ModuleNotFoundError as exc:
            if exc.name != section.module:
                raise
            status["status"] = "missing"
            status["detail"] = f"{section.module} does not exist yet"
            module = None
        if module is not None:
            ctx.log(f"== {section.title}")
            try:
                result = dict(module.run(ctx))
                status["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - one broken section must not hide the rest
                status["status"] = "error"
                status["detail"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=sys.stderr)
            for key, goal in getattr(module, "GOALS", {}).items():
                goals[key] = {"goal": f"{goal[0]} {goal[1]}", "op": goal[0], "threshold": goal[1],
                              "section": section.name}
            notes.update(getattr(module, "NOTES", {}))
        status["elapsed_s"] = round(time.perf_counter() - t0, 1)
        sections[section.name] = status
        headline = list(section.keys) + [k for k in getattr(module, "GOALS", {}) if k not in section.keys]
        why_missing = result.pop("missing", {})  # a section may say why a figure is absent
        for key in headline:
            keys[key] = result.get(key)
            if keys[key] is None:
                missing[key] = why_missing.get(key) or status.get("detail") or "not measured"
        figures[section.name] = {k: v for k, v in result.items() if k not in headline}
    for key, goal in goals.items():
        goal["value"] = keys.get(key)
        goal["met"] = _goal_met(keys.get(key), (goal["op"], goal["threshold"]))
        if goal["value"] is None:
            goal["reason"] = missing.get(key, "not measured")
    return {
        **keys,
        "mode": ctx.mode,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "goals": goals,
        "figures": figures,
        "sections": sections,
        "notes": notes,
        "missing": missing,
        "machine": machine_info(ctx),
    }


def render(report: dict[str, Any], file: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=120)
    table = Table(title=f"kvledger benchmarks ({report['mode']}, {report['elapsed_s']} s)")
    for col in ("section", "key", "value", "goal", "met"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for name, section in report["sections"].items():
        promised = next(s.keys for s in SECTIONS if s.name == name)
        keys = list(promised) + [k for k in report["goals"] if k not in promised
                                 and _section_of(report, k) == name]
        if not keys:
            table.add_row(section["title"], "-", section["status"], "", "")
        for key in keys:
            table.add_row(section["title"], key, *_cells(report, key, "NO"))
    console.print(table)
    rates = Table(title="absolute figures")
    rates.add_column("figure")
    rates.add_column("value", justify="right")
    for name, figs in report["figures"].items():
        for key, value in figs.items():
            if isinstance(value, (dict, list)):
                continue  # per-run detail: in the JSON only
            rates.add_row(f"{name}.{key}", f"{value:,}" if isinstance(value, (int, float)) else str(value))
    console.print(rates)
    m = report["machine"]
    console.print(f"machine: {m.get('cpu_model')} x{m.get('cpu_count')}, python {m.get('python')}, "
                  f"sqlite {m.get('sqlite')}, postgres {m.get('postgres')}, torch {m.get('torch')}")


def markdown(report: dict[str, Any]) -> str:
    """The headline table as Markdown (for docs/PERFORMANCE.md)."""
    lines = ["| section | key | value | goal | met |", "|---|---|---:|---|---|"]
    for name, section in report["sections"].items():
        promised = next(s.keys for s in SECTIONS if s.name == name)
        keys = list(promised) + [k for k in report["goals"] if k not in promised
                                 and _section_of(report, k) == name]
        for key in keys:
            shown, goal, met = _cells(report, key, "**no**")
            lines.append(f"| {section['title']} | `{key}` | {shown} | {goal} | {met} |")
    return "\n".join(lines)


def _cells(report: dict[str, Any], key: str, no: str) -> tuple[str, str, str]:
    """A headline row's value, goal and met cells. A figure that was not measured is
    `n/a`, and so is its goal's verdict, with the reason: never a pass by default."""
    value, goal = report.get(key), report["goals"].get(key)
    if value is None:
        why = report["missing"].get(key, "not measured")
        return "n/a", goal["goal"] if goal else "", f"n/a: {why}"
    shown = f"{value:,.3f}" if isinstance(value, float) and value < 100 else f"{value:,}"
    met = "" if goal is None or goal["met"] is None else ("yes" if goal["met"] else no)
    return shown, goal["goal"] if goal else "", met


def _section_of(report: dict[str, Any], key: str) -> str | None:
    if "section" in report["goals"].get(key, {}):  # a goal's key, which a headline keeps out of figures
        return str(report["goals"][key]["section"])
    for name, figs in report["figures"].items():
        if key in figs:
            return name
    return "journal" if key.startswith(("journal_", "postgres_")) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="short runs, 3 repeats; a torch pool far behind in the first is not run "
                           "again (under 8 minutes on 2 cores shared with other work)")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke",
                      help="tiny sizes, 1 repeat: checks that everything runs (CI)")
    size.add_argument("--full", action="store_const", dest="mode", const="full",
                      help="longer runs, 5 repeats (the default)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--markdown", metavar="FILE", help="also write the headline table as Markdown to FILE")
    p.add_argument("--only", nargs="+", choices=[s.name for s in SECTIONS], help="run only these sections")
    args = p.parse_args(argv)
    mode = args.mode or "full"
    assert mode in MODES
    ctx = Context(mode=mode)
    try:
        report = run_sections(ctx, args.only)
    finally:
        ctx.close()
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report) + "\n")
    if args.json:
        render(report, sys.stderr)
        json.dump(report, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        render(report, sys.stdout)
    return 1 if any(s["status"] == "error" for s in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
