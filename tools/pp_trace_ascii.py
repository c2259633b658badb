#!/usr/bin/env python3
"""Draws the pipeline's tracks of a `tandem compare --modes ...,pp --trace
FILE` trace as text: one line per stage, one step (the last by default),
each micro-batch's forward as its number and its backward as a letter
(B0 = a, B1 = b, ...), idle time as '.'.

Usage: python3 tools/pp_trace_ascii.py TRACE.json [STEP] [WIDTH]"""
import json
import sys


def main():
    path = sys.argv[1]
    events = json.load(open(path))["traceEvents"]
    pp = [e for e in events if e.get("ph") == "X" and e["name"][:1] in "FB"
          and e["name"][1:].isdigit() and "step" in e.get("args", {})]
    if not pp:
        sys.exit("no pipeline events in %s (compare --modes ...,pp --trace)" % path)
    step = int(sys.argv[2]) if len(sys.argv) > 2 else max(e["args"]["step"] for e in pp)
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    ev = [e for e in pp if e["args"]["step"] == step]
    t0 = min(e["ts"] for e in ev)
    t1 = max(e["ts"] + e["dur"] for e in ev)
    scale = (t1 - t0) / width
    stages = sorted({e["tid"] for e in ev})
    print("step %d: %.3f ms across, one column = %.0f us" % (step, (t1 - t0) / 1e3, scale))
    for s in stages:
        row = ["."] * width
        for e in sorted((e for e in ev if e["tid"] == s), key=lambda e: e["ts"]):
            mb = int(e["name"][1:])
            mark = str(mb % 10) if e["name"][0] == "F" else chr(ord("a") + mb % 26)
            a = int((e["ts"] - t0) / scale)
            b = max(a + 1, int((e["ts"] + e["dur"] - t0) / scale))
            for c in range(a, min(b, width)):
                row[c] = mark
        print("stage %d |%s|" % (s, "".join(row)))
    print("digits: forward of micro-batch N; letters: backward (a = 0, b = 1, ...)")


main()
