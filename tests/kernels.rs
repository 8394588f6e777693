//! The CPU kernels against the explicit composition of candle ops (the reference):
//! - the tiled online-softmax kernel (no weights) and the row-block kernel (weights) equal
//!   `scaled_dot_product_attention_explicit` within 1e-5 in f32, for grouped heads, causal
//!   masks with offsets, padding (with holes), keep and bias masks, `seq_q != seq_k`, sizes
//!   that are not multiples of the tile sizes and sequences longer than one key tile;
//! - fully masked rows give zeros, never NaN, across tiles too;
//! - strided (transposed) inputs and half precision take the same path;
//! - streamed weights equal the materialised ones, block by block, in order;
//! - the fused multi-head path equals `AttentionPath::Explicit`;
//! - the weights' memory is known before it is allocated, and a request the machine cannot
//!   hold is an error, not an abort;
//! - parameter and FLOP accounting.

mod common;

use candle_attention::{
    attention_weights_bytes, scaled_dot_product_attention, scaled_dot_product_attention_explicit,
    scaled_dot_product_attention_streamed, self_attention_cost, AttentionConfig, AttentionMask,
    AttentionPath, Error, LinearWeights, MultiHeadSelfAttention, Projections, SdpaOptions,
    WeightLayout, WeightsBlock,
};
use candle_core::{DType, Device, IndexOp, Tensor};
use common::{assert_close, has_non_finite};

const TOL: f32 = 1e-5;

/// Deterministic pseudo-random normal-ish values (sum of uniforms), scaled by `std`.
fn values(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * std * 1.7)
        .collect()
}

fn tensor(seed: u64, shape: &[usize], std: f32) -> anyhow::Result<Tensor> {
    let n = shape.iter().product();
    Ok(Tensor::from_vec(values(seed, n, std), shape, &Device::Cpu)?)
}

/// `(batch, seq_k)` keep mask from per-row kept key lists.
fn keep_rows(rows: &[Vec<u8>]) -> anyhow::Result<Tensor> {
    let k = rows[0].len();
    let flat: Vec<u8> = rows.iter().flatten().copied().collect();
    Ok(Tensor::from_vec(flat, (rows.len(), k), &Device::Cpu)?)
}

fn right_padding(lengths: &[usize], seq: usize) -> anyhow::Result<Tensor> {
    let rows: Vec<Vec<u8>> = lengths
        .iter()
        .map(|&l| (0..seq).map(|j| u8::from(j < l)).collect())
        .collect();
    keep_rows(&rows)
}

struct Case {
    b: usize,
    h: usize,
    kvh: usize,
    sq: usize,
    sk: usize,
    dk: usize,
    dv: usize,
}

/// Kernels (with and without weights) against the explicit path.
fn check_case(c: &Case, seed: u64, mask: Option<&AttentionMask>, what: &str) -> anyhow::Result<()> {
    let q = tensor(seed, &[c.b, c.h, c.sq, c.dk], 1.0)?;
    let k = tensor(seed + 1, &[c.b, c.kvh, c.sk, c.dk], 1.0)?;
    let v = tensor(seed + 2, &[c.b, c.kvh, c.sk, c.dv], 1.0)?;
    let reference =
        scaled_dot_product_attention_explicit(&q, &k, &v, mask, SdpaOptions::with_weights())?;
    let rw = reference.weights.as_ref().expect("weights");
    let with = scaled_dot_product_attention(&q, &k, &v, mask, SdpaOptions::with_weights())?;
    assert_close(
        with.weights.as_ref().expect("weights"),
        rw,
        TOL,
        &format!("{what}: weights"),
    )?;
    assert_close(
        &with.context,
        &reference.context,
        TOL,
        &format!("{what}: context (weights kernel)"),
    )?;
    let without = scaled_dot_product_attention(&q, &k, &v, mask, SdpaOptions::default())?;
    assert!(without.weights.is_none());
    assert_close(
        &without.context,
        &reference.context,
        TOL,
        &format!("{what}: context (tiled kernel)"),
    )?;
    anyhow::ensure!(
        !has_non_finite(&without.context)?,
        "{what}: non-finite context"
    );
    Ok(())
}

#[test]
fn kernels_equal_the_explicit_path() -> anyhow::Result<()> {
    let cases = [
        // One tile, grouped heads, d_k != d_v.
        Case {
            b: 2,
            h: 4,
            kvh: 2,
            sq: 7,
            sk: 7,
            dk: 8,
            dv: 5,
        },
        // Several key tiles (256 keys per tile) with ragged ends, seq_q != seq_k.
        Case {
            b: 1,
            h: 3,
            kvh: 1,
            sq: 300,
            sk: 613,
            dk: 16,
            dv: 16,
        },
        Case {
            b: 2,
            h: 2,
            kvh: 2,
            sq: 517,
            sk: 517,
            dk: 64,
            dv: 64,
        },
        // Single query (decoding) against many keys.
        Case {
            b: 1,
            h: 2,
            kvh: 1,
            sq: 1,
            sk: 700,
            dk: 32,
            dv: 24,
        },
    ];
    for (n, c) in cases.iter().enumerate() {
        let seed = 100 * n as u64;
        let what = format!("case {n} ({}x{}x{}x{})", c.b, c.h, c.sq, c.sk);
        check_case(c, seed, None, &format!("{what} no mask"))?;
        let offset = c.sk.saturating_sub(c.sq);
        check_case(
            c,
            seed,
            Some(&AttentionMask::causal_with_offset(offset)),
            &format!("{what} causal+{offset}"),
        )?;
        check_case(
            c,
            seed,
            Some(&AttentionMask::causal()),
            &format!("{what} causal"),
        )?;
        let lengths: Vec<usize> = (0..c.b).map(|i| c.sk - (c.sk / 3) * i).collect();
        let pad = AttentionMask::padding(&right_padding(&lengths, c.sk)?)?;
        check_case(c, seed, Some(&pad), &format!("{what} padding"))?;
        let both = AttentionMask::causal_with_offset(offset).and(pad.clone());
        check_case(c, seed, Some(&both), &format!("{what} causal+padding"))?;
        // Padding with holes and left padding.
        let rows: Vec<Vec<u8>> = (0..c.b)
            .map(|i| {
                (0..c.sk)
                    .map(|j| u8::from((j + i) % 5 != 0 && j >= i))
                    .collect()
            })
            .collect();
        let holes = AttentionMask::padding(&keep_rows(&rows)?)?;
        check_case(c, seed, Some(&holes), &format!("{what} padding with holes"))?;
        // A keep mask (seq_q, seq_k) and an additive bias (heads, seq_q, seq_k) broadcast.
        let keep = Tensor::from_vec(
            (0..c.sq * c.sk)
                .map(|i| u8::from(i % 7 != 3))
                .collect::<Vec<_>>(),
            (c.sq, c.sk),
            &Device::Cpu,
        )?;
        let keep = AttentionMask::keep(&keep)?;
        check_case(c, seed, Some(&keep), &format!("{what} keep"))?;
        let bias = AttentionMask::bias(&tensor(seed + 7, &[c.h, c.sq, c.sk], 2.0)?)?;
        check_case(
            c,
            seed,
            Some(&bias.and(AttentionMask::causal())),
            &format!("{what} bias+causal"),
        )?;
    }
    Ok(())
}

#[test]
fn wide_scores_across_tiles_equal_the_explicit_path() -> anyhow::Result<()> {
    // Queries scaled up so that scores span far more than f32's exponent range within a row
    // (each row's reference moves, rows leave the one-pass softmax for the careful one), over
    // several key tiles, with the causal diagonal crossing tiles at every offset.
    let (b, h, sq, sk, d) = (2, 2, 530, 700, 16);
    let k = tensor(2, &[b, h, sk, d], 1.0)?;
    let v = tensor(3, &[b, h, sk, d], 1.0)?;
    let pad = AttentionMask::padding(&right_padding(&[700, 451], sk)?)?;
    for qs in [4.0, 40.0] {
        let q = tensor(1, &[b, h, sq, d], qs)?;
        for (mask, name) in [
            (AttentionMask::causal(), "causal"),
            (AttentionMask::causal_with_offset(sk - sq), "causal+offset"),
            (
                AttentionMask::causal_with_offset(sk - sq).and(pad.clone()),
                "causal+padding",
            ),
        ] {
            let what = format!("queries x{qs}, {name}");
            let fast =
                scaled_dot_product_attention(&q, &k, &v, Some(&mask), SdpaOptions::default())?;
            let slow = scaled_dot_product_attention_explicit(
                &q,
                &k,
                &v,
                Some(&mask),
                SdpaOptions::default(),
            )?;
            anyhow::ensure!(!has_non_finite(&fast.context)?, "{what}: non-finite");
            // An f32 score of size x carries an error of ~x * 2^-24 whichever way it is
            // summed, and the weights inherit it: the tolerance grows with the scores (a lost
            // tile or a wrong rescaling errs by 1e-2 and more).
            assert_close(&fast.context, &slow.context, TOL * qs, &what)?;
        }
    }
    Ok(())
}

#[test]
fn fully_masked_rows_are_zero_across_tiles() -> anyhow::Result<()> {
    let c = Case {
        b: 2,
        h: 2,
        kvh: 1,
        sq: 260,
        sk: 600,
        dk: 8,
        dv: 8,
    };
    // Batch 1 keeps no key at all; in batch 0 query rows 3 and 258 see nothing (keep mask).
    let pad = AttentionMask::padding(&right_padding(&[600, 0], 600)?)?;
    let mut keep = vec![1u8; c.sq * c.sk];
    for i in [3usize, 258] {
        keep[i * c.sk..(i + 1) * c.sk].fill(0);
    }
    let keep = AttentionMask::keep(&Tensor::from_vec(keep, (c.sq, c.sk), &Device::Cpu)?)?;
    let mask = pad.and(keep);
    check_case(&c, 7, Some(&mask), "fully masked rows")?;
    let q = tensor(7, &[c.b, c.h, c.sq, c.dk], 1.0)?;
    let k = tensor(8, &[c.b, c.kvh, c.sk, c.dk], 1.0)?;
    let v = tensor(9, &[c.b, c.kvh, c.sk, c.dv], 1.0)?;
    for opts in [SdpaOptions::default(), SdpaOptions::with_weights()] {
        let out = scaled_dot_product_attention(&q, &k, &v, Some(&mask), opts)?;
        let ctx = out.context;
        anyhow::ensure!(!has_non_finite(&ctx)?, "NaN in context");
        let zero_rows = [
            ctx.i((1, .., .., ..))?,
            ctx.i((0, .., 3, ..))?,
            ctx.i((0, .., 258, ..))?,
        ];
        for r in zero_rows {
            let v: Vec<f32> = r.flatten_all()?.to_vec1()?;
            assert!(v.iter().all(|&x| x == 0.0), "masked rows must be zero");
        }
        if let Some(w) = out.weights {
            let v: Vec<f32> = w.i((1, .., .., ..))?.flatten_all()?.to_vec1()?;
            assert!(v.iter().all(|&x| x == 0.0));
        }
    }
    Ok(())
}

#[test]
fn strided_and_half_precision_inputs() -> anyhow::Result<()> {
    // q, k, v as transposed views of (batch, seq, heads, d): no copy needed by the kernels.
    let (b, t, h, d) = (2, 290, 4, 16);
    let bshd = |seed| tensor(seed, &[b, t, h, d], 1.0);
    let (q, k, v) = (bshd(1)?, bshd(2)?, bshd(3)?);
    let (qt, kt, vt) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?); // (b, h, t, d)
    let causal = AttentionMask::causal();
    let strided =
        scaled_dot_product_attention(&qt, &kt, &vt, Some(&causal), SdpaOptions::default())?;
    let (qc, kc, vc) = (qt.contiguous()?, kt.contiguous()?, vt.contiguous()?);
    let reference = scaled_dot_product_attention_explicit(
        &qc,
        &kc,
        &vc,
        Some(&causal),
        SdpaOptions::default(),
    )?;
    assert_close(&strided.context, &reference.context, TOL, "strided")?;

    for dtype in [DType::F16, DType::BF16] {
        let (qh, kh, vh) = (
            qc.to_dtype(dtype)?,
            kc.to_dtype(dtype)?,
            vc.to_dtype(dtype)?,
        );
        for opts in [SdpaOptions::default(), SdpaOptions::with_weights()] {
            let fast = scaled_dot_product_attention(&qh, &kh, &vh, Some(&causal), opts)?;
            let slow = scaled_dot_product_attention_explicit(&qh, &kh, &vh, Some(&causal), opts)?;
            assert_eq!(fast.context.dtype(), dtype);
            // Same f32 computation on the same inputs; the context is rounded to `dtype`.
            let tol = if dtype == DType::F16 { 2e-3 } else { 1.6e-2 };
            assert_close(
                &fast.context,
                &slow.context,
                tol,
                &format!("{dtype:?} context"),
            )?;
            if let (Some(a), Some(b)) = (&fast.weights, &slow.weights) {
                assert_close(a, b, TOL, &format!("{dtype:?} weights"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn streamed_weights_equal_the_returned_ones() -> anyhow::Result<()> {
    let (b, h, kvh, sq, sk, d) = (2, 4, 2, 150, 170, 16);
    let q = tensor(11, &[b, h, sq, d], 1.0)?;
    let k = tensor(12, &[b, kvh, sk, d], 1.0)?;
    let v = tensor(13, &[b, kvh, sk, d], 1.0)?;
    let mask = AttentionMask::causal_with_offset(sk - sq)
        .and(AttentionMask::padding(&right_padding(&[170, 100], sk)?)?);
    let full = scaled_dot_product_attention(&q, &k, &v, Some(&mask), SdpaOptions::with_weights())?;
    let expected: Vec<f32> = full
        .weights
        .as_ref()
        .expect("weights")
        .flatten_all()?
        .to_vec1()?;
    let mut streamed = vec![f32::NAN; b * h * sq * sk];
    let mut order = Vec::new();
    let context = scaled_dot_product_attention_streamed(
        &q,
        &k,
        &v,
        Some(&mask),
        None,
        |blk: WeightsBlock<'_>| {
            assert_eq!(blk.seq_k, sk);
            let start = ((blk.batch * h + blk.head) * sq + blk.query_start) * sk;
            streamed[start..start + blk.weights.len()].copy_from_slice(blk.weights);
            order.push((blk.batch, blk.head, blk.query_start, blk.rows()));
            Ok(())
        },
    )?;
    assert_eq!(
        streamed, expected,
        "streamed weights differ from the returned ones"
    );
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(
        order, sorted,
        "blocks must arrive in (batch, head, query) order"
    );
    assert_eq!(order.iter().map(|o| o.3).sum::<usize>(), b * h * sq);
    assert_close(&context, &full.context, 0.0, "streamed context")?;

    // An error from the callback stops the call and comes back.
    let err = scaled_dot_product_attention_streamed(&q, &k, &v, None, None, |_| {
        Err(Error::config("consumer full"))
    })
    .unwrap_err();
    assert!(err.to_string().contains("consumer full"), "{err}");
    Ok(())
}

fn random_layer(
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    causal: bool,
) -> anyhow::Result<MultiHeadSelfAttention> {
    let hd = hidden / heads;
    let std = 1.0 / (hidden as f32).sqrt();
    let lin = |seed, out, name: &str| -> anyhow::Result<LinearWeights> {
        Ok(LinearWeights::new(
            tensor(seed, &[out, hidden], std)?,
            Some(tensor(seed + 50, &[out], 0.1)?),
            name,
        ))
    };
    let p = Projections {
        q: lin(21, hidden, "q")?,
        k: lin(22, kv_heads * hd, "k")?,
        v: lin(23, kv_heads * hd, "v")?,
        o: Some(lin(24, hidden, "o")?),
    };
    let cfg = AttentionConfig::new(WeightLayout::TorchMha, heads)
        .with_kv_heads(kv_heads)
        .with_causal(causal);
    Ok(MultiHeadSelfAttention::new(p, &cfg)?)
}

#[test]
fn fused_multi_head_path_equals_the_explicit_path() -> anyhow::Result<()> {
    for (hidden, heads, kv_heads, seq, causal) in [
        (48, 4, 4, 9, false),
        (64, 8, 2, 300, true),
        (32, 2, 1, 333, false),
    ] {
        let fast = random_layer(hidden, heads, kv_heads, causal)?;
        let slow = fast.clone().with_path(AttentionPath::Explicit);
        assert_eq!(slow.path(), AttentionPath::Explicit);
        let x = tensor(31, &[2, seq, hidden], 1.0)?;
        let pad = AttentionMask::padding(&right_padding(&[seq, seq / 2], seq)?)?;
        for mask in [None, Some(&pad)] {
            let what = format!(
                "hidden {hidden}, heads {heads}/{kv_heads}, seq {seq}, causal {causal}, padding {}",
                mask.is_some()
            );
            let r = slow.forward_with_weights(&x, mask)?;
            let w = fast.forward_with_weights(&x, mask)?;
            assert_close(
                w.weights.as_ref().expect("w"),
                r.weights.as_ref().expect("w"),
                TOL,
                &format!("{what}: weights"),
            )?;
            assert_close(
                &w.context,
                &r.context,
                TOL,
                &format!("{what}: context with weights"),
            )?;
            let c = fast.forward(&x, mask)?;
            assert_close(&c.context, &r.context, TOL, &format!("{what}: context"))?;
            // Streaming through the module: same context, weights of every row.
            let mut rows = 0;
            let s = fast.forward_streamed(&x, mask, |blk| {
                rows += blk.rows();
                Ok(())
            })?;
            assert!(s.weights.is_none());
            assert_eq!(rows, 2 * heads * seq);
            assert_close(
                &s.context,
                &w.context,
                0.0,
                &format!("{what}: streamed context"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn weights_memory_is_known_before_allocating() -> anyhow::Result<()> {
    // seq 16384, 8 heads: 8.6 GB of weights for one sequence.
    assert_eq!(attention_weights_bytes(1, 8, 16384, 16384), 8_589_934_592);
    // 2^20 queries by 2^20 keys: 4 TiB of weights is refused up front (inputs are 4 MiB).
    let n = 1 << 20;
    let q = Tensor::zeros((1, 1, n, 1), DType::F32, &Device::Cpu)?;
    let err =
        scaled_dot_product_attention(&q, &q, &q, None, SdpaOptions::with_weights()).unwrap_err();
    assert!(
        matches!(err, Error::Memory { needed, .. } if needed == 1 << 42),
        "{err:?}"
    );
    assert!(err.to_string().contains("4096.0 GiB"), "{err}");
    Ok(())
}

#[test]
fn cost_accounting() -> anyhow::Result<()> {
    let layer = random_layer(64, 8, 8, false)?;
    let cost = layer.cost(3, 10, 10, false)?;
    assert_eq!(cost, self_attention_cost(3, 10, 64, 8, 8, false));
    assert_eq!(cost.parameters, 4 * 64 * 64 + 4 * 64);
    let (t, d) = (10u64, 64u64);
    assert_eq!(
        cost.flops(),
        3 * (6 * t * d * d + 4 * t * t * d + 2 * t * d * d)
    );
    let gqa = random_layer(64, 8, 2, true)?;
    assert_eq!(
        gqa.cost(1, 10, 10, true)?,
        self_attention_cost(1, 10, 64, 8, 2, true)
    );
    Ok(())
}
