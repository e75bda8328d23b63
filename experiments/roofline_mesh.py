"""The mesh terms of a step's floor (experiments/roofline.py): bytes moved between GPUs, expert placement and
balance, and the time the links need.

Transports of the routed experts' rows (sharding/expert_parallel.py), per MoE layer and device, with
m = rows per device (attention is data-parallel over dp*ep devices), k = experts per token, D = hidden,
ep / tp the mesh's widths. Every count is what one device sends; a collective or an exchange receives as
much as it sends, and links are full duplex, so the time is bytes / one direction's bandwidth.

  "all_to_all"  dispatch and combine (the floor's default; DeepEP's exchange, and ours with the ragged
                transport): each (token, choice) row goes to the device owning its expert and comes back,
                m k (ep - 1) / ep rows each way (a choice lands on this device with probability 1 / ep):
                dispatch in `dispatch_dtype` (FP8 with one fp32 scale per 128 values, as DeepEP sends it, or
                bf16), combine in bf16. A transport that sends a token once per destination device rather
                than once per choice moves less when a token's experts share a device.
  "gather"      this engine's default for more than 8 rows per device (EPConfig "auto"): an all-gather of the
                rows over ep (bf16 rows + int32 ids + fp32 weights: (ep - 1) m (2 D + 8 k) bytes) and a
                reduce-scatter of the fp32 partial sums ((ep - 1) m 4 D bytes, ring).
  "replicate"   this engine's choice for at most 8 rows per device: the rows all-gathered over ep as above,
                and an all-reduce of the fp32 partial sums over ep x tp (2 (n - 1) / n x ep m 4 D bytes, ring).

With tp > 1: each tp rank holds a slice of the heads / intermediate width, so the attention output and the
MoE output are all-reduced over tp (2 (tp - 1) / tp x m D x 2 bytes each, bf16 ring; replicate's all-reduce
already spans tp) and the head's logits are all-gathered ((tp - 1) / tp x rows V x 2 bytes).

The gather and replicate transports also hand every device's expert kernels the rows of its whole EP group,
which they drop unless routed to a local expert: `foreign_row_choices` counts those (row, choice) pairs, which
cost no bytes in the floor but time in the estimate (experiments/roofline_estimate.py).

Where the bytes go: devices are numbered (dp, ep, tp) row-major and NVLink domains are consecutive blocks of
`nvlink_domain` devices, so of a device's ep - 1 expert-parallel peers min(ep - 1, (domain - 1) // tp) share
its domain; traffic is spread evenly over the peers, the in-domain share over NVLink and the rest over the
scale-out network, both at once: time = max(NVLink bytes / NVLink bandwidth, scale-out bytes / its bandwidth).

Redundant experts (`redundant`): S = E + R expert slots, S / ep per device (sharding/placement.py), the R
extra slots holding replicas of the most loaded experts; a row routed to an expert goes to one of its
replicas. They change the bytes (a device holds and, once all its slots see rows, reads S / ep experts
instead of E / ep) and the balance: the busiest device's routed rows set the experts' FLOPs and the rows it
receives and sends back (`imbalance` = max / mean device load multiplies both; the weight bytes are the mean
device's, every slot being touched once a step routes more rows than there are slots).
  * Forced balance: every expert has the same load; the placement is sharding.placement.rebalance of that
    load and its imbalance is exact (1.0 whenever the replicas pack evenly). With fewer (row, choice) pairs
    than slots the forced-balance ids (i k + j) mod E fill consecutive slots: the first devices hold them all.
  * Uniform random routing: a device's load is binomial (picks, 1 / ep); the expected maximum over ep devices
    is taken as mean + sqrt(2 ln ep) standard deviations. Replicas placed from a recorded load do not help
    i.i.d. routing (the last window's hot experts are not the next one's), so R changes only the bytes there.
"""

from __future__ import annotations

import functools
import math

TRANSPORTS = ("all_to_all", "gather", "replicate")
DISPATCH_DTYPES = {"fp8": 1.0 + 4.0 / 128, "bf16": 2.0}  # bytes per value sent (FP8: + one fp32 scale per 128)
COMBINE_BYTES = 2.0                                         # bf16 results back
GATHER_INDEX_BYTES = 8.0                                    # int32 expert id + fp32 weight per (row, choice)
PARTIAL_BYTES = 4.0                                         # fp32 partial sums (psum_scatter / psum)
REPLICATE_MAX_ROWS = 8                                      # EPConfig.replicate_max_tokens


def engine_transport(rows_per_device: float) -> str:
    """The transport this engine picks (EPConfig defaults: strategy "auto", transport "auto")."""
    return "replicate" if rows_per_device <= REPLICATE_MAX_ROWS else "gather"


def moe_traffic(rows: float, hidden: int, k: int, ep: int, tp: int, transport: str, dispatch_dtype: str,
                imbalance: float = 1.0) -> dict[tuple[str, str], float]:
    """Bytes one device sends for one MoE layer: {(group, part): bytes}, group "ep" or "tp".

    rows: rows per device; imbalance: max / mean routed rows per device (the busiest device receives that
    much more in dispatch and sends that much more in combine)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"dispatch_dtype must be one of {tuple(DISPATCH_DTYPES)}, got {dispatch_dtype!r}")
    out: dict[tuple[str, str], float] = {}
    if ep > 1:
        if transport == "all_to_all":
            routed = rows * k * (ep - 1) / ep * imbalance
            out[("ep", "moe_dispatch")] = routed * hidden * DISPATCH_DTYPES[dispatch_dtype]
            out[("ep", "moe_combine")] = routed * hidden * COMBINE_BYTES
        else:
            out[("ep", "moe_all_gather")] = (ep - 1) * rows * (2.0 * hidden + GATHER_INDEX_BYTES * k)
            if transport == "gather":
                out[("ep", "moe_reduce_scatter")] = (ep - 1) * rows * PARTIAL_BYTES * hidden
    if transport == "replicate" and ep * tp > 1:
        n = ep * tp
        out[("ep", "moe_all_reduce")] = 2.0 * (n - 1) / n * ep * rows * PARTIAL_BYTES * hidden
    if tp > 1 and transport != "replicate":
        out[("tp", "moe_all_reduce")] = all_reduce_bytes(rows * hidden * 2.0, tp)
    return out


def foreign_row_choices(rows: float, k: int, ep: int, transport: str) -> float:
    """(row, choice) pairs of other devices that one device's expert kernels are handed in one MoE layer: the
    gather and replicate transports give every device all rows of its EP group (its kernels drop the rows
    routed elsewhere); all_to_all sends each device only its own."""
    return 0.0 if transport == "all_to_all" else (ep - 1) * rows * k


def all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes one device sends in a ring all-reduce of an `nbytes` buffer over n devices."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def all_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes one device sends in a ring all-gather of a buffer of `nbytes` in total over n devices."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


def in_domain_share(group: str, ep: int, tp: int, domain: int) -> float:
    """Share of a device's traffic in `group` ("ep" | "tp") whose peer sits in its NVLink domain."""
    if group == "tp":
        peers, near = tp - 1, min(tp - 1, domain - 1)
    elif group == "ep":
        peers, near = ep - 1, min(ep - 1, (domain - 1) // tp)
    else:
        raise ValueError(f"unknown communication group {group!r}")
    return 1.0 if peers == 0 else near / peers


def link_time(sent: dict[tuple[str, str], float], mesh: tuple[int, int, int], ceilings: dict) -> dict:
    """{(group, part): bytes sent per device} on `ceilings`' links -> bytes over NVLink / scale-out and the time."""
    _, ep, tp = mesh
    total = sum(sent.values())
    if total and not all(ceilings.get(key) for key in ("nvlink_Bps", "nvlink_domain", "scaleout_Bps")):
        raise ValueError(f"ceilings {ceilings.get('name', '?')!r} have no link bandwidths (nvlink_Bps, "
                         "nvlink_domain, scaleout_Bps) for a mesh step that communicates")
    nvlink = scaleout = 0.0
    for (group, _), nbytes in sent.items():
        near = in_domain_share(group, ep, tp, int(ceilings["nvlink_domain"]))
        nvlink += nbytes * near
        scaleout += nbytes * (1.0 - near)
    nvlink_s = nvlink / ceilings["nvlink_Bps"] if nvlink else 0.0
    scaleout_s = scaleout / ceilings["scaleout_Bps"] if scaleout else 0.0
    return {"bytes": total, "nvlink_bytes": nvlink, "scaleout_bytes": scaleout, "nvlink_s": nvlink_s,
            "scaleout_s": scaleout_s, "comm_s": max(nvlink_s, scaleout_s)}


def expert_placement(num_experts: int, redundant: int, ep: int, picks: float, forced_balance: bool) -> dict:
    """Slots and balance of one MoE layer's experts over ep devices.

    picks: routed (row, choice) pairs of one EP group. Returns {slots, slots_per_device, touched_per_device
    (slots per device that see rows), imbalance (max / mean routed rows per device), rule}."""
    if redundant < 0:
        raise ValueError(f"redundant experts must be >= 0, got {redundant}")
    slots = num_experts + redundant
    if slots % ep:
        raise ValueError(f"{num_experts} experts + {redundant} redundant = {slots} slots are not divisible by ep={ep}")
    per_device = slots // ep
    if forced_balance:
        touched = min(slots, picks) / ep
        if picks >= slots:
            imbalance = _balanced_imbalance(num_experts, redundant, ep)
            rule = "forced balance: equal expert loads, placed by sharding.placement.rebalance (exact)"
        else:   # the ids (i k + j) mod E fill consecutive slots: the first devices take them all
            imbalance = min(picks, per_device) * ep / picks if picks else 1.0
            rule = "forced balance with fewer picks than slots: consecutive slots, the first devices busiest"
    else:
        touched = slots * (1.0 - (1.0 - 1.0 / slots) ** picks) / ep
        imbalance = 1.0
        if ep > 1 and picks > 0:
            p = 1.0 / ep
            imbalance = 1.0 + math.sqrt(2.0 * math.log(ep)) * math.sqrt(picks * p * (1 - p)) / (picks * p)
        rule = "uniform random routing: binomial device loads, expected max = mean + sqrt(2 ln ep) sd"
    return {"experts": num_experts, "redundant": redundant, "slots": slots, "slots_per_device": per_device,
            "touched_per_device": touched, "imbalance": imbalance, "rule": rule}


@functools.lru_cache(maxsize=None)
def _balanced_imbalance(num_experts: int, redundant: int, ep: int) -> float:
    """max / mean device load of equal expert loads placed by sharding.placement.rebalance."""
    from sharding.placement import rebalance

    load = [1.0] * num_experts
    return rebalance(load, ep, redundant).imbalance(load, ep) if ep > 1 else 1.0
