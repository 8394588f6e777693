//! Panel micro-kernels: `c (=|+=) a @ panel` for one panel of a packed right-hand side, in
//! AVX-512 here and in AVX2 + FMA in [`crate::kernels::gemm::microkernel_avx2`] (picked at run time).
//!
//! A panel is `(k, W)` row-major with `W` = 32, 48 or 64 columns (2, 3 or 4 registers), zero
//! padded past its last column up to a multiple of 16 at least (the kernels read no further).
//! The full tiles are `8 x 48` and `6 x 64` (24 accumulator registers each, so every weight
//! load feeds 8 or 6 multiply-adds); the edges (fewer rows, a narrower last panel) use
//! smaller tiles in intrinsics. The depth is split in equal blocks of up to 512: a block of
//! a panel stays in L2 while the row groups go by, and each block loads and stores the
//! accumulators once.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use crate::kernels::gemm::depth_blocks::depth_blocks;
pub(crate) use crate::kernels::gemm::depth_blocks::Start;

use crate::kernels::gemm::microkernel_avx2;

/// Most depth of one pass over a panel, in equal blocks (512 x 48 or 64 floats = 96 or 128
/// KiB of panel, held in L2 while the row groups go by; the 8 x 48 kernel prefetches it into
/// L1 a few steps ahead).
///
/// 512 measured the fastest with that prefetch (docs/performance-archive.md).
#[cfg(target_arch = "x86_64")]
const KC: usize = 512;

/// Whether this CPU runs these kernels: AVX-512F, not capped below it
/// (`CANDLE_ATTENTION_ISA`, [`crate::kernels::simd::isa`]).
pub(crate) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::simd::{isa, Isa};
        matches!(isa(), Isa::Avx512)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU runs a panel micro-kernel: the AVX-512 ones here, or the AVX2 + FMA
/// ones of [`crate::kernels::gemm::microkernel_avx2`] on the same panels.
pub(crate) fn available() -> bool {
    avx512() || microkernel_avx2::available()
}

/// `c[0..m, 0..width] (=|+=) a[0..m, 0..k] @ b[0..k, 0..width]` for a panel `b` of `W`
/// columns (`W` = 32, 48 or 64, `width <= W`).
///
/// # Safety
/// [`available`] is true; `a` addresses `m` rows of `k` readable floats (row stride `lda`),
/// `b` `k * W` readable floats, `c` `m` rows of `width` writable floats (row stride `ldc`,
/// initialised when `start` is `Accumulate`), a `Bias` pointer `width` readable floats;
/// `c` overlaps neither `a` nor `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn panel_product<const W: usize>(
    m: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    width: usize,
    c: *mut f32,
    ldc: usize,
    start: Start,
) {
    if !avx512() {
        // SAFETY: `available()` holds without AVX-512 only when AVX2 + FMA are there; the
        // caller's guarantees are the same.
        return microkernel_avx2::panel_product::<W>(m, k, a, lda, b, width, c, ldc, start);
    }
    #[cfg(target_arch = "x86_64")]
    {
        if m == 0 || width == 0 {
            return;
        }
        let vecs = width.div_ceil(16);
        let rem = width - (vecs - 1) * 16;
        let mask: u16 = if rem == 16 { 0xffff } else { (1u16 << rem) - 1 };
        depth_blocks(k, KC, start, |k0, kc, start| {
            let (ak, bk) = (a.add(k0), b.add(k0 * W));
            match vecs {
                4 => rows::<4, W>(m, kc, ak, lda, bk, c, ldc, start, mask),
                3 => rows::<3, W>(m, kc, ak, lda, bk, c, ldc, start, mask),
                2 => rows::<2, W>(m, kc, ak, lda, bk, c, ldc, start, mask),
                _ => rows::<1, W>(m, kc, ak, lda, bk, c, ldc, start, mask),
            }
        });
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (m, k, a, lda, b, width, c, ldc, start);
    }
}

/// # Safety
/// As [`gemm`]: AVX-512F; `a` addresses `m` rows of `kc` readable floats (row stride `lda`),
/// `b` `kc * W` readable floats, `c` `m` rows (row stride `ldc`) writable, and readable when
/// `start` accumulates, for the columns `mask` keeps; `c` overlaps neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn rows<const C: usize, const W: usize>(
    m: usize,
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    start: Start,
    mask: u16,
) {
    let full = if W == 48 { 8 } else { 6 };
    let mut r = 0;
    while r + full <= m {
        let (ar, cr) = (a.add(r * lda), c.add(r * ldc));
        match (W, C) {
            (48, 3) => kernel_8x48(kc, ar, lda, b, cr, ldc, start, mask),
            (64, 4) => kernel_6x64(kc, ar, lda, b, cr, ldc, start, mask),
            (48, _) => kernel::<8, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
            _ => kernel::<6, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
        }
        r += full;
    }
    let (ar, cr) = (a.add(r * lda), c.add(r * ldc));
    match m - r {
        0 => {}
        1 => kernel::<1, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
        2 => kernel::<2, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
        3 => kernel::<3, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
        4 => kernel::<4, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
        5 => kernel::<5, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
        6 => kernel::<6, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
        _ => kernel::<7, C, W>(kc, ar, lda, b, cr, ldc, start, mask),
    }
}

/// The accumulators of an `R x C`-register tile.
///
/// # Safety
/// AVX-512F; `c` addresses `R` rows (row stride `ldc`) of `16 C` readable floats (the last
/// register: the lanes `mask` keeps) when `start` accumulates.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_tile<const R: usize, const C: usize>(
    c: *const f32,
    ldc: usize,
    start: Start,
    mask: u16,
) -> [[__m512; C]; R] {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for j in 0..C {
        let m = if j == C - 1 { mask } else { 0xffff };
        match start {
            Start::Zero => {}
            Start::Bias(bias) => {
                let bv = _mm512_maskz_loadu_ps(m, bias.add(16 * j));
                for row in acc.iter_mut() {
                    row[j] = bv;
                }
            }
            Start::Accumulate => {
                for (r, row) in acc.iter_mut().enumerate() {
                    row[j] = _mm512_maskz_loadu_ps(m, c.add(r * ldc + 16 * j));
                }
            }
        }
    }
    acc
}

/// # Safety
/// AVX-512F; `c` addresses `R` rows (row stride `ldc`) of `16 C` writable floats (the last
/// register: the lanes `mask` keeps).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_tile<const R: usize, const C: usize>(
    acc: &[[__m512; C]; R],
    c: *mut f32,
    ldc: usize,
    mask: u16,
) {
    for (r, row) in acc.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            let m = if j == C - 1 { mask } else { 0xffff };
            _mm512_mask_storeu_ps(c.add(r * ldc + 16 * j), m, *v);
        }
    }
}

/// Any `R x C`-register tile (the edges), in intrinsics.
///
/// # Safety
/// AVX-512F; `a` addresses the tile's rows of `kc` readable floats (row stride `lda`), `b` `kc
/// * W` readable floats (the panel), `c` the tile's rows (row stride `ldc`) writable, and
/// readable when `start` accumulates, for the columns `mask` keeps in the last register; `c`
/// overlaps neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn kernel<const R: usize, const C: usize, const W: usize>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    start: Start,
    mask: u16,
) {
    let mut acc = load_tile::<R, C>(c, ldc, start, mask);
    for kk in 0..kc {
        let bp = b.add(kk * W);
        let mut bv = [_mm512_setzero_ps(); C];
        for (j, v) in bv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(bp.add(16 * j));
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a.add(r * lda + kk));
            for (j, v) in row.iter_mut().enumerate() {
                *v = _mm512_fmadd_ps(av, bv[j], *v);
            }
        }
    }
    store_tile::<R, C>(&acc, c, ldc, mask);
}

/// One depth step of the `8 x 48` tile as assembly text: the three weight vectors at bytes
/// `$b0`, `$b1`, `$b2` of `{b}` (64 apart), each row's value at byte `$a` of its row (rows 0-2
/// from `{a}`, 3-5 from `{a3}`, 6-7 from `{a6}`, `{lda}` bytes apart) broadcast once into
/// `zmm27..zmm31` and multiplied into `zmm0..zmm23`. The weights 8 steps ahead are prefetched
/// into L1 (the panel's depth block is larger than L1 and comes from L2 for every row group;
/// a prefetch never faults, past the panel's end too).
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! step_8x48 {
    ($a:literal, $b0:literal, $b1:literal, $b2:literal) => {
        concat!(
            "prefetcht0 [{b} + ", $b0, " + 1536]\n",
            "prefetcht0 [{b} + ", $b1, " + 1536]\n",
            "prefetcht0 [{b} + ", $b2, " + 1536]\n",
            "vmovups zmm24, [{b} + ", $b0, "]\n",
            "vmovups zmm25, [{b} + ", $b1, "]\n",
            "vmovups zmm26, [{b} + ", $b2, "]\n",
            "vbroadcastss zmm27, dword ptr [{a} + ", $a, "]\n",
            "vfmadd231ps zmm0, zmm27, zmm24\n", "vfmadd231ps zmm1, zmm27, zmm25\n", "vfmadd231ps zmm2, zmm27, zmm26\n",
            "vbroadcastss zmm28, dword ptr [{a} + {lda} + ", $a, "]\n",
            "vfmadd231ps zmm3, zmm28, zmm24\n", "vfmadd231ps zmm4, zmm28, zmm25\n", "vfmadd231ps zmm5, zmm28, zmm26\n",
            "vbroadcastss zmm29, dword ptr [{a} + {lda}*2 + ", $a, "]\n",
            "vfmadd231ps zmm6, zmm29, zmm24\n", "vfmadd231ps zmm7, zmm29, zmm25\n", "vfmadd231ps zmm8, zmm29, zmm26\n",
            "vbroadcastss zmm30, dword ptr [{a3} + ", $a, "]\n",
            "vfmadd231ps zmm9, zmm30, zmm24\n", "vfmadd231ps zmm10, zmm30, zmm25\n", "vfmadd231ps zmm11, zmm30, zmm26\n",
            "vbroadcastss zmm31, dword ptr [{a3} + {lda} + ", $a, "]\n",
            "vfmadd231ps zmm12, zmm31, zmm24\n", "vfmadd231ps zmm13, zmm31, zmm25\n", "vfmadd231ps zmm14, zmm31, zmm26\n",
            "vbroadcastss zmm27, dword ptr [{a3} + {lda}*2 + ", $a, "]\n",
            "vfmadd231ps zmm15, zmm27, zmm24\n", "vfmadd231ps zmm16, zmm27, zmm25\n", "vfmadd231ps zmm17, zmm27, zmm26\n",
            "vbroadcastss zmm28, dword ptr [{a6} + ", $a, "]\n",
            "vfmadd231ps zmm18, zmm28, zmm24\n", "vfmadd231ps zmm19, zmm28, zmm25\n", "vfmadd231ps zmm20, zmm28, zmm26\n",
            "vbroadcastss zmm29, dword ptr [{a6} + {lda} + ", $a, "]\n",
            "vfmadd231ps zmm21, zmm29, zmm24\n", "vfmadd231ps zmm22, zmm29, zmm25\n", "vfmadd231ps zmm23, zmm29, zmm26\n",
        )
    };
}

/// The full `8 x 48` tile: the inner loop in assembly, so that each row's value is
/// broadcast once into a register (compilers fold the broadcast into every multiply-add as a
/// memory operand, which makes the loop bound on loads instead of multiply-adds); two depth
/// steps per loop turn (half the pointer updates), an odd last step after the loop.
///
/// # Safety
/// AVX-512F; `a` addresses 8 rows of `kc` readable floats (row stride `lda`), `b` `kc * W`
/// readable floats (the panel), `c` the tile's rows (row stride `ldc`) writable, and readable
/// when `start` accumulates, for the columns `mask` keeps in the last register; `c` overlaps
/// neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn kernel_8x48(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    start: Start,
    mask: u16,
) {
    let acc = load_tile::<8, 3>(c, ldc, start, mask);
    #[rustfmt::skip]
    let [[mut c00, mut c01, mut c02], [mut c10, mut c11, mut c12], [mut c20, mut c21, mut c22], [mut c30, mut c31, mut c32], [mut c40, mut c41, mut c42], [mut c50, mut c51, mut c52], [mut c60, mut c61, mut c62], [mut c70, mut c71, mut c72]] = acc;
    std::arch::asm!(
        "test {pairs}, {pairs}",
        "jz 3f",
        "2:",
        step_8x48!("0", "0", "64", "128"),
        step_8x48!("4", "192", "256", "320"),
        "add {a}, 8",
        "add {a3}, 8",
        "add {a6}, 8",
        "add {b}, 384",
        "dec {pairs}",
        "jnz 2b",
        "3:",
        "test {odd}, {odd}",
        "jz 4f",
        step_8x48!("0", "0", "64", "128"),
        "4:",
        a = inout(reg) a => _,
        a3 = inout(reg) a.add(3 * lda) => _,
        a6 = inout(reg) a.add(6 * lda) => _,
        b = inout(reg) b => _,
        pairs = inout(reg) kc / 2 => _,
        odd = in(reg) kc % 2,
        lda = in(reg) lda * 4,
        inout("zmm0") c00, inout("zmm1") c01, inout("zmm2") c02,
        inout("zmm3") c10, inout("zmm4") c11, inout("zmm5") c12,
        inout("zmm6") c20, inout("zmm7") c21, inout("zmm8") c22,
        inout("zmm9") c30, inout("zmm10") c31, inout("zmm11") c32,
        inout("zmm12") c40, inout("zmm13") c41, inout("zmm14") c42,
        inout("zmm15") c50, inout("zmm16") c51, inout("zmm17") c52,
        inout("zmm18") c60, inout("zmm19") c61, inout("zmm20") c62,
        inout("zmm21") c70, inout("zmm22") c71, inout("zmm23") c72,
        out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _, out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
        options(nostack, readonly),
    );
    #[rustfmt::skip]
    let acc = [
        [c00, c01, c02],
        [c10, c11, c12],
        [c20, c21, c22],
        [c30, c31, c32],
        [c40, c41, c42],
        [c50, c51, c52],
        [c60, c61, c62],
        [c70, c71, c72],
    ];
    store_tile::<8, 3>(&acc, c, ldc, mask);
}

/// The full `6 x 64` tile: the inner loop in assembly, so that each row's value is
/// broadcast once into a register (compilers fold the broadcast into every multiply-add as a
/// memory operand, which makes the loop bound on loads instead of multiply-adds).
///
/// # Safety
/// AVX-512F; `a` addresses 6 rows of `kc` readable floats (row stride `lda`), `b` `kc * W`
/// readable floats (the panel), `c` the tile's rows (row stride `ldc`) writable, and readable
/// when `start` accumulates, for the columns `mask` keeps in the last register; `c` overlaps
/// neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn kernel_6x64(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    start: Start,
    mask: u16,
) {
    let acc = load_tile::<6, 4>(c, ldc, start, mask);
    if kc == 0 {
        store_tile::<6, 4>(&acc, c, ldc, mask);
        return;
    }
    #[rustfmt::skip]
    let [[mut c00, mut c01, mut c02, mut c03], [mut c10, mut c11, mut c12, mut c13], [mut c20, mut c21, mut c22, mut c23], [mut c30, mut c31, mut c32, mut c33], [mut c40, mut c41, mut c42, mut c43], [mut c50, mut c51, mut c52, mut c53]] = acc;
    std::arch::asm!(
        "2:",
        "vmovups zmm24, [{b}]",
        "vmovups zmm25, [{b} + 64]",
        "vmovups zmm26, [{b} + 128]",
        "vmovups zmm27, [{b} + 192]",
        "vbroadcastss zmm28, dword ptr [{a}]",
        "vfmadd231ps zmm0, zmm28, zmm24",
        "vfmadd231ps zmm1, zmm28, zmm25",
        "vfmadd231ps zmm2, zmm28, zmm26",
        "vfmadd231ps zmm3, zmm28, zmm27",
        "vbroadcastss zmm29, dword ptr [{a} + {lda}]",
        "vfmadd231ps zmm4, zmm29, zmm24",
        "vfmadd231ps zmm5, zmm29, zmm25",
        "vfmadd231ps zmm6, zmm29, zmm26",
        "vfmadd231ps zmm7, zmm29, zmm27",
        "vbroadcastss zmm30, dword ptr [{a} + {lda}*2]",
        "vfmadd231ps zmm8, zmm30, zmm24",
        "vfmadd231ps zmm9, zmm30, zmm25",
        "vfmadd231ps zmm10, zmm30, zmm26",
        "vfmadd231ps zmm11, zmm30, zmm27",
        "vbroadcastss zmm31, dword ptr [{a3}]",
        "vfmadd231ps zmm12, zmm31, zmm24",
        "vfmadd231ps zmm13, zmm31, zmm25",
        "vfmadd231ps zmm14, zmm31, zmm26",
        "vfmadd231ps zmm15, zmm31, zmm27",
        "vbroadcastss zmm28, dword ptr [{a3} + {lda}]",
        "vfmadd231ps zmm16, zmm28, zmm24",
        "vfmadd231ps zmm17, zmm28, zmm25",
        "vfmadd231ps zmm18, zmm28, zmm26",
        "vfmadd231ps zmm19, zmm28, zmm27",
        "vbroadcastss zmm29, dword ptr [{a3} + {lda}*2]",
        "vfmadd231ps zmm20, zmm29, zmm24",
        "vfmadd231ps zmm21, zmm29, zmm25",
        "vfmadd231ps zmm22, zmm29, zmm26",
        "vfmadd231ps zmm23, zmm29, zmm27",
        "add {a}, 4",
        "add {a3}, 4",
        "add {b}, 256",
        "dec {k}",
        "jnz 2b",
        a = inout(reg) a => _,
        a3 = inout(reg) a.add(3 * lda) => _,
        b = inout(reg) b => _,
        k = inout(reg) kc => _,
        lda = in(reg) lda * 4,
        inout("zmm0") c00, inout("zmm1") c01, inout("zmm2") c02, inout("zmm3") c03,
        inout("zmm4") c10, inout("zmm5") c11, inout("zmm6") c12, inout("zmm7") c13,
        inout("zmm8") c20, inout("zmm9") c21, inout("zmm10") c22, inout("zmm11") c23,
        inout("zmm12") c30, inout("zmm13") c31, inout("zmm14") c32, inout("zmm15") c33,
        inout("zmm16") c40, inout("zmm17") c41, inout("zmm18") c42, inout("zmm19") c43,
        inout("zmm20") c50, inout("zmm21") c51, inout("zmm22") c52, inout("zmm23") c53,
        out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _, out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
        options(nostack, readonly),
    );
    #[rustfmt::skip]
    let acc = [
        [c00, c01, c02, c03],
        [c10, c11, c12, c13],
        [c20, c21, c22, c23],
        [c30, c31, c32, c33],
        [c40, c41, c42, c43],
        [c50, c51, c52, c53],
    ];
    store_tile::<6, 4>(&acc, c, ldc, mask);
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_values as values;

    /// The micro-kernels follow the crate's instruction-set cap (CI runs the unit tests
    /// under `CANDLE_ATTENTION_ISA=avx2` and `scalar`): a laptop's path measured on a
    /// server must be that path.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn kernels_follow_the_isa_cap() {
        use crate::kernels::simd::{isa, Isa};
        assert_eq!(avx512(), matches!(isa(), Isa::Avx512));
        let avx2_or_wider = !matches!(isa(), Isa::Scalar);
        assert_eq!(super::super::microkernel_avx2::available(), avx2_or_wider);
        assert_eq!(available(), avx2_or_wider);
    }

    /// A `panel_product` implementation.
    type Product =
        unsafe fn(usize, usize, *const f32, usize, *const f32, usize, *mut f32, usize, Start);

    fn check<const W: usize>(product: Product, m: usize, k: usize, width: usize) {
        let a = values(m * k, 1);
        let b = values(k * W, 2);
        let bias = values(width, 3);
        let mut c = values(m * width, 4);
        let before = c.clone();
        for start in [Start::Zero, Start::Bias(bias.as_ptr()), Start::Accumulate] {
            let mut out = before.clone();
            // SAFETY: the buffers have the sizes the kernel reads and writes.
            unsafe {
                product(
                    m,
                    k,
                    a.as_ptr(),
                    k,
                    b.as_ptr(),
                    width,
                    out.as_mut_ptr(),
                    width,
                    start,
                )
            };
            for i in 0..m {
                for j in 0..width {
                    let init = match start {
                        Start::Zero => 0.0,
                        Start::Bias(_) => bias[j],
                        Start::Accumulate => before[i * width + j],
                    };
                    let e = init + (0..k).map(|t| a[i * k + t] * b[t * W + j]).sum::<f32>();
                    let got = out[i * width + j];
                    assert!(
                        (got - e).abs() < 1e-4,
                        "W {W} m {m} k {k} width {width} ({i}, {j}): {got} vs {e}"
                    );
                }
            }
        }
        c.clear();
    }

    /// Every tile size and edge (rows not a multiple of 8, 6 or 4; widths not a multiple
    /// of 24, 16 or 8; depths over several blocks) of the dispatching kernel and, where the
    /// CPU has AVX2 (also on AVX-512 machines, which dispatch elsewhere), the AVX2 kernels.
    #[test]
    fn panel_products_on_every_edge() {
        let mut products: Vec<[Product; 3]> = Vec::new();
        if available() {
            products.push([
                panel_product::<32>,
                panel_product::<48>,
                panel_product::<64>,
            ]);
        }
        if microkernel_avx2::available() {
            products.push([
                microkernel_avx2::panel_product::<32>,
                microkernel_avx2::panel_product::<48>,
                microkernel_avx2::panel_product::<64>,
            ]);
        }
        for [p32, p48, p64] in products {
            for (m, k) in [
                (1, 1),
                (7, 3),
                (8, 129),
                (13, 300),
                (6, 0),
                (25, 64),
                (4, 97),
                (9, 530),
                (10, 1031),
            ] {
                for width in [1, 8, 9, 16, 17, 24, 25, 40, 47, 48] {
                    check::<48>(p48, m, k, width);
                }
                for width in [5, 8, 16, 32, 41, 63, 64] {
                    check::<64>(p64, m, k, width);
                }
                for width in [1, 7, 16, 17, 31, 32] {
                    check::<32>(p32, m, k, width);
                }
            }
        }
    }
}
