#!/usr/bin/env python3
"""tools/torch_check.py: the PyTorch loader check of a tandem model file.

Parses a model file (docs/MODELS.md; the grammar of models/model_file.c,
the layers the examples use), builds the same net with torch.nn, loads a
tandem checkpoint into it (safetensors, read here with NumPy: an 8-byte
little-endian header length, a JSON header, the raw data) and evaluates it
on the data tandem evaluates on, then prints its figures beside
`tandem eval`'s for the same checkpoint:

  images (Fashion-MNIST IDX test set, or --data X.npy,Y.npy): the mean
  cross-entropy loss and the accuracy over the test set;
  a GPT (`input tokens T`): the mean loss in nats over the validation
  windows tandem evaluates (core/text.h: Debian's fortunes split by
  fortune, every 10th validates, or the last 10% of a plain file; at most
  512 windows of T bytes spread evenly).

  /usr/bin/python3 tools/torch_check.py --model examples/models/lenet5.tdm \\
      --checkpoint lenet.safetensors [--tandem build/tandem] [--data DIR|FILE]

Mapping: checkpoint names are the file's (conv1.weight, bn1.running_mean,
fc1.weight, res2.proj.weight, transformer.h.0.attn.c_attn.weight, ...) and
the torch modules are named the same, so each tensor loads as it is:
convolutions (N, C, K, K) as nn.Conv2d's weight (no bias), linear layers
(out, in) as nn.Linear's (no transpose), batchnorm's weight, bias and
running mean and variance into nn.BatchNorm2d (eps 1e-5) evaluated with
its running statistics (num_batches_tracked, which tandem does not keep,
plays no part in evaluation), the GPT's c_attn/c_proj/c_fc as nn.Linear
(out, in) and its tied head as a product with transformer.wte.weight.
Every model tensor of the checkpoint must be used and every torch
parameter and buffer filled, with its shape; optimizer state (optim.*) is
ignored.

The bound (a mismatch exits 1): tandem and torch compute the same float32
math in different orders (OpenBLAS/tandem's kernels against oneDNN/ATen's
convolutions and reductions), so their logits differ by rounding: a few
float32 ulps of the largest intermediate, about 1e-6 relative per layer,
growing with depth. Both must hold:
  - logits: on the rows `tandem eval --dump-logits` writes (64 test
    samples, or the first validation window), max |tandem - torch| <=
    LOGIT_TOL * (1 + max |logit|);
  - loss: |tandem - torch| <= LOSS_TOL * (1 + |loss|);
  - accuracy (images): at most ACC_FLIPS test samples whose predicted
    class differs (a rounding difference flips the argmax only where the
    two best logits tie to ~1e-5), so |accuracy difference| <= ACC_FLIPS/n.
Layout, naming or semantic mistakes (a transposed weight, batchnorm in
training mode, a wrong stride, a missing skip path) move the loss by
orders of magnitude more than these bounds.

Exit codes: 0 the figures agree, 1 they differ beyond the bound or a run
failed, 2 bad usage or a model file with a layer this check does not
build (one line naming the file, the line and the layer).
"""
import argparse
import gzip
import json
import math
import os
import re
import struct
import subprocess
import sys

LOGIT_TOL = 1e-4
LOSS_TOL = 1e-5
ACC_FLIPS = 3
DUMP_SAMPLES = 64
EVAL_CAP = 512          # tools/train_modes.h: TDM_TRAIN_TEXT_EVAL_CAP
FMNIST_MEAN = 0.2860    # core/data.h: TDM_DATA_FMNIST_MEAN, _STD (as float32)
FMNIST_STD = 0.3530
FMNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FORTUNES_DEFAULT_DIR = "/usr/share/games/fortunes"
BN_EPS = 1e-5
LN_EPS = 1e-5
VOCAB = 256
MAX_DIM = 1 << 20


class Usage(Exception):
    """A bad argument or a model file this check does not build: exit 2."""


class Failure(Exception):
    """A run that failed or a file that cannot be read: exit 1."""


# ---------------------------------------------------------------- the model file

class Line:
    def __init__(self, path, no, text, tok):
        self.path, self.no, self.text, self.tok = path, no, text, tok

    def err(self, msg):
        return Usage(f"{os.path.basename(self.path)}:{self.no}: `{self.text}`: {msg}")


def read_lines(path):
    """The file's layer lines: tokens split at spaces, comments cut, `{`
    and `}` words of their own (as models/model_file.c splits them)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise Usage(f"{path}: {e.strerror}")
    out = []
    for no, bline in enumerate(raw.split(b"\n"), 1):
        text = bline.decode("latin-1").rstrip("\r")
        body = text.split("#", 1)[0]
        body = body.replace("{", " { ").replace("}", " } ")
        tok = body.split()
        if tok:
            out.append(Line(path, no, text.strip(), tok))
    return out


def pos_int(line, s, what, top=MAX_DIM):
    if not s.isdigit():
        raise line.err(f"{what} '{s}' is not a positive integer")
    v = int(s)
    if v < 1 or v > top:
        raise line.err(f"{what} {s} is out of range (1..{top})")
    return v


def parse_image_ops(lines):
    """The ops of an image or feature model, with the names tandem gives
    their tensors and the shapes inferred line by line."""
    first = lines[0]
    dims = first.tok[1].split("x") if len(first.tok) == 2 else []
    if len(dims) not in (1, 3):
        raise first.err("expected `input CxHxW` or `input FEATURES`")
    d = [pos_int(first, x, "input size") for x in dims]
    shape = ("vec", d[0]) if len(d) == 1 else ("img", d[0], d[1], d[2])
    in_shape = shape
    counts = {"conv": 0, "bn": 0, "fc": 0, "ln": 0, "res": 0}
    stack, ops = [], []

    def name(kind):
        counts[kind] += 1
        return f"{kind}{counts[kind]}"

    for ln in lines[1:]:
        w, n = ln.tok[0], len(ln.tok)
        if w == "linear":
            if n != 2:
                raise ln.err("expected `linear OUT_FEATURES`")
            out = pos_int(ln, ln.tok[1], "output features")
            feats = shape[1] if shape[0] == "vec" else None
            if feats is None:
                raise ln.err(f"linear needs a vector, got an image {shape[1:]} (flatten first)")
            ops.append(("linear", name("fc"), feats, out))
            shape = ("vec", out)
        elif w == "conv":
            if n < 3 or n % 2 == 0 or shape[0] != "img":
                raise ln.err("expected `conv KxK CHANNELS [stride S] [pad P]` on an image")
            k = ln.tok[1].split("x")
            if len(k) == 2 and k[0] != k[1]:
                raise ln.err("only square KxK kernels")
            k = pos_int(ln, k[0], "kernel", 64)
            ch = pos_int(ln, ln.tok[2], "channels")
            stride, pad = 1, 0
            for i in range(3, n - 1, 2):
                if ln.tok[i] == "stride":
                    stride = pos_int(ln, ln.tok[i + 1], "stride", 64)
                elif ln.tok[i] == "pad":
                    pad = int(ln.tok[i + 1]) if ln.tok[i + 1].isdigit() else -1
                    if not 0 <= pad < k:
                        raise ln.err("pad must be 0..kernel-1")
                else:
                    raise ln.err(f"unknown conv option '{ln.tok[i]}'")
            c, h, wd = shape[1:]
            ops.append(("conv", name("conv"), c, ch, k, stride, pad))
            shape = ("img", ch, (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1)
        elif w == "batchnorm" and n == 1:
            if shape[0] != "img":
                raise ln.err("batchnorm normalises the channels of an image (tandem has no batchnorm of vectors)")
            ops.append(("bn", name("bn"), shape[1]))
        elif w == "layernorm" and n == 1:
            if shape[0] != "vec":
                raise ln.err("layernorm of an image is not a layer of tandem's (flatten first)")
            ops.append(("ln", name("ln"), shape[1]))
        elif w in ("relu", "gelu", "tanh", "sigmoid") and n == 1:
            ops.append(("act", w))
        elif w in ("maxpool", "avgpool") and n == 2:
            if shape[0] != "img":
                raise ln.err(f"{w} needs an image")
            c, h, wd = shape[1:]
            if w == "avgpool" and ln.tok[1] == "global":
                ops.append(("gap",))
                shape = ("img", c, 1, 1)
            else:
                k = pos_int(ln, ln.tok[1], "window")
                ops.append((w, k))
                shape = ("img", c, h // k, wd // k)
        elif w == "flatten" and n == 1:
            ops.append(("flatten",))
            if shape[0] == "img":
                shape = ("vec", shape[1] * shape[2] * shape[3])
        elif w == "dropout" and n == 2:
            ops.append(("dropout",))   # evaluation: the identity
        elif w == "residual" and ln.tok[1:] == ["{"]:
            counts["res"] += 1
            stack.append((f"res{counts['res']}", shape))
            ops.append(("open",))
        elif w == "}" and ln.tok[1:] in ([], ["proj"]):
            if not stack:
                raise ln.err("`}` without `residual {`")
            rname, bin_ = stack.pop()
            if len(ln.tok) == 1:
                if bin_ != shape:
                    raise ln.err(f"residual block changes the shape {bin_[1:]} -> {shape[1:]}")
                ops.append(("close", None))
            elif bin_[0] == "vec":
                ops.append(("close", ("linear", rname, bin_[1], shape[1])))
            else:
                st = next((s for s in range(1, bin_[2] + 1)
                           if (bin_[2] - 1) // s + 1 == shape[2] and (bin_[3] - 1) // s + 1 == shape[3]),
                          0)
                if not st:
                    raise ln.err("no 1x1 convolution stride maps the block's input onto its output")
                ops.append(("close", ("conv", rname, bin_[1], shape[1], st)))
        else:
            raise ln.err(f"'{w}' with these words is not a layer this check builds (linear, conv, "
                         "batchnorm, layernorm, relu, gelu, tanh, sigmoid, maxpool, avgpool, "
                         "flatten, dropout, residual {, }; a GPT starts with `input tokens T`)")
    if stack:
        raise lines[-1].err("a residual block is not closed")
    if shape[0] != "vec" and shape[1:] != (shape[1], 1, 1):
        raise lines[-1].err("the model does not end in a vector of class scores")
    return in_shape, ops


def parse_gpt(lines):
    """A model of tokens: the GPT's arrangement (docs/MODELS.md), checked
    line by line. Returns (L, C, H, T, tied)."""
    first = lines[0]
    if len(first.tok) != 3:
        raise first.err("expected `input tokens T`")
    T = pos_int(first, first.tok[2], "context", 65536)
    want = iter(lines[1:])

    def expect(what, ok):
        ln = next(want, None)
        if ln is None:
            raise lines[-1].err(f"the file ends where {what} belongs")
        if not ok(ln.tok):
            raise ln.err(f"expected {what} here (the GPT's arrangement, docs/MODELS.md)")
        return ln

    ln = expect("`embedding vocab 256 dim C`", lambda t: t[0] == "embedding" and len(t) == 5)
    opts = dict(zip(ln.tok[1::2], ln.tok[2::2]))
    if set(opts) != {"vocab", "dim"} or opts["vocab"] != str(VOCAB):
        raise ln.err("expected `embedding vocab 256 dim C`")
    C = pos_int(ln, opts["dim"], "width")
    expect("`embedding positions`", lambda t: t == ["embedding", "positions"])
    L, H, rest = 0, None, list(want)
    i = 0
    while i < len(rest) and rest[i].tok == ["residual", "{"]:
        blk = rest[i:i + 8]
        pat = [["residual", "{"], ["layernorm"], None, ["}"],
               ["residual", "{"], ["layernorm"], ["gptmlp"], ["}"]]
        for j, p in enumerate(pat):
            if j >= len(blk):
                raise rest[-1].err("a transformer block is cut short")
            t = blk[j].tok
            if p is None:
                if len(t) != 3 or t[:2] != ["attention", "heads"]:
                    raise blk[j].err("expected `attention heads H`")
                h = pos_int(blk[j], t[2], "heads")
                if H is not None and h != H:
                    raise blk[j].err(f"{h} heads, but block 0 has {H}")
                if C % h:
                    raise blk[j].err(f"{h} heads do not divide the width {C}")
                H = h
            elif t != p:
                raise blk[j].err(f"expected `{' '.join(p)}` here (the GPT's arrangement)")
        L += 1
        i += 8
    if L == 0:
        raise (rest[0] if rest else lines[-1]).err("expected a transformer block `residual {`")
    tail = rest[i:]
    if len(tail) != 2 or tail[0].tok != ["layernorm"] or tail[1].tok not in (["lmhead", "tied"],
                                                                              ["lmhead"]):
        bad = tail[0] if tail else lines[-1]
        raise bad.err("expected `layernorm` then `lmhead tied` (or `lmhead`) to end the GPT")
    return L, C, H, T, tail[1].tok == ["lmhead", "tied"]


def parse_model(path):
    lines = read_lines(path)
    if not lines:
        raise Usage(f"{path}: no layers")
    if lines[0].tok[0] != "input":
        raise lines[0].err("a model file starts with `input`")
    if len(lines[0].tok) >= 2 and lines[0].tok[1] == "tokens":
        return "gpt", parse_gpt(lines)
    return "seq", parse_image_ops(lines)


# ---------------------------------------------------------------- torch nets

def build_seq(torch, in_shape, ops):
    """An nn.Module running ops, its submodules named as tandem's tensors."""
    nn = torch.nn
    F = torch.nn.functional
    acts = {"relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
            "gelu": lambda x: F.gelu(x, approximate="tanh")}

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            for op in ops:
                if op[0] == "linear":
                    self.add_module(op[1], nn.Linear(op[2], op[3]))
                elif op[0] == "conv":
                    _, nm, cin, cout, k, stride, pad = op
                    self.add_module(nm, nn.Conv2d(cin, cout, k, stride, pad, bias=False))
                elif op[0] == "bn":
                    self.add_module(op[1], nn.BatchNorm2d(op[2], eps=BN_EPS))
                elif op[0] == "ln":
                    self.add_module(op[1], nn.LayerNorm(op[2], eps=LN_EPS))
                elif op[0] == "close" and op[1]:
                    kind, nm, cin, cout = op[1][:4]
                    holder = nn.Module()
                    holder.proj = (nn.Linear(cin, cout) if kind == "linear"
                                   else nn.Conv2d(cin, cout, 1, op[1][4], 0, bias=False))
                    self.add_module(nm, holder)

        def forward(self, x):
            if in_shape[0] == "img":
                x = x.view(x.shape[0], *in_shape[1:])
            else:
                x = x.reshape(x.shape[0], -1)
            skips = []
            for op in ops:
                k = op[0]
                if k in ("linear", "conv", "bn", "ln"):
                    x = getattr(self, op[1])(x)
                elif k == "act":
                    x = acts[op[1]](x)
                elif k == "maxpool":
                    x = F.max_pool2d(x, op[1])
                elif k == "avgpool":
                    x = F.avg_pool2d(x, op[1])
                elif k == "gap":
                    x = x.mean(dim=(2, 3), keepdim=True)
                elif k == "flatten":
                    x = x.reshape(x.shape[0], -1)
                elif k == "dropout":
                    pass
                elif k == "open":
                    skips.append(x)
                elif k == "close":
                    s = skips.pop()
                    x = x + (getattr(self, op[1][1]).proj(s) if op[1] else s)
            return x.reshape(x.shape[0], -1)

    return Seq()


def build_gpt(torch, L, C, H, T, tied):
    """The GPT of models/gpt.c with its checkpoint's names (transformer.*)."""
    nn = torch.nn
    F = torch.nn.functional

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)),
                                 persistent=False)

        def forward(self, x):
            B, Tr, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, Tr, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
            att = att.masked_fill(~self.mask[:Tr, :Tr], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, Tr, C))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(C, 4 * C)
            self.c_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=LN_EPS)
            self.attn = Attn()
            self.ln_2 = nn.LayerNorm(C, eps=LN_EPS)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.wte = nn.Embedding(VOCAB, C)
            self.transformer.wpe = nn.Embedding(T, C)
            self.transformer.h = nn.ModuleList([Block() for _ in range(L)])
            self.transformer.ln_f = nn.LayerNorm(C, eps=LN_EPS)
            if not tied:
                self.lm_head = nn.Linear(C, VOCAB, bias=False)

        def forward(self, idx):
            tr = self.transformer
            x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
            for b in tr.h:
                x = b(x)
            x = tr.ln_f(x)
            return F.linear(x, tr.wte.weight) if tied else self.lm_head(x)

    return GPT()


# ---------------------------------------------------------------- checkpoint

ST_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def read_safetensors(np, path):
    """{name: array} and the metadata of a safetensors file, by hand."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise Failure(f"{path}: {e.strerror}")
    if len(raw) < 8:
        raise Failure(f"{path}: {len(raw)} bytes is not a safetensors file")
    n, = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise Failure(f"{path}: header of {n} bytes in a file of {len(raw)}")
    try:
        head = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise Failure(f"{path}: header is not JSON ({e})")
    meta = head.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for name, t in head.items():
        dt = ST_DTYPES.get(t.get("dtype"))
        a, b = t.get("data_offsets", (0, -1))
        if dt is None or not 0 <= a <= b <= len(data):
            raise Failure(f"{path}: tensor {name}: dtype {t.get('dtype')} or offsets {a}..{b} "
                          "not readable")
        arr = np.frombuffer(data[a:b], dtype=dt)
        if arr.size != math.prod(t["shape"]):
            raise Failure(f"{path}: tensor {name}: {arr.size} values for shape {t['shape']}")
        out[name] = arr.reshape(t["shape"]).astype(np.float32)
    return out, meta


def load_checkpoint(torch, np, net, path):
    """Fills every parameter and buffer of net from the checkpoint's
    tensors of the same name; all of the checkpoint's model tensors must
    be used. Returns the number of tensors loaded."""
    tensors, _ = read_safetensors(np, path)
    model = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    state = net.state_dict()
    want = {k for k in state if not k.endswith("num_batches_tracked")}
    missing = sorted(want - set(model))
    extra = sorted(set(model) - want)
    if missing or extra:
        raise Failure(f"{path}: the checkpoint does not fit the model file: "
                      f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                      f"not in the model {extra[:4]}{'...' if len(extra) > 4 else ''}")
    for k in sorted(want):
        if tuple(state[k].shape) != model[k].shape:
            raise Failure(f"{path}: {k} has shape {list(model[k].shape)}, the model file's is "
                          f"{list(state[k].shape)}")
        state[k] = torch.from_numpy(model[k].copy())
    net.load_state_dict(state, strict=True)
    return len(want)


# ---------------------------------------------------------------- data

def read_idx(np, path):
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    magic, = struct.unpack(">I", raw[:4])
    nd = magic & 0xFF
    if magic >> 8 != 0x08:
        raise Failure(f"{path}: not an IDX file of unsigned bytes")
    dims = struct.unpack(">" + "I" * nd, raw[4:4 + 4 * nd])
    return np.frombuffer(raw[4 + 4 * nd:4 + 4 * nd + math.prod(dims)], dtype=np.uint8).reshape(dims)


def fmnist_scale(np, pixels):
    """core/data.c's float32 lookup: (p / 255 - mean) / std, in float32."""
    lut = ((np.arange(256, dtype=np.float32) / np.float32(255.0) - np.float32(FMNIST_MEAN))
           / np.float32(FMNIST_STD)).astype(np.float32)
    return lut[pixels]


def load_images(np, data):
    """The test set tandem eval uses: (x float32 (n, ...), y int64 (n,))."""
    if data and "," in data:
        xp, yp = data.split(",", 1)
        x, y = np.load(xp), np.load(yp)
        if x.dtype == np.uint8:
            x = fmnist_scale(np, x)
        return x.astype(np.float32), y.astype(np.int64)
    d = data or os.environ.get("TANDEM_DATA_DIR") or FMNIST_DEFAULT_DIR
    found = {}
    for what in ("images-idx3", "labels-idx1"):
        for suf in ("", ".gz"):
            p = os.path.join(d, f"t10k-{what}-ubyte{suf}")
            if os.path.exists(p):
                found[what] = p
                break
        else:
            raise Failure(f"{d}: no t10k-{what}-ubyte[.gz] (the Fashion-MNIST test set)")
    x = read_idx(np, found["images-idx3"])
    y = read_idx(np, found["labels-idx1"]).astype(np.int64)
    return fmnist_scale(np, x), y


def clean_fortune(b):
    """core/text.c's tdm_text_clean: backspace deletes the byte before it
    (not a newline), control bytes but \\n and \\t go, leading newlines and
    trailing blanks are trimmed."""
    o = bytearray()
    for c in b:
        if c == 8:
            if o and o[-1] != 10:
                o.pop()
            continue
        if (c < 0x20 and c not in (10, 9)) or c == 0x7F:
            continue
        o.append(c)
    s = bytes(o).lstrip(b"\n")
    return s.rstrip(b" \t\n")


def load_text_val(data):
    """The validation split tandem evaluates (core/text.h)."""
    path = data or os.environ.get("TANDEM_FORTUNES_DIR") or FORTUNES_DEFAULT_DIR
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            raw = f.read()
        return raw[len(raw) * 9 // 10:]
    names = sorted((n for n in os.listdir(path.encode()) if not n.startswith(b".")
                    and not n.endswith(b".dat")))
    val, k = bytearray(), 0
    for n in names:
        p = os.path.join(path.encode(), n)
        if os.path.islink(p) or not os.path.isfile(p):
            continue
        with open(p, "rb") as f:
            raw = f.read()
        start, i = 0, 0
        while i <= len(raw):
            e = raw.find(b"\n", i)
            e = len(raw) if e < 0 else e
            line = raw[i:e]
            if line.endswith(b"\r"):
                line = line[:-1]
            sep = line == b"%"
            if sep or e >= len(raw):
                m = clean_fortune(raw[start:i if sep else len(raw)])
                if m:
                    if k % 10 == 9:
                        val += m + b"\n\n"
                    k += 1
                start = e + 1
            i = e + 1
    return bytes(val)


def text_windows(np, val, T, cap=EVAL_CAP):
    """core/text.c's evaluation windows: inputs and targets (count, T)."""
    K = (len(val) - 1) // T
    count = min(K, cap) if cap > 0 else K
    buf = np.frombuffer(val, dtype=np.uint8)
    idx = [int(i * K / count) if count < K else i for i in range(count)]
    x = np.stack([buf[w * T:w * T + T] for w in idx]).astype(np.int64)
    y = np.stack([buf[w * T + 1:w * T + T + 1] for w in idx]).astype(np.int64)
    return x, y


# ---------------------------------------------------------------- tandem eval

def tandem_eval(args, dump):
    cmd = [args.tandem, "eval", "--resume", args.checkpoint, "--model", "file:" + args.model,
           "--dump-logits", dump, "--dump-samples", str(args.dump_samples)]
    if args.data:
        cmd += ["--data", args.data]
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise Failure(f"{args.tandem}: {e.strerror} (build it: make)")
    if r.returncode != 0:
        last = r.stdout.strip().splitlines()[-1:] or ["(no output)"]
        raise Failure(f"{' '.join(cmd)} failed (exit {r.returncode}): {last[0]}")
    img = re.search(r"test set \((\d+) samples\): loss (\S+), accuracy (\S+)", r.stdout)
    txt = re.search(r"validation text \((\d+) windows of (\d+) bytes\): loss (\S+) nats", r.stdout)
    rows = []
    with open(dump) as f:
        for line in f:
            if not line.startswith("#"):
                v = line.split()
                rows.append((int(v[0]), [float(t) for t in v[1:]]))
    if img:
        return {"n": int(img[1]), "loss": float(img[2]), "acc": float(img[3]), "rows": rows}
    if txt:
        return {"n": int(txt[1]), "loss": float(txt[3]), "rows": rows}
    raise Failure(f"{' '.join(cmd)}: no figures in its output:\n{r.stdout}")


# ---------------------------------------------------------------- the check

def torch_images(torch, np, net, data, dump_n):
    x, y = load_images(np, data)
    n = x.shape[0]
    loss_sum, correct, first = 0.0, 0, None
    F = torch.nn.functional
    with torch.no_grad():
        for a in range(0, n, 1000):
            xb = torch.from_numpy(np.ascontiguousarray(x[a:a + 1000]))
            yb = torch.from_numpy(y[a:a + 1000])
            out = net(xb)
            loss_sum += float(F.cross_entropy(out.double(), yb, reduction="sum"))
            correct += int((out.argmax(dim=1) == yb).sum())
            if first is None:
                first = out[:dump_n].numpy()
    return {"n": n, "loss": loss_sum / n, "acc": correct / n, "logits": first,
            "targets": y[:dump_n]}


def torch_text(torch, np, net, data, T):
    x, y = text_windows(np, load_text_val(data), T)
    F = torch.nn.functional
    loss_sum, first = 0.0, None
    with torch.no_grad():
        for a in range(0, x.shape[0], 16):
            out = net(torch.from_numpy(x[a:a + 16]))
            loss_sum += float(F.cross_entropy(out.reshape(-1, VOCAB).double(),
                                              torch.from_numpy(y[a:a + 16]).reshape(-1)))\
                * out.shape[0]
            if first is None:
                first = out[0].numpy()
    return {"n": x.shape[0], "loss": loss_sum / x.shape[0], "logits": first, "targets": y[0]}


def compare(tandem, mine, is_text):
    """Lines to print and the list of bounds broken."""
    bad, lines = [], []
    t_rows = tandem["rows"]
    m_logits, m_targets = mine["logits"], mine["targets"]
    k = min(len(t_rows), len(m_logits))
    maxabs = maxdiff = 0.0
    flips = 0
    for r in range(k):
        tgt, tl = t_rows[r]
        ml = [float(v) for v in m_logits[r]]
        if tgt != int(m_targets[r]):
            bad.append(f"row {r}: tandem's target {tgt}, the data's here {int(m_targets[r])} "
                       "(not the same test data)")
            break
        maxabs = max(maxabs, max(abs(v) for v in tl))
        maxdiff = max(maxdiff, max(abs(a - b) for a, b in zip(tl, ml)))
        flips += max(range(len(tl)), key=tl.__getitem__) != max(range(len(ml)), key=ml.__getitem__)
    bound = LOGIT_TOL * (1 + maxabs)
    lines.append(f"  logits ({k} rows): max |tandem - torch| {maxdiff:.3g} (bound {bound:.3g})"
                 + ("" if is_text else f", {flips} argmax differ"))
    if maxdiff > bound:
        bad.append(f"logits differ by {maxdiff:.3g} > {bound:.3g}")
    if tandem["n"] != mine["n"]:
        bad.append(f"tandem evaluated {tandem['n']} {'windows' if is_text else 'samples'}, "
                   f"torch {mine['n']}")
    lb = LOSS_TOL * (1 + abs(tandem["loss"]))
    what = "loss (nats, validation windows)" if is_text else "test loss"
    lines.append(f"  {what}: tandem {tandem['loss']:.9g}  torch {mine['loss']:.9g}  "
                 f"|diff| {abs(tandem['loss'] - mine['loss']):.3g} (bound {lb:.3g})")
    if abs(tandem["loss"] - mine["loss"]) > lb:
        bad.append(f"loss differs by {abs(tandem['loss'] - mine['loss']):.3g} > {lb:.3g}")
    if not is_text:
        d = abs(tandem["acc"] - mine["acc"]) * mine["n"]
        lines.append(f"  test accuracy: tandem {tandem['acc']:.9g}  torch {mine['acc']:.9g}  "
                     f"({round(d)} of {mine['n']} samples differ in count; bound {ACC_FLIPS})")
        if round(d) > ACC_FLIPS:
            bad.append(f"accuracy differs by {round(d)} samples > {ACC_FLIPS}")
    return lines, bad


def main(argv):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description="Check a tandem checkpoint against the same net "
                                 "built with torch.nn from its model file (tools/torch_check.py)")
    ap.add_argument("--model", required=True, help="the model file (examples/models/*.tdm)")
    ap.add_argument("--checkpoint", required=True, help="tandem's checkpoint (train --save)")
    ap.add_argument("--data", help="as tandem eval's --data: a Fashion-MNIST directory or "
                    "X.npy,Y.npy (images), a file or fortunes directory (a GPT) [tandem's default]")
    ap.add_argument("--tandem", default=os.path.join(root, "build", "tandem"),
                    help="the tandem binary [build/tandem]")
    ap.add_argument("--dump-samples", type=int, default=DUMP_SAMPLES,
                    help=f"test samples whose logits are compared [{DUMP_SAMPLES}]")
    ap.add_argument("--tamper", metavar="TENSOR",
                    help="add 0.01 to TENSOR in torch's copy only: a negative control, "
                    "the check must then report a mismatch")
    ap.add_argument("--parse-only", action="store_true",
                    help="parse the model file and stop (needs no torch)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    try:
        kind, spec = parse_model(args.model)
        if args.parse_only:
            print(f"{args.model}: {kind} model, parsed")
            return 0
        try:
            import numpy as np
            import torch
        except ImportError as e:
            raise Failure(f"{e} (install Debian's python3-torch: make torch-check does; run "
                          "with /usr/bin/python3)")
        torch.manual_seed(0)
        net = build_gpt(torch, *spec) if kind == "gpt" else build_seq(torch, *spec)
        net.eval()
        n_loaded = load_checkpoint(torch, np, net, args.checkpoint)
        if args.tamper:
            state = net.state_dict()
            if args.tamper not in state:
                raise Usage(f"--tamper {args.tamper}: no such tensor (the model's: "
                            f"{', '.join(list(state)[:6])}, ...)")
            with torch.no_grad():
                state[args.tamper].add_(0.01)
        import tempfile
        with tempfile.TemporaryDirectory(prefix="tandem-torch-check-") as tmp:
            tandem = tandem_eval(args, os.path.join(tmp, "logits.txt"))
        if kind == "gpt":
            mine = torch_text(torch, np, net, args.data, spec[3])
        else:
            mine = torch_images(torch, np, net, args.data, args.dump_samples)
        lines, bad = compare(tandem, mine, kind == "gpt")
    except Usage as e:
        print(f"torch_check: {e}", file=sys.stderr)
        return 2
    except Failure as e:
        print(f"torch_check: {e}", file=sys.stderr)
        return 1
    print(f"torch_check: {os.path.basename(args.model)} with {args.checkpoint} "
          f"({n_loaded} tensors loaded into torch.nn, torch {torch.__version__})")
    for line in lines:
        print(line)
    if bad:
        print(f"torch_check: MISMATCH: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print("torch_check: AGREE (within the bounds above)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
