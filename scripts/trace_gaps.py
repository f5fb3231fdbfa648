"""Where the device idles between kernels, from a chrome trace of `scripts/profile_step.py --trace`.

    python scripts/trace_gaps.py TRACE.json [--min-us 1] [--first-ms T] [--kernels]

Sorts the device's timeline (kernels, copies, memsets), sums the idle time between consecutive
activities, and lists which pairs (activity before -> activity after) the largest idle time sits
between: a gap after the last kernel of a step is the host not keeping up; gaps inside a CUDA graph
are launch latency. --first-ms keeps the first T ms of device time (e.g. a run's prefill steps);
--kernels also lists the device time per kernel name in that window.
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=1.0, help="gaps shorter than this are counted, not listed")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--first-ms", type=float, help="only the first T ms of device activity")
    ap.add_argument("--kernels", action="store_true", help="also the device time per kernel name")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    if not device:
        raise SystemExit("no device activity in the trace")
    if args.first_ms:
        device = [e for e in device if e["ts"] < device[0]["ts"] + args.first_ms * 1e3]
    if args.kernels:
        per_name = collections.defaultdict(lambda: [0, 0.0])
        for e in device:
            per_name[e["name"][:90]][0] += 1
            per_name[e["name"][:90]][1] += e["dur"]
        for name, (n, total) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {total / 1e3:8.3f} ms {n:6d}x {total / n:8.1f} us  {name}")
    by_pair = collections.defaultdict(lambda: [0, 0.0])
    small = 0.0
    end = device[0]["ts"] + device[0]["dur"]
    prev = device[0]
    for e in device[1:]:
        gap = e["ts"] - end
        if gap >= args.min_us:
            key = (prev["name"][:50], e["name"][:50])
            by_pair[key][0] += 1
            by_pair[key][1] += gap
        elif gap > 0:
            small += gap
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    span = end - device[0]["ts"]
    idle = small + sum(total for _, total in by_pair.values())
    busy = span - idle  # the union of the activities: with PDL a kernel may start before the last one ends
    print(f"{len(device)} activities over {span / 1e3:.3f} ms: busy {busy / 1e3:.3f} ms, idle {idle / 1e3:.3f} ms "
          f"(gaps < {args.min_us} us: {small / 1e3:.3f} ms)")
    for (before, after), (n, total) in sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  {total / 1e3:8.3f} ms {n:5d}x {total / n:8.1f} us  {before} -> {after}")


if __name__ == "__main__":
    main()
