//! The 8-bit form of an activation row `x` for the opt-in 8-bit GGUF products (llama.cpp's
//! `q8_0` blocks with an f32 scale): its quantizer and the sizes its kernels check.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::kernels::aligned::Lines;
use crate::kernels::quant::blocks::QuantType;

/// `x` in 32-value blocks of signed bytes: `x[32 i + j] ~ qs[32 i + j] * d[i]`, and
/// `dsum[i] = d[i] * sum_j qs[32 i + j]` (the offset and `m` terms' factor). `qs` on
/// 64-byte lines ([`Lines`]), as the kernels read them.
#[derive(Debug, Clone, Default)]
pub(crate) struct QuantizedX {
    pub(crate) qs: Lines,
    pub(crate) d: Vec<f32>,
    pub(crate) dsum: Vec<f32>,
    /// Per 4 values, `-32` times the sum of their bytes: Q6_K's offset term, where its
    /// integer sums start (its scales change every 16 values, finer than `dsum`); Q3_K's
    /// (shifted right by 3) and Q2_K's mins the same way.
    pub(crate) offsets: Vec<i32>,
}

impl QuantizedX {
    /// `x` (a whole number of 32-value blocks) quantized: per block `d = max|x| / 127`,
    /// `q = round(x / d)` (to nearest, ties to even), `d = 0` and `q = 0` for a block of
    /// zeros. `None` when `x` is no whole number of blocks.
    pub(crate) fn new(x: &[f32]) -> Option<Self> {
        if !x.len().is_multiple_of(32) {
            return None;
        }
        let n = x.len() / 32;
        let mut out = Self {
            qs: Lines::zeroed(x.len()),
            d: vec![0.0; n],
            dsum: vec![0.0; n],
            offsets: Vec::new(),
        };
        for (i, (xb, qb)) in x
            .chunks_exact(32)
            .zip(out.qs.chunks_exact_mut(32))
            .enumerate()
        {
            let (d, sum) = quantize_block(xb, qb);
            out.d[i] = d;
            out.dsum[i] = d * sum as f32;
        }
        out.offsets = out
            .qs
            .chunks_exact(4)
            .map(|q| -32 * q.iter().map(|&v| i32::from(v)).sum::<i32>())
            .collect();
        Some(out)
    }

    /// The values the blocks stand for (`qs * d`), for checks.
    #[cfg(test)]
    pub(crate) fn values(&self) -> Vec<f32> {
        self.qs
            .iter()
            .enumerate()
            .map(|(k, &q)| f32::from(q) * self.d[k / 32])
            .collect()
    }
}

/// A block of 32 values quantized: `d = max|x| / 127` (NaNs passed over), `q = round(x / d)`
/// (to nearest, ties to even; `0` where `d = 0`) into `q`; returns `(d, sum q)`. With AVX2
/// eight lanes at a time, the same values (`vcvtps2dq` rounds as the scalar loop does).
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if x.len() == 32 && q.len() == 32 && crate::kernels::simd::avx2_fma_f16c() {
        // SAFETY: AVX2 checked above; 32 values and 32 bytes.
        return unsafe { quantize_block_avx2(x.as_ptr(), q.as_mut_ptr()) };
    }
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let (d, id) = scales(amax);
    let mut sum = 0;
    for (q, v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        sum += i32::from(r);
        *q = r;
    }
    (d, sum)
}

/// `(d, 1 / d)` for a block whose largest magnitude is `amax` (`1 / d = 0` for `d = 0`).
pub(crate) fn scales(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// [`quantize_block`] on AVX2.
///
/// # Safety
/// AVX2; 32 values at `x`, 32 bytes at `q`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn quantize_block_avx2(x: *const f32, q: *mut i8) -> (f32, i32) {
    let v = [0, 1, 2, 3].map(|k| _mm256_loadu_ps(x.add(8 * k)));
    // `vmaxps` returns its second operand when the first is a NaN: NaNs passed over.
    let sign = _mm256_set1_ps(-0.0);
    let m = v.iter().fold(_mm256_setzero_ps(), |m, &v| {
        _mm256_max_ps(_mm256_andnot_ps(sign, v), m)
    });
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let (d, id) = scales(amax);
    let ids = _mm256_set1_ps(id);
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    // `vcvtps2dq` rounds by the MXCSR mode: to nearest, ties to even.
    let int = |k: usize| {
        let r = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], ids));
        _mm256_min_epi32(_mm256_max_epi32(r, lo), hi)
    };
    let [q0, q1, q2, q3] = [0, 1, 2, 3].map(int);
    // The packs work within 128-bit halves: bytes come out as groups of 4 from q0..q3,
    // first halves then second; the permute puts them back in order.
    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q as *mut __m256i, bytes);
    let s = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    (
        d,
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s))),
    )
}

/// A row's bytes when `rows` (whole rows of `ty`), the `r` quantized rows `xs` (one
/// length, whole blocks) and `out` (row stride `ldo`, `r` values a weight row) fit together
/// for an 8-bit `rows_dots`; `None` otherwise.
pub(crate) fn rows_dots_shape(
    ty: QuantType,
    rows: &[u8],
    xs: &[QuantizedX],
    r: usize,
    out: &[f32],
    ldo: usize,
) -> Option<usize> {
    let inp = xs.first()?.qs.len();
    let row_bytes = ty.bytes_of(inp).filter(|&rb| rb > 0)?;
    let n = rows.len() / row_bytes;
    let fits = xs.len() == r
        && xs
            .iter()
            .all(|x| x.qs.len() == inp && x.d.len() * 32 == inp && x.offsets.len() * 4 == inp)
        && rows.len() == n * row_bytes
        && ldo >= r
        && (n == 0 || out.len() >= (n - 1) * ldo + r);
    fits.then_some(row_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x_quantizes_within_half_a_step() {
        let mut x = crate::kernels::test_values(96, 5);
        x[32..64].fill(0.0);
        let q = QuantizedX::new(&x).expect("whole blocks");
        assert_eq!(q.d[1], 0.0);
        for (k, (a, b)) in q.values().iter().zip(&x).enumerate() {
            assert!((a - b).abs() <= q.d[k / 32] * 0.5 + 1e-7, "{k}: {a} vs {b}");
        }
        let sums: Vec<f32> =
            q.qs.chunks(32)
                .zip(&q.d)
                .map(|(b, d)| d * b.iter().map(|&v| f32::from(v)).sum::<f32>())
                .collect();
        assert_eq!(sums, q.dsum);
        assert!(QuantizedX::new(&x[..40]).is_none());
    }

    /// The block quantizer on this CPU (AVX2 where it has it) gives the scalar loop's bytes,
    /// scale and sum: random blocks, ties (`d = 1`: `2.5` to 2, `-3.5` to -4), zeros, and a
    /// NaN, which the largest magnitude passes over.
    #[test]
    fn blocks_quantize_as_the_scalar_loop_does() {
        let mut blocks: Vec<Vec<f32>> = (0..8)
            .map(|s| crate::kernels::test_values(32, 40 + s))
            .collect();
        let mut ties: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
        ties[0] = 127.0;
        ties[1] = 2.5;
        ties[2] = -3.5;
        blocks.push(ties);
        blocks.push(vec![0.0; 32]);
        let mut nan = crate::kernels::test_values(32, 77);
        nan[5] = f32::NAN;
        blocks.push(nan);
        for x in &blocks {
            let mut got = [0i8; 32];
            let (d, sum) = quantize_block(x, &mut got);
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let (want_d, id) = scales(amax);
            let want: Vec<i8> = x
                .iter()
                .map(|v| (v * id).round_ties_even().clamp(-127.0, 127.0) as i8)
                .collect();
            assert_eq!(d.to_bits(), want_d.to_bits());
            if x.iter().all(|v| !v.is_nan()) {
                assert_eq!(got.to_vec(), want, "{x:?}");
                assert_eq!(sum, want.iter().map(|&q| i32::from(q)).sum::<i32>());
            }
        }
        let mut q = [0i8; 32];
        quantize_block(&blocks[8], &mut q);
        assert_eq!(&q[..3], &[127, 2, -4]);
    }
}
