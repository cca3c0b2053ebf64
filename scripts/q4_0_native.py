"""A model's Q4_0 tensors computed natively (Q4_1's nibble tiles without offsets, 18 bytes a block of
32) against the equal Q4_1 blocks the loader made of them before (20 bytes: an offset m = -8 d
beside each scale), one process, forwards of k rows after 512 tokens timed in turn, as
scripts/q5_0_native.py does. The logits are not expected to be bit-identical: the two sum the same
weights in a different float order (the native dot is the Q8_0 blocks' bit for bit,
tests/test_kquants.py).

    llama-quantize --allow-requantize smollm2.Q8_0.gguf smollm2.Q4_0.gguf Q4_0
    python scripts/q4_0_native.py smollm2.Q4_0.gguf --calls 60 --json out.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug.runtime import load_target, native

sys.path.insert(0, str(Path(__file__).parent))
from q5_0_native import compare, parse_args  # noqa: E402


def load(path: str, threads: int, as_q4_1: bool):
    """The model, its Q4_0 tensors natively or (as_q4_1) as the Q4_1 blocks the loader made before."""
    if not as_q4_1:
        return load_target(path, threads=threads).model
    from_blocks = native.QuantLinear.from_blocks.__func__

    def former(cls, raw, qtype, shape, **kw):
        if qtype != "Q4_0":
            return from_blocks(cls, raw, qtype, shape, **kw)
        n, nb = shape[0], shape[1] // 32
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, nb, native.Q4_0_BLOCK)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
        return cls._q4_1(blocks[:, :, 2:], d, (d.astype(np.float32) * -8).astype(np.float16), n, **kw)

    native.QuantLinear.from_blocks = classmethod(former)
    try:
        return load_target(path, threads=threads).model
    finally:
        native.QuantLinear.from_blocks = classmethod(from_blocks)


def main() -> None:
    a = parse_args(__doc__)
    models = {"q4_0": load(a.model, a.threads, False), "as_q4_1": load(a.model, a.threads, True)}
    compare(models, a.ks, a.calls, "python scripts/q4_0_native.py " + " ".join(sys.argv[1:]), a.json, a.model)


if __name__ == "__main__":
    main()
