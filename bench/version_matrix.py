"""Every repro on every installed vLLM release: is the verdict right, and with --patched, is the hang gone?

    python bench/version_matrix.py [--vllm 0.19.1,0.32.0] [--repros admission-wedge,engine-deadlock]
                                   [--patched] [--jobs N] [--json] [--out DIR]

For each managed runtime (`wedgectl runtime list`; `wedgectl runtime install --vllm V` adds one) and each
repro (`wedgectl repro --list`), runs `wedgectl repro NAME --vllm V --json` and prints a table of releases x
repros: the verdict and whether it is the expected one (`ok` / `WRONG`); with --patched, also
`wedgectl repro NAME --patched --vllm V`: whether the hang is gone, each check passed (`gone`), or which of its
checks failed (`fails CHECK`). A fault a release lacks
the code for patches nothing there (the plugin logs why): the cell then shows what the stock release does
(0.19's own admission wedge needs no fault). A repro whose `[requires]` the release's source lacks is `n/a`
(wedgectl repro exits 46 there, starting nothing). Each cell's bundle and server log stay under --out.

Slow by nature: a server start per cell (30-60 s on 2 cores). The README's table comes from here, with the
date and the command.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wedgectl.lab.repro import list_configs  # noqa: E402
from wedgectl.lab.runtime.install import installed_runtimes  # noqa: E402

# The TP repros need two ranks' worth of cores and a compiled model: left to the 0.32 suite.
SKIP = {"collective-hang", "healthy-tp2"}
TIMEOUT_S = 900
NOT_APPLICABLE = 46  # wedgectl's exit code: the repro's [requires] does not hold on that release


def run(args: list[str], out: Path) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "wedgectl", "repro", *args, "--json", "-q", "--out", str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    try:
        data = json.loads(done.stdout)
    except ValueError:
        data = {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return done.returncode, data, time.monotonic() - t0


def cell(version: str, name: str, expected: str, patched: bool, out: Path) -> dict:
    rc, data, took = run([name, "--vllm", version], out / version / name)
    got = data.get("verdict")
    row = {"vllm": version, "repro": name, "expected": expected, "verdict": got, "right": got == expected,
           "rc": rc, "seconds": round(took, 1), "error": data.get("error")}
    if rc == NOT_APPLICABLE:  # the release lacks the code the hang lives in: nothing to judge
        row.update(verdict="n/a", right=True, applies=False)
        return row
    if patched and expected not in ("idle", "progressing"):
        prc, pdata, ptook = run([name, "--patched", "--vllm", version], out / version / f"{name}-patched")
        row.update(patched_passed=bool(pdata.get("passed")), patched_rc=prc, patched_seconds=round(ptook, 1),
                   patched_failed=[c["name"] for c in pdata.get("checks", ()) if not c.get("passed")])
    return row


def table(rows: list[dict], versions: list[str], names: list[str], patched: bool) -> list[str]:
    width = max(16, *(len(n) for n in names))
    lines = [f"{'repro':<{width}} " + " ".join(f"{v:<22}" for v in versions)]
    for name in names:
        cells = []
        for v in versions:
            r = next((r for r in rows if r["vllm"] == v and r["repro"] == name), None)
            if r is None:
                cells.append("-")
                continue
            if r.get("applies") is False:
                cells.append("n/a")
                continue
            text = f"{r['verdict'] or 'error'} {'ok' if r['right'] else 'WRONG'}"
            if patched and "patched_passed" in r:
                text += ", gone" if r["patched_passed"] else f", fails {'+'.join(r['patched_failed']) or '?'}"
            cells.append(text)
        lines.append(f"{name:<{width}} " + " ".join(f"{c:<22}" for c in cells))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", help="comma list of releases (default: every installed runtime)")
    ap.add_argument("--repros", help="comma list of repros (default: all but the TP ones)")
    ap.add_argument("--patched", action="store_true", help="also run each hang with the fixes on")
    ap.add_argument("--json", action="store_true", help="one JSON object per cell, then a summary object")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cells run at once (default 1); each starts its own server, so more load the host more")
    ap.add_argument("--out", type=Path, help="where bundles and logs stay (default: a new temporary folder)")
    args = ap.parse_args()
    versions = args.vllm.split(",") if args.vllm else [r.vllm for r in installed_runtimes()]
    configs = {c.name: c for c in list_configs()}
    names = args.repros.split(",") if args.repros else [n for n in configs if n not in SKIP]
    unknown = [n for n in names if n not in configs]
    if unknown or not versions:
        print(f"version_matrix: {'unknown repro ' + ', '.join(unknown) if unknown else 'no runtime installed'}",
              file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="wedgectl-matrix-"))
    todo = [(v, n) for v in versions for n in names]

    def one(job: tuple[str, str]) -> dict:
        v, n = job
        print(f"version_matrix: {v} {n} ...", file=sys.stderr, flush=True)
        row = cell(v, n, configs[n].expected, args.patched, out)
        print(f"version_matrix: {v} {n}: {row['verdict']} {'ok' if row['right'] else 'WRONG'}"
              + (f", patched {'gone' if row['patched_passed'] else 'fails ' + '+'.join(row['patched_failed'])}"
                 if "patched_passed" in row else ""),
              file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(row), flush=True)
        return row

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, todo))
    right = sum(r["right"] for r in rows)
    gone = [r for r in rows if "patched_passed" in r]
    summary = {"date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
               "cells": len(rows), "right": right, "patched": len(gone), "gone": sum(r["patched_passed"] for r in gone),
               "load": os.getloadavg()[0], "jobs": args.jobs, "out": str(out)}
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(table(rows, versions, names, args.patched)))
        print(f"{right}/{len(rows)} verdicts right" + (f", {summary['gone']}/{len(gone)} hangs gone with the fixes"
                                                          if gone else "")
              + f"; {summary['date']}, {args.jobs} at a time, load {summary['load']:.1f}; bundles under {out}")
    return 0 if right == len(rows) and all(r["patched_passed"] for r in gone) else 1


if __name__ == "__main__":
    sys.exit(main())
