"""Where each thread of a benchmarked process spent its time, from py-spy's raw samples (not a test; a reading
aid for docs/BENCHMARKS.md).

``py-spy record --threads --idle --format raw`` writes one line per distinct stack: the thread, its frames
root first, and how many samples saw it. Per thread this prints its share of the samples and the frames that
took the most of them: the leaf (what ran, or waited, at that moment) and the deepest frame of our own code
(which of laionkit's lines led there). ``--within`` keeps the main thread's samples under a given frame (e.g.
``end_to_end``: the timed run, not the bare forward or the CPU-side pass); other threads are kept whole.

    py-spy record -r 50 --threads --idle --format raw -o spy.txt -- python3 scripts/bench_score.py ...
    python scripts/spy_threads.py spy.txt --within end_to_end
"""

from __future__ import annotations

import argparse
import collections
import re

OURS = re.compile(r"\((?:laionkit|scripts)/|\(bench_\w+\.py")


def read(path: str) -> list[tuple[str, list[str], int]]:
    """(thread, frames root first, samples) per line of a raw py-spy file."""
    stacks = []
    with open(path) as lines:
        for line in lines:
            line = line.rstrip("\n")
            if not line or " " not in line:
                continue
            stack, count = line.rsplit(" ", 1)
            frames = stack.split(";")
            stacks.append((frames[0], frames[1:], int(count)))
    return stacks


def summary(stacks: list[tuple[str, list[str], int]], within: str | None, top: int) -> str:
    kept = [(thread, frames, count) for thread, frames, count in stacks
            if not within or "MainThread" not in thread or any(within in frame for frame in frames)]
    per_thread: dict[str, int] = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    ours: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, frames, count in kept:
        # a thread's name as py-spy last saw it for its id, which a later thread may reuse (a Pool's helper, then
        # a pixel thread): the shallowest frame of ours tells them apart
        own = [frame for frame in frames if OURS.search(frame)]
        root = re.sub(r" \(.*", "", own[0]) if own else "-"
        label = re.sub(r"^thread \(\d+\):?\s*", "", thread) or thread
        name = f"{label} [{root}]"
        per_thread[name] += count
        leaves[name][frames[-1] if frames else "?"] += count
        ours[name][own[-1] if own else "(no frame of ours)"] += count
    total = sum(per_thread.values()) or 1
    out = [f"{total} samples{f' (main thread within {within!r})' if within else ''}"]
    for name, count in sorted(per_thread.items(), key=lambda item: -item[1]):
        if count < total / 100:
            continue
        out.append(f"\n== {name}: {count} samples")
        for title, counter in (("leaf", leaves[name]), ("deepest frame of ours", ours[name])):
            out.append(f"  by {title}:")
            out += [f"    {100 * n / count:5.1f} %  {frame[:150]}" for frame, n in counter.most_common(top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy record --format raw output")
    parser.add_argument("--within", help="keep the main thread's samples under a frame containing this text")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    print(summary(read(args.raw), args.within, args.top))


if __name__ == "__main__":
    main()
