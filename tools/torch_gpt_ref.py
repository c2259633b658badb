#!/usr/bin/env python3
"""tools/torch_gpt_ref.py: PyTorch training the same GPT as tandem's
(models/gpt.c, `tandem bench train --model gpt:L-D-H-T`), for a tokens/s
comparison on the same GPU in the same run (the GPU bundle's benchmarks,
cuda/gpu-bench.sh).

What is the same as tandem's benchmark, as far as it matters for speed:
  - the model: byte vocabulary (256), learned token and position embeddings,
    L pre-LayerNorm blocks (LayerNorm eps 1e-5, causal multi-head attention
    with the (B, H, T, T) scores materialised, an MLP of width 4D with tanh
    GELU, biases everywhere), a final LayerNorm and a head tied to the token
    embedding, no dropout; the parameter count is checked against tandem's
    (--count-only needs no torch);
  - initialisation: N(0, 0.02), the two c_proj weights N(0, 0.02/sqrt(2L)),
    biases 0, LayerNorm weight 1 (GPT-2's, tandem's);
  - the step: B windows of T random bytes made on the host and copied to
    the GPU each step, cross-entropy on every position, AdamW (lr 1e-3,
    betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every parameter:
    tandem's defaults; PyTorch's default multi-tensor implementation),
    loss.item() every step (tandem reads the loss back every step too);
  - FP32 matmuls unless --tf32 (tandem: TANDEM_CUDA_TF32=1).
Not the same: PyTorch's own kernels (cuBLAS through its allocator, fused
softmax, etc.); --attn sdpa also times F.scaled_dot_product_attention
(flash attention), what a PyTorch user would write, which tandem lacks.

Timing: 5 warm-up steps, then --steps steps, each ended by
torch.cuda.synchronize(); the median is reported. One JSON object per line
and configuration on stdout.

Written where torch is not installed: only its --count-only formula and
its syntax are tested (tests/test_gpu_bundle.c); the training part has not
run yet.

  python3 tools/torch_gpt_ref.py --count-only --model gpt:4-128-4-128
  python3 tools/torch_gpt_ref.py --run gpt:4-128-4-128@32 --attn manual,sdpa --steps 30
"""
import argparse
import json
import math
import statistics
import sys
import time

VOCAB = 256
DEFAULT = (4, 128, 4, 128)  # models/gpt.h: TDM_GPT_DEFAULT_{LAYERS,WIDTH,HEADS,CONTEXT}


def parse_model(text):
    """'gpt' or 'gpt:L-D-H-T' -> (L, D, H, T), as tdm_gpt_spec_parse."""
    if text == "gpt":
        return DEFAULT
    if not text.startswith("gpt:"):
        raise ValueError(f"model '{text}': expected gpt or gpt:L-D-H-T")
    parts = text[4:].split("-")
    if len(parts) != 4 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"model '{text}': expected four positive integers L-D-H-T")
    L, D, H, T = (int(p) for p in parts)
    if D % H:
        raise ValueError(f"model '{text}': {H} heads do not divide the width {D}")
    return L, D, H, T


def param_count(L, D, H, T):
    """Parameters of the model, without torch: wte (V, D), wpe (T, D); per
    block ln_1 2D, c_attn 3D*D + 3D, attn.c_proj D*D + D, ln_2 2D,
    c_fc 4D*D + 4D, mlp.c_proj 4D*D + D (12D^2 + 13D); ln_f 2D; the head
    is wte (tied)."""
    return VOCAB * D + T * D + L * (12 * D * D + 13 * D) + 2 * D


def build(torch, L, D, H, T, attn):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(D, eps=1e-5)
            self.c_attn = nn.Linear(D, 3 * D)
            self.attn_proj = nn.Linear(D, D)
            self.ln_2 = nn.LayerNorm(D, eps=1e-5)
            self.c_fc = nn.Linear(D, 4 * D)
            self.mlp_proj = nn.Linear(4 * D, D)
            self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)),
                                 persistent=False)

        def attention(self, x):
            B, Tr, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q = q.view(B, Tr, H, C // H).transpose(1, 2)
            k = k.view(B, Tr, H, C // H).transpose(1, 2)
            v = v.view(B, Tr, H, C // H).transpose(1, 2)
            if attn == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
                att = att.masked_fill(~self.mask[:Tr, :Tr], float("-inf"))
                y = F.softmax(att, dim=-1) @ v
            return self.attn_proj(y.transpose(1, 2).contiguous().view(B, Tr, C))

        def forward(self, x):
            x = x + self.attention(self.ln_1(x))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, D)
            self.wpe = nn.Embedding(T, D)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(D, eps=1e-5)
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif ".ln_" in name or name.startswith("ln_"):
                    nn.init.ones_(p)
                elif name.endswith("proj.weight"):
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * L))
                else:
                    nn.init.normal_(p, 0.0, 0.02)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.h:
                x = b(x)
            return F.linear(self.ln_f(x), self.wte.weight)   # tied head, no bias

    return GPT()


def run_one(torch, model, batch, attn, steps, tf32, warmup=5):
    L, D, H, T = parse_model(model)
    F = torch.nn.functional
    dev = torch.device("cuda")
    torch.manual_seed(1)
    m = build(torch, L, D, H, T, attn).to(dev)
    n_params = sum(p.numel() for p in m.parameters())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    gen = torch.Generator().manual_seed(7)
    times = []
    for s in range(warmup + steps):
        x = torch.randint(0, VOCAB, (batch, T), generator=gen, dtype=torch.int64)
        y = torch.randint(0, VOCAB, (batch, T), generator=gen, dtype=torch.int64)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x, y = x.to(dev), y.to(dev)
        logits = m(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    if not math.isfinite(loss_value):
        raise RuntimeError(f"{model}: loss {loss_value} after {warmup + steps} steps")
    med = statistics.median(times)
    return {
        "model": f"gpt:{L}-{D}-{H}-{T}", "batch": batch, "attn": attn, "tf32": bool(tf32),
        "params": n_params, "params_formula": param_count(L, D, H, T),
        "steps": steps, "step_ms_median": round(med * 1e3, 4),
        "step_ms_min": round(min(times) * 1e3, 4),
        "tokens_per_s": round(batch * T / med, 1), "last_loss": round(loss_value, 4),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count-only", action="store_true",
                    help="print the parameter count of each --model (no torch needed)")
    ap.add_argument("--model", action="append", default=[], help="gpt or gpt:L-D-H-T")
    ap.add_argument("--run", action="append", default=[],
                    help="MODEL@BATCH to train, e.g. gpt:4-128-4-128@32 (repeatable)")
    ap.add_argument("--attn", default="manual",
                    help="comma-separated: manual (tandem's computation), sdpa")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tf32", action="store_true", help="TF32 matmuls (TANDEM_CUDA_TF32=1)")
    a = ap.parse_args(argv)
    if a.count_only:
        for text in a.model or ["gpt"]:
            L, D, H, T = parse_model(text)
            print(f"gpt:{L}-{D}-{H}-{T} {param_count(L, D, H, T)}")
        return 0
    runs = a.run or ["gpt@32"]
    attns = [x for x in a.attn.split(",") if x]
    for x in attns:
        if x not in ("manual", "sdpa"):
            ap.error(f"--attn {x}: expected manual or sdpa")
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    import torch   # only now: --count-only runs where torch is absent
    if not torch.cuda.is_available():
        print("torch_gpt_ref: torch.cuda.is_available() is False: no GPU for PyTorch",
              file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = bool(a.tf32)
    torch.backends.cudnn.allow_tf32 = bool(a.tf32)
    for r in runs:
        model, _, batch = r.partition("@")
        for attn in attns:
            out = run_one(torch, model, int(batch or 32), attn, a.steps, a.tf32)
            if out["params"] != out["params_formula"]:
                raise RuntimeError(f"{model}: {out['params']} parameters in the module, "
                                   f"{out['params_formula']} by the formula")
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
