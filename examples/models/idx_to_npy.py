#!/usr/bin/env python3
"""Writes an IDX image/label file pair (MNIST, Fashion-MNIST; gzip or plain)
as two NumPy .npy files, without NumPy: images as uint8 (n, 1, rows, cols),
labels as int64 (n,). For trying `tandem train --data X.npy,Y.npy`:

    python3 examples/models/idx_to_npy.py \
        /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz \
        /usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz /tmp/fm-train
    -> /tmp/fm-train-x.npy, /tmp/fm-train-y.npy
"""
import gzip
import struct
import sys


def read_idx(path):
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    magic, = struct.unpack(">I", raw[:4])
    ndim = magic & 0xFF
    if magic >> 8 != 0x08:
        sys.exit(f"{path}: not an IDX file of unsigned bytes (magic {magic:#010x})")
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return dims, raw[4 + 4 * ndim:]


def write_npy(path, descr, shape, payload):
    shape_txt = "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    header = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape_txt)
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + " " * (pad % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        f.write(payload)


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: idx_to_npy.py IMAGES LABELS OUT_PREFIX")
    (n, rows, cols), pixels = read_idx(sys.argv[1])
    (m,), labels = read_idx(sys.argv[2])
    if n != m:
        sys.exit(f"{n} images but {m} labels")
    write_npy(sys.argv[3] + "-x.npy", "|u1", (n, 1, rows, cols), pixels[:n * rows * cols])
    write_npy(sys.argv[3] + "-y.npy", "<i8", (n,),
              b"".join(struct.pack("<q", b) for b in labels[:n]))


if __name__ == "__main__":
    main()
