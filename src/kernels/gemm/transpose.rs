//! The scaled transposed copy that packs rows into the panels of the micro-kernels (the
//! attention's keys into its `K^T` panels, a weight's dequantized rows into its packed
//! panels): eight rows at a time become eight columns of the panel, in `8 x 8` blocks held in
//! AVX registers where the CPU has AVX (eight loads, 24 shuffles and eight stores per 64
//! floats, instead of one scalar load and store per float).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use crate::error::{Error, Result};

/// Columns written per row of `dst` by [`transpose_scaled`].
pub(crate) const COLUMNS: usize = 8;

/// `dst[c * ld + t] = scale * rows[t][c]` for `t < 8` and `c < depth`; the columns `t >=
/// rows.len()` are 0. Every other element of `dst` is left as it is.
///
/// # Shapes
/// - `rows`: at most 8 slices of at least `depth` floats
/// - `dst`: at least `(depth - 1) * ld + 8` floats, `ld >= 8`
pub(crate) fn transpose_scaled(
    rows: &[&[f32]],
    depth: usize,
    scale: f32,
    dst: &mut [MaybeUninit<f32>],
    ld: usize,
) -> Result<()> {
    if depth == 0 {
        return Ok(());
    }
    if rows.len() > COLUMNS
        || rows.iter().any(|r| r.len() < depth)
        || ld < COLUMNS
        || dst.len() < (depth - 1) * ld + COLUMNS
    {
        return Err(Error::Kernel(format!(
            "transposed copy of {} rows of depth {depth} into {} floats at stride {ld}",
            rows.len(),
            dst.len()
        )));
    }
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::simd::avx() {
        // SAFETY: the CPU has AVX; the sizes were checked above.
        unsafe { transpose_scaled_avx(rows, depth, scale, dst.as_mut_ptr().cast(), ld) };
        return Ok(());
    }
    transpose_scaled_scalar(rows, 0, depth, scale, dst, ld);
    Ok(())
}

/// Features `from..depth` of [`transpose_scaled`], one float at a time (sizes checked by the
/// caller).
fn transpose_scaled_scalar(
    rows: &[&[f32]],
    from: usize,
    depth: usize,
    scale: f32,
    dst: &mut [MaybeUninit<f32>],
    ld: usize,
) {
    for c in from..depth {
        for (t, d) in dst[c * ld..c * ld + COLUMNS].iter_mut().enumerate() {
            d.write(rows.get(t).map_or(0.0, |r| r[c] * scale));
        }
    }
}

/// [`transpose_scaled`] in `8 x 8` blocks, the features past the last multiple of 8 one at a
/// time.
///
/// # Safety
/// The CPU has AVX; `rows` are at most 8 slices of at least `depth` floats; `dst` addresses
/// `(depth - 1) * ld + 8` writable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_scaled_avx(
    rows: &[&[f32]],
    depth: usize,
    scale: f32,
    dst: *mut f32,
    ld: usize,
) {
    let s = _mm256_set1_ps(scale);
    let mut c = 0;
    while c + 8 <= depth {
        let mut r = [_mm256_setzero_ps(); 8];
        for (v, row) in r.iter_mut().zip(rows) {
            *v = _mm256_mul_ps(_mm256_loadu_ps(row.as_ptr().add(c)), s);
        }
        // Pairs of rows interleaved, then quadruples, then the 128-bit halves swapped: row i
        // of the result is column c + i of the block.
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let out = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (i, v) in out.iter().enumerate() {
            _mm256_storeu_ps(dst.add((c + i) * ld), *v);
        }
        c += 8;
    }
    if c < depth {
        let len = (depth - 1) * ld + COLUMNS;
        // SAFETY: the caller's contract: `dst` addresses `len` writable floats.
        let tail = std::slice::from_raw_parts_mut(dst.cast::<MaybeUninit<f32>>(), len);
        transpose_scaled_scalar(rows, c, depth, scale, tail, ld);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposed_copy_equals_the_definition_in_every_version() -> Result<()> {
        let data: Vec<f32> = (0..8 * 40).map(|i| i as f32 * 0.25 - 7.0).collect();
        // Depths below, at and past multiples of 8; fewer rows than 8 (zero columns).
        for depth in [1, 7, 8, 9, 16, 37, 40] {
            for live in [0, 1, 5, 8] {
                let rows: Vec<&[f32]> = (0..live).map(|t| &data[t * 40..t * 40 + 40]).collect();
                let ld = 13;
                // The dispatched version (AVX here when the CPU has it) and the scalar one.
                let mut dst = vec![MaybeUninit::new(f32::NAN); (depth - 1) * ld + 8 + 3];
                transpose_scaled(&rows, depth, -1.5, &mut dst, ld)?;
                let mut scalar = vec![MaybeUninit::new(f32::NAN); dst.len()];
                transpose_scaled_scalar(&rows, 0, depth, -1.5, &mut scalar, ld);
                for (i, d) in dst.iter().chain(&scalar).enumerate() {
                    let i = i % dst.len();
                    // SAFETY: every element was initialised above.
                    let got = unsafe { d.assume_init() };
                    let (c, t) = (i / ld, i % ld);
                    if c < depth && t < 8 {
                        let want = if t < live {
                            data[t * 40 + c] * -1.5
                        } else {
                            0.0
                        };
                        assert_eq!(got, want, "depth {depth}, rows {live}: ({c}, {t})");
                    } else {
                        assert!(got.is_nan(), "depth {depth}: element {i} written");
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn transposed_copy_refuses_short_buffers() {
        let row: &[f32] = &[1f32; 8];
        let mut dst = vec![MaybeUninit::new(0f32); 7 * 8 + 7];
        assert!(transpose_scaled(&[row], 8, 1.0, &mut dst, 8).is_err());
        assert!(transpose_scaled(&[&row[..7]], 8, 1.0, &mut dst, 8).is_err());
        assert!(transpose_scaled(&[row; 9], 1, 1.0, &mut dst, 8).is_err());
        assert!(transpose_scaled(&[row], 1, 1.0, &mut dst, 7).is_err());
    }
}
