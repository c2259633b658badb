#!/usr/bin/env python3
"""tools/multinode_cost.py: the paper model of docs/MULTINODE.md - the time
of one DDP step on 2 machines x 8 GPUs with NCCL, for the MLP and a
124M-parameter GPT, over a 100 or 400 Gb/s network. Not a measurement: the
bucket sizes are tandem's own (its Reducer's plan, printed by
TANDEM_DEBUG=INFO TANDEM_DEBUG_SUBSYS=DDP, see the doc); everything else
(GPU rates, link speeds, latencies) is an assumption written below.
Run: python3 tools/multinode_cost.py"""

MACHINES, GPUS = 2, 8
N = MACHINES * GPUS
NVLINK = 450e9          # bytes/s per GPU and direction (H100 NVLink 4), assumed
ALPHA_NET = 5e-6        # s per ring step that crosses the network, assumed
ALPHA_NVL = 1e-6        # s per step inside a machine, assumed
OPT_BW = 2e12           # bytes/s of HBM for AdamW's pass, assumed
LAUNCH_FLOOR = 0.1e-3   # s: the MLP's forward+backward is launch-bound, assumed

# Buckets (elements, float32), after the Reducer's rebuild in gradient-ready
# order; measured by tandem (see docs/MULTINODE.md for the commands).
MODELS = {
    "mlp 784-1024-1024-10, batch 16/GPU": dict(
        buckets=[1060048, 803840], params=1863696, flop=6 * 1863696 * 16, opt_bytes=0),
    "gpt:12-924-12-1024 (124.3M), 8x1024 tokens/GPU": dict(
        buckets=[3418080] + [6839472, 6836688, 6838560] * 5 + [6839472, 6836688] + [4605248],
        params=124272896,
        # 6 flops per parameter and token, plus attention (12 L T D per token)
        flop=(6 * 124272896 + 12 * 12 * 1024 * 924) * 8 * 1024,
        opt_bytes=124272896 * 4 * 7),  # AdamW: read p, g, m, v; write p, m, v
}


def ring(nbytes, net):
    """NCCL's ring over all N GPUs: every link carries 2(N-1)/N of the
    bucket, the network link (one NIC per machine) is the slowest."""
    return 2 * (N - 1) / N * nbytes / net + 2 * (N - 1) * ALPHA_NET


def hier(nbytes, net):
    """tandem's hier (and NCCL's tree-like schedules): reduce-scatter and
    all-gather over NVLink, the machine's 8 shards all-reduced between the
    2 machines in parallel: each machine sends its whole bucket once."""
    intra = 2 * (GPUS - 1) / GPUS * nbytes / NVLINK + 2 * (GPUS - 1) * ALPHA_NVL
    inter = 2 * (MACHINES - 1) / MACHINES * nbytes / GPUS * GPUS / net
    return intra + inter + 2 * (MACHINES - 1) * ALPHA_NET


def step(m, rate, net, coll):
    comp = max(m["flop"] / rate, LAUNCH_FLOOR)
    fwd, bwd = comp / 3, comp * 2 / 3
    # bucket b is ready when backward has produced its parameters (time
    # proportional to the parameters done); buckets go one after another
    done = end = 0.0
    for b in m["buckets"]:
        done += b
        ready = fwd + bwd * done / m["params"]
        end = max(ready, end) + coll(4 * b, net)
    total = sum(coll(4 * b, net) for b in m["buckets"])
    exposed = max(0.0, end - (fwd + bwd))
    opt = m["opt_bytes"] / OPT_BW
    return comp, total, exposed, fwd + bwd + exposed + opt


if __name__ == "__main__":
    print("%-46s %-5s %-9s %-4s %9s %9s %9s %9s" % ("model", "math", "network", "alg",
                                                   "compute", "comm", "exposed", "step"))
    for name, m in MODELS.items():
        for math, rate in (("FP32", 40e12), ("TF32", 200e12)):
            for gbit in (100, 400):
                for alg, coll in (("ring", ring), ("hier", hier)):
                    c, t, e, s = step(m, rate, gbit / 8 * 1e9, coll)
                    print("%-46s %-5s %3d Gb/s  %-4s %7.2f ms %6.2f ms %6.2f ms %6.2f ms"
                          % (name, math, gbit, alg, c * 1e3, t * 1e3, e * 1e3, s * 1e3))
