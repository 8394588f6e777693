//! Property tests (proptest) over random shapes, dtypes, head groupings and masks.
//! The number of cases is bounded (`PROPTEST_CASES` overrides it) so CI stays fast.

use candle_attention::{scaled_dot_product_attention, AttentionMask, SdpaOptions};
use candle_core::{DType, Device, IndexOp, Tensor};
use proptest::prelude::*;

/// Deterministic pseudo-random values from a seed (candle's own RNG is not seedable).
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn tensor(seed: u64, shape: &[usize], scale: f32, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(values(seed, n, scale), shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("tensor")
}

#[derive(Debug, Clone)]
struct Case {
    b: usize,
    kv: usize,
    group: usize,
    sq: usize,
    sk: usize,
    dk: usize,
    dv: usize,
    dtype: DType,
    seed: u64,
    /// 0 none, 1 causal, 2 padding, 3 keep, 4 causal+padding, 5 causal with offset
    mask_kind: u8,
    logit_scale: f32,
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        (1usize..3, 1usize..3, 1usize..4, 1usize..9, 1usize..11),
        (1usize..9, 1usize..7, dtype_strategy(), any::<u64>(), 0u8..6),
        prop_oneof![Just(1.0f32), Just(10.0), Just(100.0)],
    )
        .prop_map(
            |((b, kv, group, sq, sk), (dk, dv, dtype, seed, mask_kind), logit_scale)| Case {
                b,
                kv,
                group,
                sq,
                sk,
                dk,
                dv,
                dtype,
                seed,
                mask_kind,
                logit_scale,
            },
        )
}

impl Case {
    fn heads(&self) -> usize {
        self.kv * self.group
    }

    fn qkv(&self) -> (Tensor, Tensor, Tensor) {
        let h = self.heads();
        (
            tensor(
                self.seed,
                &[self.b, h, self.sq, self.dk],
                self.logit_scale,
                self.dtype,
            ),
            tensor(
                self.seed ^ 1,
                &[self.b, self.kv, self.sk, self.dk],
                self.logit_scale,
                self.dtype,
            ),
            tensor(
                self.seed ^ 2,
                &[self.b, self.kv, self.sk, self.dv],
                1.0,
                self.dtype,
            ),
        )
    }

    /// The mask and the `(batch, 1|heads, seq_q, seq_k)` keep matrix it stands for.
    fn mask(&self) -> (Option<AttentionMask>, Vec<Vec<Vec<bool>>>) {
        let (b, sq, sk) = (self.b, self.sq, self.sk);
        let bits = values(self.seed ^ 3, b * sq * sk, 1.0);
        // Row lengths for padding: at least 0 real keys (fully masked rows happen).
        let lens: Vec<usize> = (0..b)
            .map(|i| (bits[i].abs() * (sk + 1) as f32) as usize % (sk + 1))
            .collect();
        let offset = sk.saturating_sub(sq);
        let keep = |bi: usize, i: usize, j: usize| -> bool {
            let causal = j <= i;
            let causal_off = j <= i + offset;
            let pad = j < lens[bi];
            match self.mask_kind {
                0 => true,
                1 => causal,
                2 => pad,
                3 => bits[(bi * sq + i) * sk + j] > -0.3,
                4 => causal && pad,
                _ => causal_off,
            }
        };
        let matrix = (0..b)
            .map(|bi| {
                (0..sq)
                    .map(|i| (0..sk).map(|j| keep(bi, i, j)).collect())
                    .collect()
            })
            .collect();
        let pad_tensor = || {
            let v: Vec<u8> = (0..b)
                .flat_map(|bi| (0..sk).map(|j| u8::from(j < lens[bi])).collect::<Vec<_>>())
                .collect();
            Tensor::from_vec(v, (b, sk), &Device::Cpu).expect("pad")
        };
        let mask = match self.mask_kind {
            0 => None,
            1 => Some(AttentionMask::causal()),
            2 => Some(AttentionMask::padding(&pad_tensor()).expect("padding")),
            3 => {
                let v: Vec<u8> = bits.iter().map(|&x| u8::from(x > -0.3)).collect();
                let t = Tensor::from_vec(v, (b, 1, sq, sk), &Device::Cpu).expect("keep");
                Some(AttentionMask::keep(&t).expect("keep"))
            }
            4 => Some(
                AttentionMask::causal()
                    .and(AttentionMask::padding(&pad_tensor()).expect("padding")),
            ),
            _ => Some(AttentionMask::causal_with_offset(offset)),
        };
        (mask, matrix)
    }
}

fn to_f32_vec4(t: &Tensor) -> Vec<Vec<Vec<Vec<f32>>>> {
    let t = t.to_dtype(DType::F32).expect("f32");
    let (b, _, _, _) = t.dims4().expect("rank 4");
    (0..b)
        .map(|i| t.i(i).and_then(|x| x.to_vec3::<f32>()).expect("vec3"))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Rows sum to 1 or are all zero when fully masked; masked weights are exactly 0;
    /// no NaN or inf anywhere; fully masked rows have a zero context; the path without
    /// weights gives the same context.
    #[test]
    fn weights_are_a_masked_distribution(case in case_strategy()) {
        let (q, k, v) = case.qkv();
        let (mask, keep) = case.mask();
        let out = scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), SdpaOptions::with_weights())
            .expect("sdpa");
        let w = to_f32_vec4(out.weights.as_ref().expect("weights"));
        let ctx = to_f32_vec4(&out.context);
        for (bi, heads) in w.iter().enumerate() {
            for (h, rows) in heads.iter().enumerate() {
                for (i, row) in rows.iter().enumerate() {
                    let visible = keep[bi][i].iter().any(|&x| x);
                    let sum: f32 = row.iter().sum();
                    for (j, &x) in row.iter().enumerate() {
                        prop_assert!(x.is_finite(), "non-finite weight");
                        if !keep[bi][i][j] {
                            prop_assert_eq!(x, 0.0, "masked weight at b{} h{} i{} j{}", bi, h, i, j);
                        }
                    }
                    if visible {
                        prop_assert!((sum - 1.0).abs() < 1e-4, "row sums to {}", sum);
                    } else {
                        prop_assert_eq!(sum, 0.0);
                        prop_assert!(ctx[bi][h][i].iter().all(|&c| c == 0.0), "fully masked row has a non-zero context");
                    }
                    prop_assert!(ctx[bi][h][i].iter().all(|c| c.is_finite()), "non-finite context");
                }
            }
        }
        let fast = scaled_dot_product_attention(
            &q, &k, &v, mask.as_ref(), SdpaOptions { scale: None, need_weights: false },
        ).expect("sdpa fast");
        let tol = if case.dtype == DType::F32 { 1e-5 } else { 2e-2 };
        let diff = (fast.context.to_dtype(DType::F32).expect("f32") - out.context.to_dtype(DType::F32).expect("f32"))
            .and_then(|d| d.abs()).and_then(|d| d.flatten_all()).and_then(|d| d.max(0))
            .and_then(|d| d.to_scalar::<f32>()).expect("diff");
        prop_assert!(diff <= tol, "fast path differs by {}", diff);
    }

    /// Permuting the keys/values (no mask) leaves the context unchanged; permuting the
    /// queries permutes the context rows.
    #[test]
    fn permutation_equivariance(case in case_strategy()) {
        let case = Case { dtype: DType::F32, mask_kind: 0, ..case };
        let (q, k, v) = case.qkv();
        let base = scaled_dot_product_attention(&q, &k, &v, None, SdpaOptions::default()).expect("sdpa");
        // Reverse the keys and values, and the queries.
        let rev = |t: &Tensor, len: usize| -> Tensor {
            let idx = Tensor::from_vec((0..len as u32).rev().collect::<Vec<_>>(), len, &Device::Cpu).expect("idx");
            t.index_select(&idx, 2).expect("index_select")
        };
        let out = scaled_dot_product_attention(&rev(&q, case.sq), &rev(&k, case.sk), &rev(&v, case.sk), None, SdpaOptions::default())
            .expect("sdpa");
        let back = rev(&out.context, case.sq);
        let diff = (back - &base.context).and_then(|d| d.abs()).and_then(|d| d.flatten_all())
            .and_then(|d| d.max(0)).and_then(|d| d.to_scalar::<f32>()).expect("diff");
        prop_assert!(diff < 1e-5, "not equivariant: {}", diff);
    }

    /// With a causal mask, the output for token t does not depend on later tokens.
    #[test]
    fn causal_output_ignores_later_tokens(case in case_strategy(), t in 0usize..8) {
        let case = Case { dtype: DType::F32, sk: case.sq, mask_kind: 1, ..case };
        let t = t % case.sq;
        let (q, k, v) = case.qkv();
        let mask = AttentionMask::causal();
        let base = scaled_dot_product_attention(&q, &k, &v, Some(&mask), SdpaOptions::default()).expect("sdpa");
        // Replace everything after position t with other values.
        let other = Case { seed: case.seed.wrapping_add(7), ..case.clone() };
        let (q2, k2, v2) = other.qkv();
        let splice = |a: &Tensor, b: &Tensor, len: usize| -> Tensor {
            if t + 1 == len {
                return a.clone();
            }
            Tensor::cat(&[a.narrow(2, 0, t + 1).expect("narrow"), b.narrow(2, t + 1, len - t - 1).expect("narrow")], 2)
                .expect("cat")
        };
        let out = scaled_dot_product_attention(
            &splice(&q, &q2, case.sq), &splice(&k, &k2, case.sk), &splice(&v, &v2, case.sk), Some(&mask), SdpaOptions::default(),
        ).expect("sdpa");
        let a = base.context.narrow(2, 0, t + 1).expect("narrow");
        let b = out.context.narrow(2, 0, t + 1).expect("narrow");
        let diff = (a - b).and_then(|d| d.abs()).and_then(|d| d.flatten_all()).and_then(|d| d.max(0))
            .and_then(|d| d.to_scalar::<f32>()).expect("diff");
        prop_assert_eq!(diff, 0.0);
    }
}

#[test]
fn logits_of_magnitude_1e4_stay_finite() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let case = Case {
            b: 2,
            kv: 2,
            group: 2,
            sq: 5,
            sk: 7,
            dk: 4,
            dv: 3,
            dtype,
            seed: 42,
            mask_kind: 4,
            logit_scale: 100.0, // q.k up to 4e4 before scaling: |logits| ~ 1e4
        };
        let (q, k, v) = case.qkv();
        let (mask, _) = case.mask();
        let out =
            scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), SdpaOptions::with_weights())
                .expect("sdpa");
        let w: Vec<f32> = out
            .weights
            .expect("w")
            .flatten_all()
            .and_then(|t| t.to_vec1())
            .expect("vec");
        let c: Vec<f32> = out
            .context
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .expect("vec");
        assert!(w.iter().chain(&c).all(|x| x.is_finite()), "{dtype:?}");
    }
}
