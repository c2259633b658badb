#!/bin/sh
# tools/torch_check.sh BUILD: the PyTorch loader check of the four example
# model files (`make torch-check`). Each example trains briefly with
# BUILD/tandem (a few steps: the check is about loading and evaluating,
# not accuracy; the ResNet in ddp on cpu:2, so a DDP checkpoint is read),
# then tools/torch_check.py builds the same net with torch.nn, loads the
# checkpoint and compares its figures with `tandem eval`'s on the same
# data (Fashion-MNIST's test set; the GPT's validation text). Last, a
# negative control: one weight changed in torch's copy must be reported
# as a mismatch. Exit 0 when every check agrees, 1 otherwise, 77 when no
# python3 imports torch (install Debian's python3-torch; make torch-check
# does).
set -u
build=${1:-build}
tandem=$build/tandem
here=$(cd "$(dirname "$0")/.." && pwd)
py=""
for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import torch' >/dev/null 2>&1; then
        py=$p
        break
    fi
done
if [ -z "$py" ]; then
    echo "torch_check: no python3 here imports torch (apt-get install python3-torch)" >&2
    exit 77
fi
[ -x "$tandem" ] || { echo "torch_check: $tandem is not built (make)" >&2; exit 1; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/tandem-torch-check.XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT INT TERM
fail=0

# name, then tandem train's arguments
check() {
    name=$1
    shift
    ck=$dir/$name.safetensors
    echo "== $name: tandem train $* --save $ck"
    if ! "$tandem" train --model "file:$here/examples/models/$name.tdm" --epochs 1 --no-eval \
        --quiet --save "$ck" "$@" >"$dir/$name.log" 2>&1; then
        echo "torch_check: $name: tandem train failed:" >&2
        tail -3 "$dir/$name.log" >&2
        fail=1
        return
    fi
    "$py" "$here/tools/torch_check.py" --model "$here/examples/models/$name.tdm" \
        --checkpoint "$ck" --tandem "$tandem" || fail=1
}

check lenet5 --max-steps 50 --batch 128
check resnet_small --max-steps 20 --batch 64 --mode ddp --device cpu:2
check mlp_dropout --max-steps 50 --batch 128
check gpt --max-steps 5 --batch 8

echo "== negative control: lenet5 with conv1.weight + 0.01 in torch's copy only"
if [ -f "$dir/lenet5.safetensors" ]; then
    if "$py" "$here/tools/torch_check.py" --model "$here/examples/models/lenet5.tdm" \
        --checkpoint "$dir/lenet5.safetensors" --tandem "$tandem" --tamper conv1.weight \
        >"$dir/control.log" 2>&1; then
        echo "torch_check: the negative control agreed: the check cannot fail" >&2
        cat "$dir/control.log" >&2
        fail=1
    else
        grep MISMATCH "$dir/control.log" || { cat "$dir/control.log" >&2; fail=1; }
    fi
fi
if [ $fail -ne 0 ]; then
    echo "torch-check: FAILED" >&2
    exit 1
fi
echo "torch-check: all four examples agree with PyTorch"
