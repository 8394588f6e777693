//! Invariant tests: properties that hold for any input, checked on small random tensors
//! (candle's `randn` is not seedable, so these compare properties, not values) and on the
//! shipped MiniLM weights (`weights/model.safetensors`, BERT layout, 12 heads, hidden 384).
//!
//! - rows of the weights sum to 1; hidden keys get exactly 0;
//! - a padded batch row equals the same sequence run alone;
//! - single-head attention equals multi-head attention with one head;
//! - the path without weights gives the same context as the one with them;
//! - f16/bf16 inputs with fully masked rows give zeros, never NaN;
//! - grouped K/V heads equal explicitly repeated K/V heads;
//! - causal attention does not look ahead; attention without a mask is permutation
//!   equivariant; the `Module` impl equals `forward`; huge logits stay finite.

mod common;

use candle_attention::{
    scaled_dot_product_attention, AttentionConfig, AttentionMask, Checkpoint, LinearWeights,
    MultiHeadSelfAttention, Projections, SdpaOptions, SingleHeadSelfAttention, WeightLayout,
};
use candle_core::{DType, Device, IndexOp, Module, Tensor};
use common::{assert_close, has_non_finite, repo_path};

const SUM_TOL: f32 = 1e-5;
const WEIGHTS_TOL: f32 = 1e-5;
const CONTEXT_TOL: f32 = 1e-4;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn randn(shape: &[usize]) -> anyhow::Result<Tensor> {
    Ok(Tensor::randn(0f32, 1f32, shape, &Device::Cpu)?)
}

fn with_weights() -> SdpaOptions {
    SdpaOptions::with_weights()
}

fn no_weights() -> SdpaOptions {
    SdpaOptions::default()
}

/// `(batch, heads, seq_q, seq_k)` weights as a flat vector plus their dims.
struct Weights {
    data: Vec<f32>,
    dims: (usize, usize, usize, usize),
}

impl Weights {
    fn of(t: &Tensor) -> anyhow::Result<Self> {
        let dims = t.dims4()?;
        let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        Ok(Self { data, dims })
    }

    fn at(&self, b: usize, h: usize, i: usize, j: usize) -> f32 {
        let (_, nh, nq, nk) = self.dims;
        self.data[((b * nh + h) * nq + i) * nk + j]
    }

    fn row_sum(&self, b: usize, h: usize, i: usize) -> f32 {
        (0..self.dims.3).map(|j| self.at(b, h, i, j)).sum()
    }

    /// Every row sums to 1.
    fn assert_rows_sum_to_one(&self, what: &str) {
        let (nb, nh, nq, _) = self.dims;
        for b in 0..nb {
            for h in 0..nh {
                for i in 0..nq {
                    let s = self.row_sum(b, h, i);
                    assert!(
                        (s - 1.0).abs() <= SUM_TOL,
                        "{what}: row (b {b}, h {h}, q {i}) sums to {s}"
                    );
                }
            }
        }
    }

    /// Hidden keys have weight exactly 0, visible keys a positive weight, rows with a
    /// visible key sum to 1 and rows without one are all zero.
    fn assert_follows(&self, visible: impl Fn(usize, usize, usize, usize) -> bool, what: &str) {
        let (nb, nh, nq, nk) = self.dims;
        for b in 0..nb {
            for h in 0..nh {
                for i in 0..nq {
                    let mut any = false;
                    for j in 0..nk {
                        let w = self.at(b, h, i, j);
                        if visible(b, h, i, j) {
                            any = true;
                            assert!(
                                w > 0.0 && w.is_finite(),
                                "{what}: visible key (b {b}, h {h}, q {i}, k {j}) has weight {w}"
                            );
                        } else {
                            assert!(
                                w == 0.0 && w.is_sign_positive(),
                                "{what}: hidden key (b {b}, h {h}, q {i}, k {j}) has weight {w:e}, not exactly 0"
                            );
                        }
                    }
                    let s = self.row_sum(b, h, i);
                    let expected = if any { 1.0 } else { 0.0 };
                    assert!(
                        (s - expected).abs() <= SUM_TOL,
                        "{what}: row (b {b}, h {h}, q {i}) sums to {s}, expected {expected}"
                    );
                }
            }
        }
    }
}

fn weights_of(out: &candle_attention::AttentionOutput) -> anyhow::Result<Weights> {
    let w = out
        .weights
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("weights were requested but not returned"))?;
    anyhow::ensure!(w.dtype() == DType::F32, "weights are {:?}", w.dtype());
    Weights::of(w)
}

/// A random projection `(out, in)` with an optional bias, scaled like an initialised layer.
fn random_linear(out: usize, inp: usize, bias: bool, name: &str) -> anyhow::Result<LinearWeights> {
    let std = 1.0 / (inp as f64).sqrt();
    let w = (randn(&[out, inp])? * std)?;
    let b = if bias {
        Some((randn(&[out])? * 0.1)?)
    } else {
        None
    };
    Ok(LinearWeights::new(w, b, name))
}

/// Random multi-head projections: `heads * head_dim` query rows, `kv_heads * head_dim` key
/// rows, `kv_heads * v_head_dim` value rows and an output projection back to `hidden`.
fn random_projections(
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    v_head_dim: usize,
) -> anyhow::Result<Projections> {
    Ok(Projections {
        q: random_linear(heads * head_dim, hidden, true, "q")?,
        k: random_linear(kv_heads * head_dim, hidden, true, "k")?,
        v: random_linear(kv_heads * v_head_dim, hidden, true, "v")?,
        o: Some(random_linear(hidden, heads * v_head_dim, true, "o")?),
    })
}

/// A random grouped-query layer: hidden 16, 4 query heads, 2 key/value heads of 4.
fn random_gqa_layer(causal: bool) -> anyhow::Result<MultiHeadSelfAttention> {
    let p = random_projections(16, 4, 2, 4, 4)?;
    let cfg = AttentionConfig::new(WeightLayout::Llama, 4)
        .with_kv_heads(2)
        .with_causal(causal);
    Ok(MultiHeadSelfAttention::new(p, &cfg)?)
}

/// One attention layer of the shipped MiniLM checkpoint (stored f16) in `dtype`.
fn bert_layer(layer: usize, dtype: DType) -> anyhow::Result<MultiHeadSelfAttention> {
    let ckpt = Checkpoint::open(repo_path("weights/model.safetensors"))?;
    let vb = ckpt.var_builder(dtype, &Device::Cpu);
    let cfg = AttentionConfig::new(WeightLayout::Bert, 12);
    let attn =
        MultiHeadSelfAttention::load(vb.pp(format!("encoder.layer.{layer}.attention")), &cfg)?;
    assert_eq!(attn.hidden_size(), 384);
    assert_eq!(attn.num_heads(), 12);
    Ok(attn)
}

/// `(batch, seq_k)` padding mask from per-sequence lengths (1 = keep).
fn padding_mask(lengths: &[usize], seq: usize) -> anyhow::Result<Tensor> {
    let data: Vec<u8> = lengths
        .iter()
        .flat_map(|&n| (0..seq).map(move |j| u8::from(j < n)))
        .collect();
    Ok(Tensor::from_vec(data, (lengths.len(), seq), &Device::Cpu)?)
}

/// K or V heads repeated `n` times each along dim 1 (`torch.repeat_interleave(t, n, 1)`):
/// head `h` of the result is head `h / n` of the input.
fn repeat_interleave_heads(t: &Tensor, n: usize) -> anyhow::Result<Tensor> {
    let (b, kv, s, d) = t.dims4()?;
    Ok(t.unsqueeze(2)? // (b, kv, 1, s, d)
        .broadcast_as((b, kv, n, s, d))? // (b, kv, n, s, d)
        .reshape((b, kv * n, s, d))?) // (b, kv*n, s, d)
}

// ---------------------------------------------------------------------------------------
// 1. Rows of the weights sum to 1
// ---------------------------------------------------------------------------------------

#[test]
fn sdpa_weight_rows_sum_to_one() -> anyhow::Result<()> {
    // Plain multi-head (heads == kv_heads), cross-attention shapes (seq_q != seq_k).
    let (q, k, v) = (
        randn(&[2, 3, 4, 8])?,
        randn(&[2, 3, 6, 8])?,
        randn(&[2, 3, 6, 5])?,
    );
    let out = scaled_dot_product_attention(&q, &k, &v, None, with_weights())?;
    weights_of(&out)?.assert_rows_sum_to_one("sdpa");
    // Grouped K/V heads: 6 query heads over 2 key/value heads, d_k 4, d_v 3.
    let (q, k, v) = (
        randn(&[2, 6, 5, 4])?,
        randn(&[2, 2, 7, 4])?,
        randn(&[2, 2, 7, 3])?,
    );
    let out = scaled_dot_product_attention(&q, &k, &v, None, with_weights())?;
    assert_eq!(out.context.dims(), &[2, 6, 5, 3]);
    weights_of(&out)?.assert_rows_sum_to_one("sdpa gqa");
    // With an explicit scale and a partial padding mask every row still sums to 1.
    let mask = AttentionMask::padding(&padding_mask(&[7, 3], 7)?)?;
    let opts = SdpaOptions {
        scale: Some(0.1),
        need_weights: true,
    };
    let out = scaled_dot_product_attention(&q, &k, &v, Some(&mask), opts)?;
    weights_of(&out)?.assert_rows_sum_to_one("sdpa gqa padded");
    Ok(())
}

#[test]
fn module_weight_rows_sum_to_one() -> anyhow::Result<()> {
    let bert = bert_layer(0, DType::F32)?;
    let x = randn(&[2, 6, 384])?;
    let out = bert.forward_with_weights(&x, None)?;
    assert_eq!(out.context.dims(), &[2, 6, 384]);
    let w = weights_of(&out)?;
    assert_eq!(w.dims, (2, 12, 6, 6));
    w.assert_rows_sum_to_one("bert layer 0");
    let mask = AttentionMask::padding(&padding_mask(&[6, 2], 6)?)?;
    weights_of(&bert.forward_with_weights(&x, Some(&mask))?)?
        .assert_rows_sum_to_one("bert layer 0 padded");

    let gqa = random_gqa_layer(true)?;
    let x = randn(&[3, 5, 16])?;
    weights_of(&gqa.forward_with_weights(&x, None)?)?.assert_rows_sum_to_one("gqa causal");

    let head = SingleHeadSelfAttention::new(
        random_linear(8, 12, true, "query")?,
        random_linear(8, 12, true, "key")?,
        random_linear(5, 12, true, "value")?,
    )?;
    let out = head.forward_with_weights(&randn(&[2, 4, 12])?, None)?;
    assert_eq!(out.context.dims(), &[2, 4, 5]);
    weights_of(&out)?.assert_rows_sum_to_one("single head");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 2. Masked weights are exactly 0
// ---------------------------------------------------------------------------------------

/// Random `(2, 2, seq_q, d)` / `(2, 2, seq_k, d)` q, k, v.
fn qkv(seq_q: usize, seq_k: usize) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    Ok((
        randn(&[2, 2, seq_q, 4])?,
        randn(&[2, 2, seq_k, 4])?,
        randn(&[2, 2, seq_k, 3])?,
    ))
}

fn masked_weights(seq_q: usize, seq_k: usize, mask: &AttentionMask) -> anyhow::Result<Weights> {
    let (q, k, v) = qkv(seq_q, seq_k)?;
    let out = scaled_dot_product_attention(&q, &k, &v, Some(mask), with_weights())?;
    anyhow::ensure!(!has_non_finite(&out.context)?, "non-finite context");
    weights_of(&out)
}

#[test]
fn padding_hides_padded_keys_exactly() -> anyhow::Result<()> {
    let lengths = [3usize, 5];
    let mask = AttentionMask::padding(&padding_mask(&lengths, 5)?)?;
    masked_weights(4, 5, &mask)?.assert_follows(|b, _, _, j| j < lengths[b], "padding");
    Ok(())
}

#[test]
fn causal_hides_future_keys_exactly() -> anyhow::Result<()> {
    let mask = AttentionMask::causal();
    masked_weights(5, 5, &mask)?.assert_follows(|_, _, i, j| j <= i, "causal");
    Ok(())
}

#[test]
fn causal_with_offset_sees_cached_keys() -> anyhow::Result<()> {
    // Three new queries after two cached keys: query i sees keys 0..=2 + i.
    let mask = AttentionMask::causal_with_offset(2);
    let w = masked_weights(3, 5, &mask)?;
    w.assert_follows(|_, _, i, j| j <= 2 + i, "causal offset 2");
    // The last query sees every key.
    assert!((0..5).all(|j| w.at(0, 0, 2, j) > 0.0));
    Ok(())
}

#[test]
fn keep_and_block_masks_hide_exactly() -> anyhow::Result<()> {
    // Rank 2 (seq_q, seq_k) keep pattern, broadcast over batch and heads.
    let keep: [[u8; 5]; 4] = [
        [1, 0, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
        [0, 0, 0, 0, 1],
    ];
    let keep_t = Tensor::new(&keep, &Device::Cpu)?;
    let mask = AttentionMask::keep(&keep_t)?;
    masked_weights(4, 5, &mask)?.assert_follows(|_, _, i, j| keep[i][j] != 0, "keep");
    // The same pattern as a block mask (non-zero = blocked) in f32, rank 4 (1, 1, q, k).
    let block_t = (1.0 - keep_t.to_dtype(DType::F32)?)?.reshape((1, 1, 4, 5))?;
    let mask = AttentionMask::block(&block_t)?;
    masked_weights(4, 5, &mask)?.assert_follows(|_, _, i, j| keep[i][j] != 0, "block");
    // A per-batch, per-head rank 4 keep mask (2, 2, 1, 5) broadcast over queries.
    let per_head: [[[u8; 5]; 2]; 2] = [
        [[1, 1, 0, 0, 0], [0, 0, 1, 1, 1]],
        [[1, 0, 1, 0, 1], [0, 1, 0, 1, 0]],
    ];
    let t = Tensor::new(&per_head, &Device::Cpu)?.reshape((2, 2, 1, 5))?;
    let mask = AttentionMask::keep(&t)?;
    masked_weights(3, 5, &mask)?
        .assert_follows(|b, h, _, j| per_head[b][h][j] != 0, "keep per head");
    Ok(())
}

#[test]
fn combined_masks_hide_the_union() -> anyhow::Result<()> {
    let lengths = [4usize, 6];
    let block: [[u8; 6]; 6] = [
        [0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 1],
    ];
    let mask = AttentionMask::causal()
        .and(AttentionMask::padding(&padding_mask(&lengths, 6)?)?)
        .and(AttentionMask::block(&Tensor::new(&block, &Device::Cpu)?)?);
    masked_weights(6, 6, &mask)?.assert_follows(
        |b, _, i, j| j <= i && j < lengths[b] && block[i][j] == 0,
        "causal and padding and block",
    );
    Ok(())
}

#[test]
fn bias_with_neg_infinity_hides_exactly() -> anyhow::Result<()> {
    let inf = f32::NEG_INFINITY;
    let bias: [[f32; 5]; 3] = [
        [0.5, inf, -1.0, 0.0, inf],
        [inf, inf, 2.0, inf, inf],
        [-0.5, 0.25, 0.0, 1.0, -2.0],
    ];
    let mask = AttentionMask::bias(&Tensor::new(&bias, &Device::Cpu)?)?;
    let w = masked_weights(3, 5, &mask)?;
    w.assert_follows(|_, _, i, j| bias[i][j].is_finite(), "bias");
    // A row with one finite entry puts all its weight there.
    assert_eq!(w.at(1, 1, 1, 2), 1.0);
    // A bias combined with padding: both hide.
    let lengths = [5usize, 2];
    let mask = mask.and(AttentionMask::padding(&padding_mask(&lengths, 5)?)?);
    masked_weights(3, 5, &mask)?.assert_follows(
        |b, _, i, j| bias[i][j].is_finite() && j < lengths[b],
        "bias and padding",
    );
    Ok(())
}

#[test]
fn module_padding_hides_padded_keys_exactly() -> anyhow::Result<()> {
    let bert = bert_layer(1, DType::F32)?;
    let lengths = [6usize, 3];
    let mask = AttentionMask::padding(&padding_mask(&lengths, 6)?)?;
    let out = bert.forward_with_weights(&randn(&[2, 6, 384])?, Some(&mask))?;
    weights_of(&out)?.assert_follows(|b, _, _, j| j < lengths[b], "bert padding");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 3. A padded batch row equals the sequence run alone
// ---------------------------------------------------------------------------------------

#[test]
fn padded_batch_row_equals_sequence_alone() -> anyhow::Result<()> {
    let bert = bert_layer(2, DType::F32)?;
    let long = randn(&[1, 7, 384])?;
    let short = randn(&[1, 4, 384])?;
    // The short sequence padded to 7 with (arbitrary) filler activations.
    let filler = (randn(&[1, 3, 384])? * 3.0)?;
    let padded = Tensor::cat(&[&short, &filler], 1)?; // (1, 7, 384)
    let batch = Tensor::cat(&[&long, &padded], 0)?; // (2, 7, 384)
    let mask = AttentionMask::padding(&padding_mask(&[7, 4], 7)?)?;
    let out = bert.forward_with_weights(&batch, Some(&mask))?;
    let bw = out.weights.clone().expect("weights");

    // The long sequence (no padding) alone.
    let alone = bert.forward_with_weights(&long, None)?;
    assert_close(
        &out.context.i(0..1)?,
        &alone.context,
        CONTEXT_TOL,
        "row 0 context",
    )?;
    assert_close(
        &bw.i(0..1)?,
        alone.weights.as_ref().expect("weights"),
        WEIGHTS_TOL,
        "row 0 weights",
    )?;

    // The short sequence alone: its real rows, restricted to its real keys.
    let alone = bert.forward_with_weights(&short, None)?;
    assert_close(
        &out.context.i((1..2, 0..4))?,
        &alone.context,
        CONTEXT_TOL,
        "row 1 context (real tokens)",
    )?;
    let aw = alone.weights.as_ref().expect("weights");
    assert_close(
        &bw.i((1..2, .., 0..4, 0..4))?,
        aw,
        WEIGHTS_TOL,
        "row 1 weights (real queries, real keys)",
    )?;
    // Padded keys get nothing, from real and padded queries alike.
    let padded_keys = bw.i((1, .., .., 4..))?.flatten_all()?.to_vec1::<f32>()?;
    assert!(padded_keys.iter().all(|&w| w == 0.0), "{padded_keys:?}");
    anyhow::ensure!(!has_non_finite(&out.context)?, "non-finite context");

    // The padding filler does not matter: another filler gives the same real rows.
    let padded2 = Tensor::cat(&[&short, &randn(&[1, 3, 384])?], 1)?;
    let batch2 = Tensor::cat(&[&long, &padded2], 0)?;
    let out2 = bert.forward(&batch2, Some(&mask))?;
    assert_close(
        &out2.context.i((.., 0..4))?,
        &out.context.i((.., 0..4))?,
        CONTEXT_TOL,
        "padding filler changes real rows",
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 4. Single-head attention equals multi-head attention with one head
// ---------------------------------------------------------------------------------------

#[test]
fn single_head_equals_multi_head_with_one_head() -> anyhow::Result<()> {
    // d_k (8) != d_v (5), hidden 12, biases on all three projections.
    let q = random_linear(8, 12, true, "query")?;
    let k = random_linear(8, 12, true, "key")?;
    let v = random_linear(5, 12, true, "value")?;
    for causal in [false, true] {
        let single =
            SingleHeadSelfAttention::new(q.clone(), k.clone(), v.clone())?.with_causal(causal);
        let p = Projections {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            o: None,
        };
        let cfg = AttentionConfig::new(WeightLayout::Single, 1).with_causal(causal);
        let multi = MultiHeadSelfAttention::new(p, &cfg)?;
        assert_eq!((multi.head_dim(), multi.v_head_dim()), (8, 5));
        assert_eq!(multi.output_size()?, 5);
        let x = randn(&[2, 5, 12])?;
        let padding = AttentionMask::padding(&padding_mask(&[5, 3], 5)?)?;
        for mask in [None, Some(&padding)] {
            let what = format!("causal {causal}, mask {}", mask.is_some());
            let a = single.forward_with_weights(&x, mask)?;
            let b = multi.forward_with_weights(&x, mask)?;
            assert_eq!(a.context.dims(), &[2, 5, 5]);
            assert_close(&a.context, &b.context, 1e-6, &format!("{what} context"))?;
            assert_close(
                a.weights.as_ref().expect("weights"),
                b.weights.as_ref().expect("weights"),
                1e-6,
                &format!("{what} weights"),
            )?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 5. The path without weights gives the same context
// ---------------------------------------------------------------------------------------

#[test]
fn sdpa_without_weights_gives_the_same_context() -> anyhow::Result<()> {
    let padding = AttentionMask::padding(&padding_mask(&[7, 2], 7)?)?;
    let causal = AttentionMask::causal_with_offset(2);
    // (q heads, kv heads, seq_q, seq_k): plain, GQA, cross with a longer kv.
    for (h, kv, sq, sk) in [(3, 3, 5, 5), (6, 2, 5, 5), (4, 2, 3, 7), (6, 1, 5, 7)] {
        let (q, k, v) = (
            randn(&[2, h, sq, 4])?,
            randn(&[2, kv, sk, 4])?,
            randn(&[2, kv, sk, 3])?,
        );
        let mut masks: Vec<Option<&AttentionMask>> = vec![None];
        if sk == 7 {
            masks.push(Some(&padding));
        }
        if sk == sq + 2 {
            masks.push(Some(&causal));
        }
        for mask in masks {
            let slow = scaled_dot_product_attention(&q, &k, &v, mask, with_weights())?;
            let fast = scaled_dot_product_attention(&q, &k, &v, mask, no_weights())?;
            assert!(fast.weights.is_none(), "weights not asked for but returned");
            assert_close(
                &fast.context,
                &slow.context,
                1e-6,
                &format!("h {h}, kv {kv}, q {sq}, k {sk}, mask {}", mask.is_some()),
            )?;
        }
    }
    Ok(())
}

#[test]
fn modules_without_weights_give_the_same_context() -> anyhow::Result<()> {
    let x = randn(&[2, 6, 16])?;
    let padding = AttentionMask::padding(&padding_mask(&[6, 3], 6)?)?;
    for causal in [false, true] {
        let layer = random_gqa_layer(causal)?;
        for mask in [None, Some(&padding)] {
            let what = format!("gqa causal {causal}, mask {}", mask.is_some());
            let fast = layer.forward(&x, mask)?;
            assert!(fast.weights.is_none());
            let slow = layer.forward_with_weights(&x, mask)?;
            assert_close(&fast.context, &slow.context, 1e-6, &what)?;
        }
        // Cross-attention with a longer kv, with and without a kv padding mask.
        let kv = randn(&[2, 9, 16])?;
        let kv_padding = AttentionMask::padding(&padding_mask(&[9, 4], 9)?)?;
        for mask in [None, Some(&kv_padding)] {
            let what = format!("cross causal {causal}, mask {}", mask.is_some());
            let fast = layer.cross_attention(&x, &kv, mask, false)?;
            assert!(fast.weights.is_none());
            let slow = layer.cross_attention(&x, &kv, mask, true)?;
            assert_eq!(
                slow.weights.as_ref().expect("weights").dims(),
                &[2, 4, 6, 9]
            );
            assert_close(&fast.context, &slow.context, 1e-6, &what)?;
        }
    }
    // The real BERT layer, padded.
    let bert = bert_layer(3, DType::F32)?;
    let x = randn(&[2, 6, 384])?;
    let fast = bert.forward(&x, Some(&padding))?;
    let slow = bert.forward_with_weights(&x, Some(&padding))?;
    assert_close(&fast.context, &slow.context, 1e-6, "bert padded")?;
    // Single head, causal.
    let head = SingleHeadSelfAttention::new(
        random_linear(8, 12, true, "query")?,
        random_linear(8, 12, false, "key")?,
        random_linear(5, 12, true, "value")?,
    )?
    .with_causal(true);
    let x = randn(&[2, 6, 12])?;
    let fast = head.forward(&x, Some(&padding))?;
    let slow = head.forward_with_weights(&x, Some(&padding))?;
    assert!(fast.weights.is_none());
    assert_close(
        &fast.context,
        &slow.context,
        1e-6,
        "single head causal padded",
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 6. f16 / bf16 with fully masked rows: zeros, never NaN
// ---------------------------------------------------------------------------------------

#[test]
fn half_precision_fully_masked_rows_are_zero() -> anyhow::Result<()> {
    // keep (2, 1, 4, 6): query 1 of batch 0 and queries 0 and 3 of batch 1 see nothing.
    let keep: [[[u8; 6]; 4]; 2] = [
        [
            [1, 1, 0, 1, 0, 1],
            [0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 1],
        ],
        [
            [0, 0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
        ],
    ];
    let keep_t = Tensor::new(&keep, &Device::Cpu)?.reshape((2, 1, 4, 6))?;
    let mask = AttentionMask::keep(&keep_t)?;
    for dtype in [DType::F16, DType::BF16] {
        let q = randn(&[2, 3, 4, 8])?.to_dtype(dtype)?;
        let k = randn(&[2, 3, 6, 8])?.to_dtype(dtype)?;
        let v = randn(&[2, 3, 6, 5])?.to_dtype(dtype)?;
        for opts in [with_weights(), no_weights()] {
            let out = scaled_dot_product_attention(&q, &k, &v, Some(&mask), opts)?;
            assert_eq!(out.context.dtype(), dtype, "context keeps v's dtype");
            anyhow::ensure!(
                !has_non_finite(&out.context)?,
                "{dtype:?}: non-finite context"
            );
            let ctx: Vec<f32> = out.context.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            for b in 0..2 {
                for h in 0..3 {
                    for i in 0..4 {
                        let row = &ctx[((b * 3 + h) * 4 + i) * 5..][..5];
                        let hidden = keep[b][i].iter().all(|&x| x == 0);
                        if hidden {
                            assert!(
                                row.iter().all(|&x| x == 0.0),
                                "{dtype:?}: fully masked query (b {b}, h {h}, q {i}) has context {row:?}"
                            );
                        } else {
                            assert!(row.iter().any(|&x| x != 0.0), "{dtype:?}: zero context");
                        }
                    }
                }
            }
            if let Some(w) = &out.weights {
                anyhow::ensure!(!has_non_finite(w)?, "{dtype:?}: non-finite weights");
                Weights::of(w)?
                    .assert_follows(|b, _, i, j| keep[b][i][j] != 0, &format!("{dtype:?} keep"));
            }
        }
        // Left padding with a causal mask: the first query of batch 1 only sees a padded key.
        let left = Tensor::new(&[[1u8, 1, 1, 1], [0, 1, 1, 1]], &Device::Cpu)?;
        let mask = AttentionMask::causal().and(AttentionMask::padding(&left)?);
        let q = randn(&[2, 2, 4, 8])?.to_dtype(dtype)?;
        let k = randn(&[2, 2, 4, 8])?.to_dtype(dtype)?;
        let v = randn(&[2, 2, 4, 8])?.to_dtype(dtype)?;
        let out = scaled_dot_product_attention(&q, &k, &v, Some(&mask), with_weights())?;
        anyhow::ensure!(
            !has_non_finite(&out.context)?,
            "{dtype:?}: non-finite context"
        );
        let first: Vec<f32> = out
            .context
            .i((1, .., 0))?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        assert!(first.iter().all(|&x| x == 0.0), "{dtype:?}: {first:?}");
        weights_of(&out)?.assert_follows(
            |b, _, i, j| j <= i && !(b == 1 && j == 0),
            &format!("{dtype:?} causal left padding"),
        );
    }
    Ok(())
}

#[test]
fn half_precision_bert_layer_with_padding_is_nan_free() -> anyhow::Result<()> {
    let x32 = randn(&[3, 8, 384])?;
    // A full sequence, a padded one, and one that is padding only (every row fully masked).
    let lengths = [8usize, 3, 0];
    let mask = AttentionMask::padding(&padding_mask(&lengths, 8)?)?;
    let reference = bert_layer(4, DType::F32)?.forward_with_weights(&x32, Some(&mask))?;
    for (dtype, tol) in [(DType::F16, 0.02f32), (DType::BF16, 0.2)] {
        let bert = bert_layer(4, dtype)?;
        assert_eq!(bert.dtype(), dtype);
        let x = x32.to_dtype(dtype)?;
        let out = bert.forward_with_weights(&x, Some(&mask))?;
        assert_eq!(out.context.dtype(), dtype);
        anyhow::ensure!(
            !has_non_finite(&out.context)?,
            "{dtype:?}: non-finite context"
        );
        let w = out.weights.as_ref().expect("weights");
        anyhow::ensure!(!has_non_finite(w)?, "{dtype:?}: non-finite weights");
        Weights::of(w)?.assert_follows(|b, _, _, j| j < lengths[b], &format!("{dtype:?} bert"));
        let fast = bert.forward(&x, Some(&mask))?;
        anyhow::ensure!(
            !has_non_finite(&fast.context)?,
            "{dtype:?}: non-finite fast context"
        );
        // Close to the f32 layer on the real rows (measured: f16 ~4e-3, bf16 ~3e-2).
        for (b, &n) in lengths.iter().enumerate() {
            if n > 0 {
                assert_close(
                    &out.context.i((b, 0..n))?,
                    &reference.context.i((b, 0..n))?,
                    tol,
                    &format!("{dtype:?} vs f32, sequence {b}"),
                )?;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 7. Grouped K/V heads equal explicitly repeated K/V heads
// ---------------------------------------------------------------------------------------

#[test]
fn gqa_equals_explicit_repetition() -> anyhow::Result<()> {
    let (q, k, v) = (
        randn(&[2, 6, 5, 4])?,
        randn(&[2, 2, 7, 4])?,
        randn(&[2, 2, 7, 3])?,
    );
    let (k6, v6) = (
        repeat_interleave_heads(&k, 3)?,
        repeat_interleave_heads(&v, 3)?,
    );
    assert_eq!(k6.dims(), &[2, 6, 7, 4]);
    // Query head h reads kv head h / 3.
    assert_close(&k6.i((.., 4))?, &k.i((.., 1))?, 0.0, "repeat_interleave")?;
    let keep = Tensor::new(
        &[[[1u8, 1, 0, 1, 0, 1, 1]], [[0u8, 1, 1, 1, 1, 0, 0]]],
        &Device::Cpu,
    )?
    .reshape((2, 1, 1, 7))?;
    let keep = AttentionMask::keep(&keep)?;
    let causal = AttentionMask::causal_with_offset(2);
    for mask in [None, Some(&keep), Some(&causal)] {
        let grouped = scaled_dot_product_attention(&q, &k, &v, mask, with_weights())?;
        let repeated = scaled_dot_product_attention(&q, &k6, &v6, mask, with_weights())?;
        let what = format!("mask {}", mask.is_some());
        assert_close(
            grouped.weights.as_ref().expect("weights"),
            repeated.weights.as_ref().expect("weights"),
            1e-6,
            &format!("{what} weights"),
        )?;
        assert_close(
            &grouped.context,
            &repeated.context,
            1e-6,
            &format!("{what} context"),
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 8. Causal attention does not look ahead
// ---------------------------------------------------------------------------------------

#[test]
fn causal_context_ignores_later_tokens() -> anyhow::Result<()> {
    let layer = random_gqa_layer(true)?;
    let head = SingleHeadSelfAttention::new(
        random_linear(8, 16, true, "query")?,
        random_linear(8, 16, true, "key")?,
        random_linear(6, 16, true, "value")?,
    )?
    .with_causal(true);
    let x = randn(&[2, 6, 16])?;
    let full = layer.forward_with_weights(&x, None)?;
    let full_single = head.forward(&x, None)?;
    for t in 0..6 {
        // Keep tokens 0..=t, replace the rest.
        let later = (randn(&[2, 5 - t, 16])? * 5.0)?;
        let x2 = if t == 5 {
            x.clone()
        } else {
            Tensor::cat(&[&x.i((.., 0..=t))?, &later], 1)?
        };
        let out = layer.forward_with_weights(&x2, None)?;
        assert_close(
            &out.context.i((.., 0..=t))?,
            &full.context.i((.., 0..=t))?,
            1e-5,
            &format!("multi-head context up to token {t}"),
        )?;
        assert_close(
            &out.weights.as_ref().expect("weights").i((.., .., 0..=t))?,
            &full.weights.as_ref().expect("weights").i((.., .., 0..=t))?,
            1e-6,
            &format!("multi-head weights up to token {t}"),
        )?;
        let out = head.forward(&x2, None)?;
        assert_close(
            &out.context.i((.., 0..=t))?,
            &full_single.context.i((.., 0..=t))?,
            1e-5,
            &format!("single-head context up to token {t}"),
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 9. Without a mask, permuting the sequence permutes the context
// ---------------------------------------------------------------------------------------

#[test]
fn unmasked_attention_is_permutation_equivariant() -> anyhow::Result<()> {
    let perm: [u32; 6] = [3, 0, 5, 1, 4, 2];
    let idx = Tensor::new(&perm, &Device::Cpu)?;
    let check = |layer: &MultiHeadSelfAttention, hidden: usize, what: &str| -> anyhow::Result<()> {
        let x = randn(&[2, 6, hidden])?;
        let out = layer.forward_with_weights(&x, None)?;
        let xp = x.index_select(&idx, 1)?;
        let outp = layer.forward_with_weights(&xp, None)?;
        assert_close(
            &outp.context,
            &out.context.index_select(&idx, 1)?,
            CONTEXT_TOL,
            &format!("{what} context"),
        )?;
        // Weights permute along both the query and the key axis.
        let w = out.weights.as_ref().expect("weights");
        let expected = w.index_select(&idx, 2)?.index_select(&idx, 3)?;
        assert_close(
            outp.weights.as_ref().expect("weights"),
            &expected,
            WEIGHTS_TOL,
            &format!("{what} weights"),
        )?;
        Ok(())
    };
    check(&random_gqa_layer(false)?, 16, "gqa")?;
    check(&bert_layer(5, DType::F32)?, 384, "bert layer 5")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 10. `candle_core::Module` equals `forward(x, None)`
// ---------------------------------------------------------------------------------------

#[test]
fn module_trait_equals_forward() -> anyhow::Result<()> {
    let bert = bert_layer(0, DType::F32)?;
    let x = randn(&[2, 5, 384])?;
    let via_trait = Module::forward(&bert, &x)?;
    let direct = bert.forward(&x, None)?.context;
    assert_close(&via_trait, &direct, 0.0, "multi-head Module::forward")?;
    // Through a `dyn Module`, as a model would hold it.
    let boxed: Box<dyn Module> = Box::new(random_gqa_layer(true)?);
    assert_eq!(boxed.forward(&randn(&[1, 3, 16])?)?.dims(), &[1, 3, 16]);

    let head = SingleHeadSelfAttention::new(
        random_linear(8, 12, true, "query")?,
        random_linear(8, 12, true, "key")?,
        random_linear(5, 12, true, "value")?,
    )?;
    let x = randn(&[2, 4, 12])?;
    assert_close(
        &Module::forward(&head, &x)?,
        &head.forward(&x, None)?.context,
        0.0,
        "single-head Module::forward",
    )?;
    // Errors travel through the trait as candle errors whose message is ours.
    let err = Module::forward(&head, &randn(&[2, 4, 13])?).expect_err("wrong hidden size");
    assert!(err.to_string().contains("hidden size 12"), "{err}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 11. Huge logits stay finite
// ---------------------------------------------------------------------------------------

#[test]
fn huge_logits_stay_finite_and_one_hot() -> anyhow::Result<()> {
    // Keys are the unit vectors e_0..e_4 (d_k 8); query i is 1e4 * sqrt(8) * e_target(i), so
    // with the default scale 1/sqrt(8) its logits are 1e4 for the target key and 0 elsewhere.
    let target = [3usize, 0, 4, 4, 1, 2];
    let mut kd = vec![0f32; 5 * 8];
    for j in 0..5 {
        kd[j * 8 + j] = 1.0;
    }
    let mut qd = vec![0f32; 6 * 8];
    for (i, &t) in target.iter().enumerate() {
        qd[i * 8 + t] = 1e4 * 8f32.sqrt();
    }
    let k = Tensor::from_vec(kd, (1, 1, 5, 8), &Device::Cpu)?;
    let q = Tensor::from_vec(qd, (1, 1, 6, 8), &Device::Cpu)?;
    let v = randn(&[1, 1, 5, 3])?;
    let out = scaled_dot_product_attention(&q, &k, &v, None, with_weights())?;
    let w = weights_of(&out)?;
    for (i, &t) in target.iter().enumerate() {
        for j in 0..5 {
            let expected = if j == t { 1.0 } else { 0.0 };
            assert_eq!(w.at(0, 0, i, j), expected, "query {i}, key {j}");
        }
    }
    // The context of a one-hot row is the target value row.
    let tgt = Tensor::new(&target.map(|t| t as u32), &Device::Cpu)?;
    assert_close(
        &out.context.i((0, 0))?,
        &v.i((0, 0))?.index_select(&tgt, 0)?,
        1e-6,
        "one-hot context",
    )?;

    // Random queries scaled up by 1e4: logits of order 1e4, every row still a distribution,
    // in f32 and in half precision, with and without a mask.
    let causal = AttentionMask::causal();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // f16 cannot store 1e4 * N(0, 1) reliably; 2e2 * 2e2 products reach the same range.
        let (qs, ks) = if dtype == DType::F32 {
            (1e4, 1.0)
        } else {
            (2e2, 2e2)
        };
        let q = (randn(&[2, 2, 5, 4])? * qs)?.to_dtype(dtype)?;
        let k = (randn(&[2, 2, 5, 4])? * ks)?.to_dtype(dtype)?;
        let v = randn(&[2, 2, 5, 3])?.to_dtype(dtype)?;
        for mask in [None, Some(&causal)] {
            let out = scaled_dot_product_attention(&q, &k, &v, mask, with_weights())?;
            let what = format!("{dtype:?} mask {}", mask.is_some());
            anyhow::ensure!(!has_non_finite(&out.context)?, "{what}: non-finite context");
            let w = weights_of(&out)?;
            anyhow::ensure!(
                w.data.iter().all(|x| x.is_finite()),
                "{what}: non-finite weights"
            );
            w.assert_rows_sum_to_one(&what);
            // Each row is (numerically) one-hot: its largest weight is ~1.
            let (nb, nh, nq, nk) = w.dims;
            let mut near_one = 0;
            for b in 0..nb {
                for h in 0..nh {
                    for i in 0..nq {
                        let max = (0..nk).map(|j| w.at(b, h, i, j)).fold(0f32, f32::max);
                        if max > 0.999 {
                            near_one += 1;
                        }
                    }
                }
            }
            // Ties within 1e-3 of 1e4-sized logits are possible but rare.
            assert!(
                near_one * 10 >= nb * nh * nq * 9,
                "{what}: only {near_one} one-hot rows"
            );
        }
    }

    // A module whose queries are scaled up: the context stays finite.
    let p = random_projections(16, 4, 4, 4, 4)?;
    let p = Projections {
        q: LinearWeights::new((p.q.weight * 1e4)?, None, "q"),
        ..p
    };
    let layer = MultiHeadSelfAttention::new(p, &AttentionConfig::new(WeightLayout::TorchMha, 4))?;
    let out = layer.forward_with_weights(&randn(&[2, 5, 16])?, None)?;
    anyhow::ensure!(!has_non_finite(&out.context)?, "module: non-finite context");
    weights_of(&out)?.assert_rows_sum_to_one("module with 1e4 queries");
    Ok(())
}
