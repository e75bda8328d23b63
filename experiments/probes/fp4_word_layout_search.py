"""Search: the cheapest bit layout of a held FP4 word (pallas_kernels.moe.fp4_kernel_weights) for the register decode.

A thread decodes one 32-bit held word (8 E2M1 weights) into four bf16x2 words. Word w's two lanes need each
E2M1 field on bf16 bits (6, 7, 8, 15) (+16 for lane 1: the exponent's low two bits, the mantissa's top bit,
the sign). Each field f of word w is fetched by rotating the held word right by a shift s(w, f): one `shf`
per distinct nonzero shift (shared by all words), then per word one `and` for its first shift and one `lop3`
merge for each further one. Both lanes rotate alike, so a layout is valid when the source positions
(bit + s) mod 16 of all 4 x 4 (word, field) pairs cover the 16 lane positions exactly once. This enumerates
every set of shifts and every assignment, and prints the cheapest layouts (pallas_kernels.moe.FP4_WORD_SHIFTS is
one of them: 9 instructions; r nonzero rotations cost at least r + 4, so past 5 none can beat 9: a bound of 6
distinct rotations is exhaustive, the default 7 checks one more; about 3 minutes on one core):

  python -m experiments.probes.fp4_word_layout_search [--max-shifts 7]
"""

from __future__ import annotations

import argparse
import itertools

from pallas_kernels.moe import FP4_FIELD_BITS as FIELD_BITS


def search(max_shifts: int) -> tuple[int, list]:
    """(cost in instructions, [(shifts, per-word field shifts)]) of the cheapest layouts."""
    best, found = 10 ** 9, []
    for n in range(1, max_shifts + 1):
        for nonzero in itertools.combinations(range(1, 16), n - 1):
            shifts = (0, *nonzero)
            words = []   # (lane positions covered, instructions, field shifts) of one decoded word
            for f in itertools.product(shifts, repeat=4):
                cover = frozenset((b + s) % 16 for b, s in zip(FIELD_BITS, f))
                if len(cover) == 4:
                    words.append((cover, len(set(f)), f))

            def extend(covered, chosen, cost):   # cost: the n - 1 rotations plus the words' and / lop3
                nonlocal best, found
                if cost + (4 - len(chosen)) > best:
                    return
                if len(chosen) == 4:   # every rotation of the set used (subsets were enumerated before)
                    if len(covered) == 16 and {s for _, _, f in chosen for s in f} == set(shifts):
                        found = ([] if cost < best else found) + [(shifts, [f for _, _, f in chosen])]
                        best = cost
                    return
                first = min(set(range(16)) - covered)   # the words are interchangeable: cover in order
                for cover, ops, f in words:
                    if first in cover and not cover & covered:
                        extend(covered | cover, chosen + [(cover, ops, f)], cost + ops)

            extend(frozenset(), [], n - 1)
    return best, found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-shifts", type=int, default=7, help="distinct rotations, 0 included")
    a = p.parse_args()
    cost, layouts = search(a.max_shifts)
    print(f"cheapest: {cost} integer instructions per held word (8 weights); {len(layouts)} layouts")
    for shifts, fields in layouts[:12]:
        print(f"  shifts {shifts}: per word {fields}")


if __name__ == "__main__":
    main()
