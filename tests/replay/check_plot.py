#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vmm-plot and vmm-replay --samples, end to end (host only).

1. vmm-plot on the trace: the SVG parses as XML, holds the one live series, and its peak marker
   carries the trace's true peak (recomputed here from the trace itself) and sits on the line.
2. vmm-replay --samples on the trace with vmmalloc (host backend) and null: the JSON timeline is
   well formed, its peaks agree with the trace and with the timed pass, mapped >= live throughout.
3. vmm-plot on that JSON: live (shared), vmmalloc mapped, vmmalloc reserved (off scale) series;
   null adds none; peak labels do not overlap.
4. Error paths: JSON without a timeline, malformed JSON, missing file, missing -o, --samples
   without --json: each exits 2 with a message that says what is wrong.

usage: check_plot.py PLOT REPLAY TRACE WORKDIR
"""
import gzip
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

NS = {"s": "http://www.w3.org/2000/svg"}
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)
    return cond


def run(args, want_rc=0):
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != want_rc:
        print(p.stdout)
        print(p.stderr)
    check(p.returncode == want_rc, f"{' '.join(args)}: exit {p.returncode}, want {want_rc}")
    return p


def trace_live(path):
    """Live bytes after each event, computed independently of the C++ parser."""
    opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
    live, sizes, out = 0, {}, []
    with opener(path, "rt") as f:
        for line in f:
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            op, addr, size = parts[0], parts[1], int(parts[2])
            if op == "a":
                sizes[addr] = size
                live += size
            else:
                live -= sizes.pop(addr)
            out.append(live)
    return out


def series_of(root):
    got = {}
    for g in root.iter("{%s}g" % NS["s"]):
        if g.get("class") == "series":
            got[(g.get("data-allocator"), g.get("data-kind"))] = g
    return got


def peaks_of(root):
    return {(g.get("data-allocator"), g.get("data-kind")): g
            for g in root.iter("{%s}g" % NS["s"]) if g.get("class") == "peak"}


def points(g):
    pl = g.find("s:polyline", NS)
    if pl is None:
        return []
    return [tuple(float(v) for v in p.split(",")) for p in pl.get("points").split()]


def check_peak_on_line(root, key, bytes_, event):
    s, pk = series_of(root).get(key), peaks_of(root).get(key)
    if not check(s is not None and pk is not None, f"series and peak marker {key} present"):
        return
    check(int(s.get("data-peak-bytes")) == bytes_, f"{key}: series peak {s.get('data-peak-bytes')} == {bytes_}")
    check(int(s.get("data-peak-event")) == event, f"{key}: series peak event {s.get('data-peak-event')} == {event}")
    check(int(pk.get("data-bytes")) == bytes_, f"{key}: marker bytes == {bytes_}")
    pts = points(s)
    check(len(pts) > 10, f"{key}: polyline has points ({len(pts)})")
    c = pk.find("s:circle", NS)
    top = min(y for _, y in pts)  # SVG y grows downwards: the highest point
    check(abs(float(c.get("cy")) - top) < 0.05, f"{key}: peak dot y {c.get('cy')} is the line's top {top}")
    at = [x for x, y in pts if abs(y - top) < 0.05]
    check(any(abs(float(c.get("cx")) - x) < 0.05 for x in at), f"{key}: peak dot x {c.get('cx')} on a top point {at}")


def check_labels_apart(root, what):
    boxes = []
    for g in peaks_of(root).values():
        r = g.find("s:rect", NS)
        boxes.append(tuple(float(r.get(k)) for k in ("x", "y", "width", "height")))
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            a, b = boxes[i], boxes[j]
            apart = a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1]
            check(apart, f"{what}: peak labels {i} and {j} do not overlap")


def main():
    plot, replay, trace, work = sys.argv[1:5]
    os.makedirs(work, exist_ok=True)
    for stale in ("x.svg", "trace.svg", "replay.svg", "unicode.svg", "replay-samples.json"):
        if os.path.exists(os.path.join(work, stale)):
            os.remove(os.path.join(work, stale))
    live = trace_live(trace)
    peak = max(live)
    peak_event = live.index(peak)
    print(f"trace: {len(live)} events, peak live {peak} B after event {peak_event}")

    # 1. trace -> SVG
    svg1 = os.path.join(work, "trace.svg")
    run([plot, trace, "-o", svg1, "--samples", "1500"])
    root = ET.parse(svg1).getroot()
    check(root.tag == "{%s}svg" % NS["s"], "root element is svg")
    check(set(series_of(root)) == {("", "live")}, f"trace plot: only the live series ({set(series_of(root))})")
    check_peak_on_line(root, ("", "live"), peak, peak_event)
    check(len(points(series_of(root)[("", "live")])) <= 1503, "trace plot: at most --samples + 3 points")
    title = root.find("s:title", NS)
    check(title is not None and os.path.basename(trace) in title.text, "trace plot: title names the trace")

    # 2. vmm-replay --samples
    js = os.path.join(work, "replay-samples.json")
    run([replay, trace, "--allocators", "vmmalloc,null", "--samples", "400", "--json", js])
    rows = {r["name"]: r for r in json.load(open(js))}
    check(set(rows) == {"vmmalloc", "null"}, f"JSON rows {set(rows)}")
    for name, r in rows.items():
        tl = r.get("timeline")
        if not check(tl is not None, f"{name}: has a timeline"):
            continue
        ev = tl["event"]
        check(tl["events"] == len(live), f"{name}: timeline.events == {len(live)}")
        check(0 < len(ev) <= 403 and tl["samples"] == len(ev), f"{name}: {len(ev)} samples, at most 403")
        check(all(a < b for a, b in zip(ev, ev[1:])) and ev[-1] == len(live) - 1, f"{name}: events increase to the last")
        check(len(tl["live"]) == len(ev), f"{name}: live as long as event")
        # Each sample is the maximum of the live bytes since the previous sample.
        prev, ok = 0, True
        for e, v in zip(ev, tl["live"]):
            ok = ok and v == max(live[prev:e + 1])
            prev = e + 1
        check(ok, f"{name}: live samples are the maxima of the trace's live bytes")
        check(tl["peaks"]["live"] == {"event": peak_event, "bytes": peak}, f"{name}: live peak {tl['peaks']['live']}")
    v = rows["vmmalloc"]["timeline"]
    check(v["peaks"]["mapped"]["bytes"] == rows["vmmalloc"]["peak_mapped_bytes"],
          "vmmalloc: timeline mapped peak == the timed pass's peak_mapped_bytes (host replay is deterministic)")
    check(all(m >= l for m, l in zip(v["mapped"], v["live"])), "vmmalloc: mapped >= live at every sample")
    check(v["reserved"] and v["peaks"]["reserved"]["bytes"] == rows["vmmalloc"]["peak_reserved_bytes"],
          "vmmalloc: reserved series matches peak_reserved_bytes")
    n = rows["null"]["timeline"]
    check(n["mapped"] is None and n["peaks"]["mapped"] is None, "null: mapped not observable -> null")

    # 3. JSON -> SVG
    svg2 = os.path.join(work, "replay.svg")
    run([plot, js, "-o", svg2])
    root = ET.parse(svg2).getroot()
    got = series_of(root)
    want = {("", "live"), ("vmmalloc", "mapped"), ("vmmalloc", "reserved")}
    check(set(got) == want, f"replay plot series {set(got)} == {want}")
    check_peak_on_line(root, ("", "live"), peak, peak_event)
    check_peak_on_line(root, ("vmmalloc", "mapped"), v["peaks"]["mapped"]["bytes"], v["peaks"]["mapped"]["event"])
    res = got.get(("vmmalloc", "reserved"))
    check(res is not None and res.get("data-off-scale") == "true" and not points(res),
          "vmmalloc reserved (512 GiB VA) is off scale: listed, not drawn")
    legend = " ".join(t.text or "" for t in root.iter("{%s}text" % NS["s"]))
    check("off scale" in legend and "512 GiB" in legend, "legend states the off-scale reserved value")
    check_labels_apart(root, "replay plot")

    # 3b. Non-ASCII names: Python writes them as \u escapes (a surrogate pair for the emoji); the
    # SVG must carry them back as the same characters.
    uni = os.path.join(work, "replay-unicode.json")
    name = "caf\u00e9 \U0001F600"
    rows_u = json.load(open(js))
    for r in rows_u:
        if r["name"] == "vmmalloc":
            r["name"] = name
    text = json.dumps(rows_u)  # ensure_ascii: \u00e9, \ud83d\ude00
    check("\\ud83d\\ude00" in text, "the test JSON holds the emoji as a surrogate pair")
    open(uni, "w").write(text)
    svg3 = os.path.join(work, "unicode.svg")
    run([plot, uni, "-o", svg3])
    got = series_of(ET.parse(svg3).getroot())
    check((name, "mapped") in got, f"non-ASCII allocator name round-trips into the SVG ({set(got)})")

    # 4. errors
    plain = os.path.join(work, "replay-plain.json")
    run([replay, trace, "--allocators", "null", "--json", plain])
    p = run([plot, plain, "-o", os.path.join(work, "x.svg")], 2)
    check("--samples" in p.stderr, f"JSON without timeline: message names --samples ({p.stderr.strip()})")
    bad = os.path.join(work, "bad.json")
    open(bad, "w").write('[{"name": "x", "timeline": {"events": 3,\n "event": [0, 1, ]}}]')
    p = run([plot, bad, "-o", os.path.join(work, "x.svg")], 2)
    check("not valid JSON: line 2" in p.stderr, f"malformed JSON: message gives the line ({p.stderr.strip()})")
    p = run([plot, os.path.join(work, "no-such-file"), "-o", os.path.join(work, "x.svg")], 2)
    check("cannot open" in p.stderr, f"missing input: {p.stderr.strip()}")
    p = run([plot, trace], 2)
    check("-o" in p.stderr, f"missing -o: {p.stderr.strip()}")
    p = run([replay, trace, "--samples", "10"], 2)
    check("--json" in p.stderr, f"--samples without --json: {p.stderr.strip()}")
    check(not os.path.exists(os.path.join(work, "x.svg")), "no SVG written on bad input")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
