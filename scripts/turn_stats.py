#!/usr/bin/env python3
"""The turn-level numbers of docs/ablations.md, from run directories.

For each run: the pass rate per block of updates (metrics.jsonl), and from
the trained trajectories (trajectories/step-*.jsonl) the malformed-turn
share per block (turns with a format error over all turns), the attempts
that ended `invalid_format`, and the trajectories trained on with a
positive reward that hold a malformed turn.

    python3 scripts/turn_stats.py runs/abl-full-s0 runs/abl-nogates-s0 --block 40
"""
import argparse
import glob
import json
import os


def blocks(values, size):
    out = []
    for i in range(0, len(values), size):
        chunk = [v for v in values[i:i + size] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else float("nan"))
    return out


def run_stats(run, size):
    steps = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "pass_rate" in m and "step" in m:
                steps[m["step"]] = m["pass_rate"]
    last = max(steps) if steps else 0
    pass_rates = [steps.get(s) for s in range(1, last + 1)]
    turns = [[0, 0] for _ in range(last)]  # per step: malformed, all
    ended_invalid = 0
    rewarded_malformed = 0
    trajectories = 0
    files = sorted(glob.glob(os.path.join(run, "trajectories", "step-*.jsonl")))
    for path in files:
        with open(path) as f:
            for line in f:
                t = json.loads(line)
                step = t["step"]
                if not 1 <= step <= last:
                    continue
                trajectories += 1
                bad = sum(1 for turn in t["turns"] if turn.get("format_error"))
                turns[step - 1][0] += bad
                turns[step - 1][1] += len(t["turns"])
                ended_invalid += t.get("termination") == "invalid_format"
                rewarded_malformed += bad > 0 and t.get("reward", 0) > 0
    share = []
    for i in range(0, last, size):
        bad = sum(b for b, _ in turns[i:i + size])
        all_ = sum(a for _, a in turns[i:i + size])
        share.append(bad / all_ if all_ else float("nan"))
    return {
        "run": os.path.basename(run.rstrip("/")),
        "updates": last,
        "pass": blocks(pass_rates, size),
        "malformed_turn_share": share,
        "trajectories": trajectories,
        "ended_invalid_format": ended_invalid,
        "rewarded_with_a_malformed_turn": rewarded_malformed,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--block", type=int, default=10, help="updates per block")
    a = p.parse_args()
    for run in a.runs:
        s = run_stats(run, a.block)
        fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)
        fmt3 = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
        print(f"{s['run']}: {s['updates']} updates, {s['trajectories']} trajectories")
        print(f"  pass by {a.block}s: {fmt(s['pass'])}")
        print(f"  malformed-turn share by {a.block}s: {fmt3(s['malformed_turn_share'])}")
        share = s["ended_invalid_format"] / max(s["trajectories"], 1)
        print(f"  ended invalid_format: {s['ended_invalid_format']} ({share:.1%})")
        print(f"  rewarded with a malformed turn: {s['rewarded_with_a_malformed_turn']}")


if __name__ == "__main__":
    main()
