"""Probe: opcode histogram of a SASS dump (static counts per kernel), to compare register decodes.

Input: what `MOSAIC_GPU_DUMP_SASS=1 python -m experiments.probes.moe_profile_target ... --cuda-root
/usr/local/cuda` prints (nvdisasm text). Every kernel section (a `.text.<name>` line starts one) gets its
instruction count and its most frequent opcodes (predicates and modifiers dropped: `@P0 IMAD.SHL.U32` counts
as IMAD).
Run: python -m experiments.probes.sass_opcodes FILE [--top 16]
"""

from __future__ import annotations

import argparse
import collections
import re

INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
SECTION = re.compile(r"\.text\.(\S+?)[:\s]")


def histograms(text: str) -> list[tuple[str, collections.Counter]]:
    """[(kernel name, opcode counts)] in the order the dump lists the kernels."""
    out: list[tuple[str, collections.Counter]] = []
    for line in text.splitlines():
        if (m := SECTION.search(line)) and not INSTRUCTION.search(line):
            out.append((m.group(1), collections.Counter()))
        elif (m := INSTRUCTION.search(line)) and out:
            out[-1][1][m.group(1)] += 1
    return [(name, c) for name, c in out if c]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--top", type=int, default=16)
    args = p.parse_args()
    with open(args.file, errors="replace") as f:
        text = f.read()
    for name, counts in histograms(text):
        top = " ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
        print(f"{name[:40]:<40} {sum(counts.values()):6d}: {top}")


if __name__ == "__main__":
    main()
