//! Attention on the CPU: the tiled online-softmax kernel ([`tiled`], memory linear in the
//! sequence, no weights), row blocks that write or stream the weights ([`rows`]), the
//! products of one tile ([`tile_products`]), the problem's description ([`problem`]) and its
//! mask as applied per tile ([`mask_plan`]), and the whole fused self-attention layer
//! ([`fused_layer`]); [`on_tensors`] runs them on candle tensors and storages.

pub(crate) mod fused_layer;
pub(crate) mod mask_plan;
pub(crate) mod on_tensors;
pub(crate) mod problem;
pub(crate) mod rows;
pub(crate) mod tile_products;
pub(crate) mod tiled;

pub use rows::WeightsBlock;

use super::gemm::microkernel;
use crate::error::Result;
use crate::memory;
use problem::{OutOperand, Problem};
use tile_products::Packing;

/// Above this many keys the attention kernels pack K and V for the AVX-512 micro-kernels on
/// CPUs other than AMD's (an Intel Xeon; on AMD Zen 4, see [`pack_min_keys_avx512`]).
const PACK_MIN_KEYS_AVX512: usize = 512;
/// Above this many keys the attention kernels pack K and V for the AVX2 + FMA micro-kernels.
const PACK_MIN_KEYS_AVX2: usize = 256;

/// What to do with the attention weights.
pub(crate) enum WeightsMode<'f> {
    /// Context only: the tiled kernel, nothing of size `(seq_q, seq_k)` is allocated.
    Skip,
    /// Return the weights as a `(batch, heads, seq_q, seq_k)` buffer.
    Return,
    /// Hand the weights block by block to the callback.
    Stream(&'f mut dyn FnMut(WeightsBlock<'_>) -> Result<()>),
}

/// Keys above which the AVX-512 kernels pack K and V up front. On AMD Zen 4 that beat the
/// `gemm` crate at every count past the per-task panels' (attention alone, 9 heads of 64
/// grouped by 3 causal: 0.79x its time at 80 keys, 0.78x at 128, 0.81x at 200 and 300,
/// 0.84x at 512; 12 heads of 64: 0.91-0.95x at 128-384); on an Intel Xeon, with the K
/// panels of that time, the `gemm` crate was 10-15% faster up to 512 keys.
fn pack_min_keys_avx512() -> usize {
    if super::simd::amd() {
        tile_products::PER_TASK_MAX_KEYS
    } else {
        PACK_MIN_KEYS_AVX512
    }
}

/// Runs `p` writing the context into `out`; returns the weights in [`WeightsMode::Return`].
/// The products use the micro-kernels (AVX-512 or AVX2 + FMA) where the CPU has them: on K
/// and V packed up front when the keys are many, packed by each task when they are few
/// ([`Packing::for_keys`]).
pub(crate) fn run(
    p: &Problem<'_>,
    out: &OutOperand<'_>,
    mode: WeightsMode<'_>,
) -> Result<Option<Vec<f32>>> {
    // Packing K and V up front into micro-kernel panels costs a pass over them per call; it
    // pays when the packed keys are reused by many query rows. On AVX-512 see
    // [`pack_min_keys_avx512`] (Intel Xeon: the panels ~12% faster at seq_k 4096). On AVX2
    // + FMA (AMD Zen 3, attention alone, 12 heads of 64, builds alternating, median of the
    // per-round time ratios) the up-front panels took 1.56x the gemm crate's time at seq
    // 32, 1.11x at 128, 1.01x at 256, 0.95x at 384 and at 512 (0.92x with the weights
    // returned). Few keys instead go to panels each task packs for itself (32-key K panels,
    // 8 x 8 transposes), which beat the gemm crate up to 64 keys
    // ([`tile_products::PER_TASK_MAX_KEYS`]).
    let min_keys = if microkernel::avx512() {
        pack_min_keys_avx512()
    } else {
        PACK_MIN_KEYS_AVX2
    };
    let packing = Packing::for_keys(p.seq_k, min_keys);
    match mode {
        WeightsMode::Skip => {
            tiled::attention_tiled(p, out, packing)?;
            Ok(None)
        }
        WeightsMode::Return => {
            let bytes = memory::attention_weights_bytes(p.batch, p.heads, p.seq_q, p.seq_k);
            memory::ensure_allocatable("the attention weights", bytes)?;
            let n = p.batch * p.heads * p.seq_q * p.seq_k;
            let mut w: Vec<f32> = Vec::with_capacity(n);
            rows::attention_with_weights(p, out, &mut w.spare_capacity_mut()[..n], packing)?;
            // SAFETY: `attention_with_weights` initialised all `n` elements (it returned Ok).
            unsafe { w.set_len(n) };
            Ok(Some(w))
        }
        WeightsMode::Stream(f) => {
            rows::attention_streamed(p, out, packing, f)?;
            Ok(None)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Every product implementation (micro-kernels on panels packed up front or per task,
    //! and the `gemm` crate), through the tiled, weights and streaming kernels, against
    //! attention computed in f64.
    use super::*;
    use crate::kernels::attend::problem::{KernelMask, Operand};
    use crate::kernels::gemm::matrix::SharedOut;

    /// Deterministic pseudo-random values in `[-1, 1)` (xorshift), for the kernels' tests.
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    struct Case {
        b: usize,
        h: usize,
        kvh: usize,
        sq: usize,
        sk: usize,
        dk: usize,
        dv: usize,
        causal: Option<usize>,
        /// Kept keys per batch row (a contiguous range).
        ranges: Option<Vec<(usize, usize)>>,
    }

    /// (context, weights) in f64 from the definition.
    fn reference(c: &Case, q: &[f32], k: &[f32], v: &[f32], scale: f64) -> (Vec<f64>, Vec<f64>) {
        let mut ctx = vec![0f64; c.b * c.h * c.sq * c.dv];
        let mut w = vec![0f64; c.b * c.h * c.sq * c.sk];
        for b in 0..c.b {
            for h in 0..c.h {
                let kvh = h / (c.h / c.kvh);
                for i in 0..c.sq {
                    let visible = |j: usize| {
                        c.causal.is_none_or(|off| j <= off + i)
                            && c.ranges.as_ref().is_none_or(|r| j >= r[b].0 && j < r[b].1)
                    };
                    let s: Vec<f64> = (0..c.sk)
                        .map(|j| {
                            let qi = ((b * c.h + h) * c.sq + i) * c.dk;
                            let kj = ((b * c.kvh + kvh) * c.sk + j) * c.dk;
                            (0..c.dk)
                                .map(|t| q[qi + t] as f64 * k[kj + t] as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = (0..c.sk)
                        .filter(|&j| visible(j))
                        .map(|j| s[j])
                        .fold(f64::NEG_INFINITY, f64::max);
                    if m == f64::NEG_INFINITY {
                        continue;
                    }
                    let e: Vec<f64> = (0..c.sk)
                        .map(|j| if visible(j) { (s[j] - m).exp() } else { 0.0 })
                        .collect();
                    let sum: f64 = e.iter().sum();
                    let row = ((b * c.h + h) * c.sq + i) * c.sk;
                    for j in 0..c.sk {
                        w[row + j] = e[j] / sum;
                    }
                    for d in 0..c.dv {
                        ctx[((b * c.h + h) * c.sq + i) * c.dv + d] = (0..c.sk)
                            .map(|j| {
                                w[row + j] * v[((b * c.kvh + kvh) * c.sk + j) * c.dv + d] as f64
                            })
                            .sum();
                    }
                }
            }
        }
        (ctx, w)
    }

    fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= tol, "{what}[{i}]: {g} vs {w}");
        }
    }

    /// The tiled, weights and streaming kernels with every product implementation against
    /// the f64 reference, on the given inputs.
    fn check(c: &Case, q: &[f32], k: &[f32], v: &[f32], what: &str) -> Result<()> {
        let scale = 1.0 / (c.dk as f64).sqrt();
        let (want_ctx, want_w) = reference(c, q, k, v, scale);
        let op = |data, s, h, d| Operand {
            data,
            offset: 0,
            sb: h * s * d,
            sh: s * d,
            sr: d,
        };
        let p = Problem {
            batch: c.b,
            heads: c.h,
            kv_heads: c.kvh,
            seq_q: c.sq,
            seq_k: c.sk,
            dk: c.dk,
            dv: c.dv,
            q: op(q, c.sq, c.h, c.dk),
            k: op(k, c.sk, c.kvh, c.dk),
            v: op(v, c.sk, c.kvh, c.dv),
            scale: scale as f32,
            mask: KernelMask {
                causal_offset: c.causal,
                key_range: c.ranges.as_deref(),
                ..KernelMask::default()
            },
        };
        let packings: &[Packing] = if microkernel::available() {
            &[Packing::None, Packing::PerTask, Packing::Upfront]
        } else {
            &[Packing::None]
        };
        for &packed in packings {
            let what = format!("{what}, {packed:?}");
            let mut ctx = vec![f32::NAN; c.b * c.h * c.sq * c.dv];
            fn out_of<'a>(ctx: &'a mut [f32], c: &Case) -> OutOperand<'a> {
                OutOperand {
                    buf: SharedOut::new(ctx),
                    offset: 0,
                    sb: c.h * c.sq * c.dv,
                    sh: c.sq * c.dv,
                    sr: c.dv,
                    lse: None,
                }
            }
            tiled::attention_tiled(&p, &out_of(&mut ctx, c), packed)?;
            close(&format!("{what}: tiled context"), &ctx, &want_ctx, 2e-5);
            let mut w = vec![f32::NAN; want_w.len()];
            ctx.fill(f32::NAN);
            let wu = w.as_mut_slice();
            // SAFETY: f32 -> MaybeUninit<f32> is always sound (same layout).
            let wu = unsafe { &mut *(wu as *mut [f32] as *mut [std::mem::MaybeUninit<f32>]) };
            rows::attention_with_weights(&p, &out_of(&mut ctx, c), wu, packed)?;
            close(&format!("{what}: weights"), &w, &want_w, 1e-6);
            close(
                &format!("{what}: context with weights"),
                &ctx,
                &want_ctx,
                2e-5,
            );
            let mut streamed = vec![f32::NAN; want_w.len()];
            ctx.fill(f32::NAN);
            rows::attention_streamed(&p, &out_of(&mut ctx, c), packed, &mut |blk| {
                let at = ((blk.batch * c.h + blk.head) * c.sq + blk.query_start) * c.sk;
                streamed[at..at + blk.weights.len()].copy_from_slice(blk.weights);
                Ok(())
            })?;
            assert_eq!(streamed, w, "{what}: streamed weights");
            close(&format!("{what}: streamed context"), &ctx, &want_ctx, 2e-5);
        }
        Ok(())
    }

    #[test]
    fn every_product_in_every_kernel_equals_the_definition() -> Result<()> {
        let cases = [
            Case {
                b: 2,
                h: 4,
                kvh: 2,
                sq: 9,
                sk: 13,
                dk: 8,
                dv: 20,
                causal: None,
                ranges: None,
            },
            Case {
                b: 1,
                h: 2,
                kvh: 1,
                sq: 70,
                sk: 600,
                dk: 24,
                dv: 64,
                causal: Some(530),
                ranges: None,
            },
            Case {
                b: 2,
                h: 2,
                kvh: 2,
                sq: 530,
                sk: 530,
                dk: 16,
                dv: 72,
                causal: Some(0),
                ranges: Some(vec![(3, 500), (0, 0)]),
            },
            Case {
                b: 1,
                h: 1,
                kvh: 1,
                sq: 33,
                sk: 700,
                dk: 5,
                dv: 3,
                causal: None,
                ranges: Some(vec![(50, 651)]),
            },
        ];
        for (n, c) in cases.iter().enumerate() {
            let q = values(c.b * c.h * c.sq * c.dk, 1 + n as u64);
            let k = values(c.b * c.kvh * c.sk * c.dk, 2 + n as u64);
            let v = values(c.b * c.kvh * c.sk * c.dv, 3 + n as u64);
            check(c, &q, &k, &v, &format!("case {n}"))?;
        }
        Ok(())
    }

    #[test]
    fn rows_that_outgrow_their_reference_or_span_past_the_flush_point() -> Result<()> {
        // Every query has a large first feature. Key 300 (second key tile) scores about 240
        // base-2 units below the others (past the one-pass range of the AVX2 exponential),
        // key 700 (third tile) about 80 above the rest (far past the lazy headroom): the
        // tiled kernel must recompute those rows' scores and rescale their accumulators.
        let c = Case {
            b: 1,
            h: 2,
            kvh: 1,
            sq: 40,
            sk: 1100,
            dk: 8,
            dv: 16,
            causal: None,
            ranges: None,
        };
        let mut q = values(c.b * c.h * c.sq * c.dk, 11);
        let mut k = values(c.b * c.kvh * c.sk * c.dk, 12);
        let v = values(c.b * c.kvh * c.sk * c.dv, 13);
        for row in q.chunks_mut(c.dk) {
            row[0] = 4.0;
        }
        k[300 * c.dk] = -120.0;
        k[700 * c.dk] = 40.0;
        check(&c, &q, &k, &v, "outgrown rows")?;
        // Only the low key, and only the high one.
        k[700 * c.dk] = 0.5;
        check(&c, &q, &k, &v, "one very low key")?;
        k[300 * c.dk] = 0.5;
        k[1000 * c.dk] = 40.0;
        check(&c, &q, &k, &v, "one very high key in the last tile")
    }
}
