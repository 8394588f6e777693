//! Criterion benchmarks at the shapes of `examples/bench.rs` / `benches/side_by_side.sh`,
//! each next to the naive candle composition (matmul, softmax_last_dim, matmul) in the same
//! run. `cargo bench --bench attention [-- FILTER]`; threads: `RAYON_NUM_THREADS`, calls
//! handed over to rayon's default pool (as `examples/bench.rs --pool detached` times them).
//!
//! - `mha/<seq>x<hidden>/<path>`: a whole self-attention forward (projections, attention,
//!   W_O), batch 1, 12 heads, with and without the weights;
//! - `sdpa/<seq>/<path>`: attention alone, 8 heads of 64, causal and not.

use candle_attention::{
    scaled_dot_product_attention, AttentionConfig, AttentionMask, LinearWeights,
    MultiHeadSelfAttention, Projections, SdpaOptions, WeightLayout,
};
use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

type R<T> = anyhow::Result<T>;

fn randn(shape: &[usize], std: f32) -> R<Tensor> {
    Ok(Tensor::randn(0f32, std, shape, &Device::Cpu)?)
}

struct Layer {
    ours: MultiHeadSelfAttention,
    /// w_q, w_k, w_v, w_o (hidden, hidden) and their biases.
    w: [Tensor; 4],
    b: [Tensor; 4],
    heads: usize,
}

fn layer(hidden: usize, heads: usize) -> R<Layer> {
    let std = 1.0 / (hidden as f32).sqrt();
    let w = [(); 4].map(|_| randn(&[hidden, hidden], std));
    let b = [(); 4].map(|_| randn(&[hidden], 0.02));
    let [w0, w1, w2, w3] = w;
    let [b0, b1, b2, b3] = b;
    let (w, b) = ([w0?, w1?, w2?, w3?], [b0?, b1?, b2?, b3?]);
    let lin = |i: usize| LinearWeights::new(w[i].clone(), Some(b[i].clone()), "w");
    let p = Projections {
        q: lin(0),
        k: lin(1),
        v: lin(2),
        o: Some(lin(3)),
    };
    let ours =
        MultiHeadSelfAttention::new(p, &AttentionConfig::new(WeightLayout::TorchMha, heads))?;
    Ok(Layer { ours, w, b, heads })
}

fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> R<Tensor> {
    Ok(x.broadcast_matmul(&w.t()?)?.broadcast_add(b)?)
}

/// candle-transformers' BERT self-attention, op for op.
fn naive_mha(l: &Layer, x: &Tensor) -> R<Tensor> {
    let (b, t, d) = x.dims3()?;
    let (h, hd) = (l.heads, d / l.heads);
    let split = |y: Tensor| -> R<Tensor> {
        Ok(y.reshape((b, t, h, hd))?.transpose(1, 2)?.contiguous()?) // (b, h, t, hd)
    };
    let q = split(linear(x, &l.w[0], &l.b[0])?)?;
    let k = split(linear(x, &l.w[1], &l.b[1])?)?;
    let v = split(linear(x, &l.w[2], &l.b[2])?)?;
    let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?; // (b, h, t, t)
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    let ctx = probs
        .matmul(&v)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b, t, d))?; // (b, t, d)
    linear(&ctx, &l.w[3], &l.b[3])
}

fn mha(c: &mut Criterion) {
    let mut g = c.benchmark_group("mha");
    for (seq, hidden, heads) in [(32usize, 384usize, 12usize), (128, 768, 12), (512, 768, 12)] {
        let (Ok(l), Ok(x)) = (layer(hidden, heads), randn(&[1, seq, hidden], 1.0)) else {
            continue;
        };
        let cost = l
            .ours
            .cost(1, seq, seq, false)
            .map(|c| c.flops())
            .unwrap_or(0);
        g.throughput(Throughput::Elements(cost));
        if seq >= 512 {
            g.sample_size(20);
        }
        let shape = format!("{seq}x{hidden}");
        g.bench_function(BenchmarkId::new(&shape, "ours"), |bch| {
            bch.iter(|| l.ours.forward(&x, None).map(|o| o.context))
        });
        g.bench_function(BenchmarkId::new(&shape, "ours+weights"), |bch| {
            bch.iter(|| l.ours.forward_with_weights(&x, None).map(|o| o.context))
        });
        g.bench_function(BenchmarkId::new(&shape, "naive-candle"), |bch| {
            bch.iter(|| naive_mha(&l, &x))
        });
    }
    g.finish();
}

fn sdpa(c: &mut Criterion) {
    let mut g = c.benchmark_group("sdpa");
    g.sample_size(10);
    for seq in [1024usize, 4096] {
        let shape = [1, 8, seq, 64];
        let (Ok(q), Ok(k), Ok(v)) = (randn(&shape, 1.0), randn(&shape, 1.0), randn(&shape, 1.0))
        else {
            continue;
        };
        let causal = AttentionMask::causal();
        for (name, mask) in [("ours", None), ("ours-causal", Some(&causal))] {
            g.bench_function(BenchmarkId::new(seq.to_string(), name), |bch| {
                bch.iter(|| scaled_dot_product_attention(&q, &k, &v, mask, SdpaOptions::default()))
            });
        }
        g.bench_function(BenchmarkId::new(seq.to_string(), "naive-candle"), |bch| {
            bch.iter(|| -> R<Tensor> {
                let s = (q.matmul(&k.t()?)? / 8.0)?;
                Ok(candle_nn::ops::softmax_last_dim(&s)?.matmul(&v)?)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, mha, sdpa);
criterion_main!(benches);
