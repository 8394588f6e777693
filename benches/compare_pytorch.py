#!/usr/bin/env python3
"""PyTorch at the shapes of `examples/bench.rs`, with the same flags and the same JSON.

    python3 benches/compare_pytorch.py --batch 1 --seq 128 --hidden 768 --heads 12 \
        [--kv-heads N] [--causal] [--weights] [--dtype f32] [--iters N] [--core] \
        [--impl mha|matmul] [--threads 2] [--train] [--json]

Without --core: torch.nn.MultiheadAttention (batch_first, biases, eval, inference mode),
self-attention forward with need_weights=--weights (average_attn_weights=False, so the
weights are per head, (batch, heads, seq, seq), like candle-attention's). Without weights
and without a mask PyTorch takes its fused fast path (scaled_dot_product_attention inside).

With --core: the attention alone on random (batch, heads, seq, hidden/heads) q, k, v:
F.scaled_dot_product_attention (is_causal=--causal, enable_gqa when --kv-heads differs);
with --weights, the explicit softmax(q k^T * scale + mask) and weights @ v (SDPA returns no
weights).

--impl matmul: a seq x seq by seq x seq f32 torch.mm (the machine's reference throughput).

--train: one training step instead of a forward (as examples/bench.rs --train): the module in
train mode (dropout 0) or q, k, v with --core, x and every parameter requiring grad, the
forward without weights, then backward of sum(context * g) (no optimizer update); gflops
count a step as 3 forwards.

Prints one JSON object {"batch", "seq", "hidden", "heads", "median_ms", "gflops",
"peak_rss_mb", ...} with --json (peak_rss_mb is the process's ru_maxrss, which includes
PyTorch itself, ~300 MiB), a readable line otherwise. FLOPs: projections 6Td^2, attention
4T^2d (visible pairs only when causal), W_O 2Td^2, as candle_attention::AttentionCost.
"""

import argparse
import json
import math
import resource
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--weights", action="store_true")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--core", action="store_true")
    p.add_argument("--impl", dest="impl", default="mha", choices=["mha", "matmul"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (timed to completion)")
    p.add_argument("--train", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.train and (a.weights or a.impl == "matmul"):
        p.error("--train times the gradients of the context: no --weights, --impl mha")
    return a


def causal_pairs(seq):
    return seq * (seq + 1) // 2


def flops(a, kvh):
    t, d, h = a.seq, a.hidden, a.heads
    if a.impl == "matmul":
        return 2.0 * t ** 3
    hd = d // h
    pairs = causal_pairs(t) if a.causal else t * t
    attention = 2 * a.batch * h * pairs * (2 * hd)
    projections = 2 * a.batch * t * d * (h * hd + 2 * kvh * hd)
    output = 2 * a.batch * t * d * d
    forward = float(attention if a.core else projections + attention + output)
    return 3.0 * forward if a.train else forward


def main():
    a = parse_args()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    kvh = a.kv_heads or a.heads
    b, t, d, h = a.batch, a.seq, a.hidden, a.heads
    hd = d // h

    if a.impl == "matmul":
        x = torch.randn(t, t, device=dev)
        y = torch.randn(t, t, device=dev)

        def run():
            torch.mm(x, y)

    elif a.core:
        q = torch.randn(b, h, t, hd, dtype=dtype, device=dev, requires_grad=a.train)
        k = torch.randn(b, kvh, t, hd, dtype=dtype, device=dev, requires_grad=a.train)
        v = torch.randn(b, kvh, t, hd, dtype=dtype, device=dev, requires_grad=a.train)
        gqa = kvh != h
        scale = 1.0 / math.sqrt(hd)
        mask = None
        if a.causal and a.weights:
            mask = torch.full((t, t), float("-inf"), dtype=dtype, device=dev).triu(1)

        def run():
            if a.weights:
                kk, vv = (k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)) if gqa else (k, v)
                s = (q @ kk.transpose(-1, -2)) * scale
                if mask is not None:
                    s = s + mask
                w = torch.softmax(s, dim=-1)
                return w @ vv, w
            return F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, enable_gqa=gqa)

    else:
        if kvh != h:
            sys.exit("nn.MultiheadAttention has no grouped key/value heads; use --core for GQA")
        mha = torch.nn.MultiheadAttention(d, h, batch_first=True, dtype=dtype, device=dev)
        mha = mha.train() if a.train else mha.eval()
        x = torch.randn(b, t, d, dtype=dtype, device=dev, requires_grad=a.train)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=dev, dtype=dtype) if a.causal else None

        def run():
            return mha(
                x, x, x,
                need_weights=a.weights,
                average_attn_weights=False,
                attn_mask=mask,
                is_causal=a.causal,
            )

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    inner = run

    if a.train:
        out_shape = (b, h, t, hd) if a.core else (b, t, d)
        g = torch.randn(*out_shape, dtype=dtype, device=dev)
        params = [p for p in (mha.parameters() if not a.core else [])]

        def run():
            out = inner()
            context = out[0] if isinstance(out, tuple) else out
            (context * g).sum().backward()
            # Gradients accumulate in .grad; reset them as an optimizer's zero_grad does.
            for p in params + ([q, k, v] if a.core else [x]):
                p.grad = None
            sync()
    else:
        def run():
            inner()
            sync()

    import contextlib
    with (contextlib.nullcontext() if a.train else torch.inference_mode()):
        t0 = time.perf_counter()
        run()  # warm-up
        first = time.perf_counter() - t0
        if a.iters is not None:
            iters = max(1, a.iters)
        elif first > 2.0:
            iters = 1
        else:
            iters = min(100, max(3, int(2.0 / max(first, 1e-6))))
        times = []
        for _ in range(iters):
            t1 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t1) * 1e3)
    median_ms = statistics.median(times)
    gflops = flops(a, kvh) / (median_ms * 1e-3) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    what = "torch.mm" if a.impl == "matmul" else (
        ("explicit softmax" if a.weights else "F.scaled_dot_product_attention") if a.core
        else "nn.MultiheadAttention")
    out = {
        "batch": b, "seq": t, "hidden": d, "heads": h,
        "median_ms": round(median_ms, 3), "gflops": round(gflops, 3), "peak_rss_mb": round(rss, 3),
        "kv_heads": kvh, "causal": a.causal, "weights": a.weights, "core": a.core,
        "dtype": a.dtype, "impl": "pytorch " + what, "threads": a.threads, "iters": iters,
        "train": a.train,
        "torch": torch.__version__, "device": a.device,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{what} (torch {torch.__version__}, {a.threads} threads): batch {b}, seq {t}, hidden {d}, "
              f"heads {h} (kv {kvh}){', causal' if a.causal else ''}, "
              f"{'with' if a.weights else 'no'} weights: {median_ms:.3f} ms, {gflops:.1f} GFLOP/s, "
              f"peak RSS {rss:.0f} MiB ({iters} iters)")


if __name__ == "__main__":
    main()
