//! AVX2 + FMA micro-kernels for CPUs without AVX-512 (AMD Zen 2/3, Intel client cores):
//! the same `c (=|+=) a @ panel` on the same packed panels as [`crate::kernels::gemm::microkernel`].
//!
//! AVX2 has 16 vector registers of 8 floats, so a panel is computed in column strips: a
//! 48-column panel (projections, K^T) as two strips of 24 with a `4 x 24` full tile (every
//! panel load feeds 4 multiply-adds, every broadcast 3), a 64-column panel (V) as four
//! strips of 16 with a `6 x 16` full tile (the BLIS Haswell/Zen tile: every panel load feeds
//! 6, every broadcast 2), a 32-column panel (per-task K^T) as two strips of 16. Both tiles
//! hold 12 accumulators, enough to cover the multiply-add latency on two pipes; `4 x 24`
//! measured faster than `6 x 16` on the 48-column panels (docs/performance-archive.md). The
//! depth is split in equal blocks of at most [`KC`] so that a block of the
//! panel stays in L1 while the row groups go by. Edge columns (a narrower last panel) use
//! masked loads and stores of `c` and the bias; the panel is read in whole registers, up to
//! the next multiple of 8 past `width` (its zero padding).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use crate::kernels::gemm::depth_blocks::depth_blocks;
use crate::kernels::gemm::depth_blocks::Start;

/// Most depth of one pass over a panel (96 x 64 floats = 24 KiB, within a 32 KiB L1);
/// [`depth_blocks`] splits a longer depth in equal blocks (240 as 3 x 80).
/// 96 measured fastest of 96-384 at sentence and long-input shapes
/// (docs/performance-archive.md).
#[cfg(target_arch = "x86_64")]
const KC: usize = 96;

/// Whether this CPU runs these kernels: AVX2 and FMA, not capped to scalar code
/// (`CANDLE_ATTENTION_ISA`, [`crate::kernels::simd::isa`]).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::simd::{isa, Isa};
        // `isa()` is AVX2 or wider only with AVX2 and FMA.
        matches!(isa(), Isa::Avx512 | Isa::Avx2)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `c[0..m, 0..width] (=|+=) a[0..m, 0..k] @ b[0..k, 0..width]` for a panel `b` of `W`
/// columns (`W` a multiple of 16, `width <= W`).
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
    #[cfg(target_arch = "x86_64")]
    {
        if m == 0 || width == 0 {
            return;
        }
        depth_blocks(k, KC, start, |k0, kc, start| {
            block::<W>(m, kc, a.add(k0), lda, b.add(k0 * W), width, c, ldc, start)
        });
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (m, k, a, lda, b, width, c, ldc, start);
    }
}

/// Registers per column strip: 3 (24 columns) for 48-column panels, whose full tile is
/// then `4 x 24`; 2 (16 columns) otherwise, full tile `6 x 16`. Both hold 12 accumulators.
#[cfg(target_arch = "x86_64")]
const fn strip_regs(w: usize) -> usize {
    if w.is_multiple_of(24) {
        3
    } else {
        2
    }
}

/// One depth block: every row group against every strip of the panel.
///
/// # Safety
/// AVX2 and FMA; `a` addresses `m` rows of `kc` readable floats (row stride `lda`), `b` `kc *
/// W` readable floats, `c` `m` rows of `width` floats (row stride `ldc`) writable, and readable
/// when `start` accumulates; `c` overlaps neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn block<const W: usize>(
    m: usize,
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    width: usize,
    c: *mut f32,
    ldc: usize,
    start: Start,
) {
    let regs = strip_regs(W);
    let (mr, nr) = (if regs == 3 { 4 } else { 6 }, 8 * regs);
    let mut r = 0;
    while r < m {
        let rows = mr.min(m - r);
        let (ar, cr) = (a.add(r * lda), c.add(r * ldc));
        let mut col = 0;
        while col < width {
            let cols = nr.min(width - col);
            let st = match start {
                Start::Bias(p) => Start::Bias(p.add(col)),
                s => s,
            };
            tile::<W>(rows, cols, kc, ar, lda, b.add(col), cr.add(col), ldc, st);
            col += cols;
        }
        r += rows;
    }
}

/// A tile of `rows` (1..=6) x `cols` (1..=24) with the kernel of matching size.
///
/// # Safety
/// AVX2 and FMA; `a` addresses `rows` rows of `kc` readable floats (row stride `lda`), `b` `kc
/// * W` readable floats, `c` `rows` rows of `cols` floats (row stride `ldc`) writable, and
/// readable when `start` accumulates; `c` overlaps neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const W: usize>(
    rows: usize,
    cols: usize,
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    st: Start,
) {
    let regs = cols.div_ceil(8);
    let last = cols - (regs - 1) * 8;
    macro_rules! by_rows {
        ($c:literal) => {
            match rows {
                6 => kernel::<6, $c, W>(kc, a, lda, b, c, ldc, st, last),
                5 => kernel::<5, $c, W>(kc, a, lda, b, c, ldc, st, last),
                4 => kernel::<4, $c, W>(kc, a, lda, b, c, ldc, st, last),
                3 => kernel::<3, $c, W>(kc, a, lda, b, c, ldc, st, last),
                2 => kernel::<2, $c, W>(kc, a, lda, b, c, ldc, st, last),
                _ => kernel::<1, $c, W>(kc, a, lda, b, c, ldc, st, last),
            }
        };
    }
    match (regs, last, rows) {
        (3, 8, 4) => kernel_4x24::<W>(kc, a, lda, b, c, ldc, st),
        (2, 8, 6) => kernel_6x16::<W>(kc, a, lda, b, c, ldc, st),
        (3, ..) => by_rows!(3),
        (2, ..) => by_rows!(2),
        _ => by_rows!(1),
    }
}

/// The accumulators of an `R x C`-register tile from `start`; the last register holds
/// `last` (1..=8) columns (masked loads when fewer than 8).
///
/// # Safety
/// AVX2 and FMA; `c` addresses `R` rows (row stride `ldc`) of `8 (C - 1) + last` readable
/// floats when `start` accumulates.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_tile<const R: usize, const C: usize>(
    c: *const f32,
    ldc: usize,
    start: Start,
    last: usize,
) -> [[__m256; C]; R] {
    let mask = lanes(last);
    let load = |p: *const f32, j: usize| load_part(p, j == C - 1 && last < 8, mask);
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    match start {
        Start::Zero => {}
        Start::Bias(bias) => {
            for j in 0..C {
                let bv = load(bias.add(8 * j), j);
                for row in acc.iter_mut() {
                    row[j] = bv;
                }
            }
        }
        Start::Accumulate => {
            for (r, row) in acc.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = load(c.add(r * ldc + 8 * j), j);
                }
            }
        }
    }
    acc
}

/// Stores an `R x C`-register tile; the last register holds `last` (1..=8) columns.
///
/// # Safety
/// AVX2 and FMA; `c` addresses `R` rows (row stride `ldc`) of `8 (C - 1) + last` writable
/// floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_tile<const R: usize, const C: usize>(
    acc: &[[__m256; C]; R],
    c: *mut f32,
    ldc: usize,
    last: usize,
) {
    let mask = lanes(last);
    for (r, row) in acc.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            let p = c.add(r * ldc + 8 * j);
            if j == C - 1 && last < 8 {
                _mm256_maskstore_ps(p, mask, *v);
            } else {
                _mm256_storeu_ps(p, *v);
            }
        }
    }
}

/// The full `4 x 24` tile: the inner loop in assembly (compilers fold the panel loads into
/// every multiply-add as memory operands, which makes the loop bound on loads).
///
/// # Safety
/// AVX2 and FMA; `a` addresses 4 rows of `kc` readable floats (row stride `lda`), `b` `kc * W`
/// readable floats (the panel), `c` the tile's rows (row stride `ldc`) writable, and readable
/// when `start` accumulates, for the tile's columns (`last` in its last register); `c` overlaps
/// neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_4x24<const W: usize>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    start: Start,
) {
    let acc = load_tile::<4, 3>(c, ldc, start, 8);
    if kc == 0 {
        store_tile::<4, 3>(&acc, c, ldc, 8);
        return;
    }
    #[rustfmt::skip]
    let [[mut c00, mut c01, mut c02], [mut c10, mut c11, mut c12], [mut c20, mut c21, mut c22], [mut c30, mut c31, mut c32]] = acc;
    std::arch::asm!(
        "2:",
        "vmovups ymm12, [{b}]",
        "vmovups ymm13, [{b} + 32]",
        "vmovups ymm14, [{b} + 64]",
        "vbroadcastss ymm15, dword ptr [{a}]",
        "vfmadd231ps ymm0, ymm15, ymm12",
        "vfmadd231ps ymm1, ymm15, ymm13",
        "vfmadd231ps ymm2, ymm15, ymm14",
        "vbroadcastss ymm15, dword ptr [{a} + {lda}]",
        "vfmadd231ps ymm3, ymm15, ymm12",
        "vfmadd231ps ymm4, ymm15, ymm13",
        "vfmadd231ps ymm5, ymm15, ymm14",
        "vbroadcastss ymm15, dword ptr [{a} + {lda}*2]",
        "vfmadd231ps ymm6, ymm15, ymm12",
        "vfmadd231ps ymm7, ymm15, ymm13",
        "vfmadd231ps ymm8, ymm15, ymm14",
        "vbroadcastss ymm15, dword ptr [{a3}]",
        "vfmadd231ps ymm9, ymm15, ymm12",
        "vfmadd231ps ymm10, ymm15, ymm13",
        "vfmadd231ps ymm11, ymm15, ymm14",
        "add {a}, 4",
        "add {a3}, 4",
        "add {b}, {ldb}",
        "dec {k}",
        "jnz 2b",
        a = inout(reg) a => _,
        a3 = inout(reg) a.add(3 * lda) => _,
        b = inout(reg) b => _,
        k = inout(reg) kc => _,
        lda = in(reg) lda * 4,
        ldb = in(reg) W * 4,
        inout("ymm0") c00, inout("ymm1") c01, inout("ymm2") c02,
        inout("ymm3") c10, inout("ymm4") c11, inout("ymm5") c12,
        inout("ymm6") c20, inout("ymm7") c21, inout("ymm8") c22,
        inout("ymm9") c30, inout("ymm10") c31, inout("ymm11") c32,
        out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
        options(nostack, readonly),
    );
    #[rustfmt::skip]
    let acc = [[c00, c01, c02], [c10, c11, c12], [c20, c21, c22], [c30, c31, c32]];
    store_tile::<4, 3>(&acc, c, ldc, 8);
}

/// The full `6 x 16` tile, the inner loop in assembly (see [`kernel_4x24`]).
///
/// # Safety
/// AVX2 and FMA; `a` addresses 6 rows of `kc` readable floats (row stride `lda`), `b` `kc * W`
/// readable floats (the panel), `c` the tile's rows (row stride `ldc`) writable, and readable
/// when `start` accumulates, for the tile's columns (`last` in its last register); `c` overlaps
/// neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_6x16<const W: usize>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    start: Start,
) {
    let acc = load_tile::<6, 2>(c, ldc, start, 8);
    if kc == 0 {
        store_tile::<6, 2>(&acc, c, ldc, 8);
        return;
    }
    #[rustfmt::skip]
    let [[mut c00, mut c01], [mut c10, mut c11], [mut c20, mut c21], [mut c30, mut c31], [mut c40, mut c41], [mut c50, mut c51]] = acc;
    std::arch::asm!(
        "2:",
        "vmovups ymm12, [{b}]",
        "vmovups ymm13, [{b} + 32]",
        "vbroadcastss ymm14, dword ptr [{a}]",
        "vfmadd231ps ymm0, ymm14, ymm12",
        "vfmadd231ps ymm1, ymm14, ymm13",
        "vbroadcastss ymm15, dword ptr [{a} + {lda}]",
        "vfmadd231ps ymm2, ymm15, ymm12",
        "vfmadd231ps ymm3, ymm15, ymm13",
        "vbroadcastss ymm14, dword ptr [{a} + {lda}*2]",
        "vfmadd231ps ymm4, ymm14, ymm12",
        "vfmadd231ps ymm5, ymm14, ymm13",
        "vbroadcastss ymm15, dword ptr [{a3}]",
        "vfmadd231ps ymm6, ymm15, ymm12",
        "vfmadd231ps ymm7, ymm15, ymm13",
        "vbroadcastss ymm14, dword ptr [{a3} + {lda}]",
        "vfmadd231ps ymm8, ymm14, ymm12",
        "vfmadd231ps ymm9, ymm14, ymm13",
        "vbroadcastss ymm15, dword ptr [{a3} + {lda}*2]",
        "vfmadd231ps ymm10, ymm15, ymm12",
        "vfmadd231ps ymm11, ymm15, ymm13",
        "add {a}, 4",
        "add {a3}, 4",
        "add {b}, {ldb}",
        "dec {k}",
        "jnz 2b",
        a = inout(reg) a => _,
        a3 = inout(reg) a.add(3 * lda) => _,
        b = inout(reg) b => _,
        k = inout(reg) kc => _,
        lda = in(reg) lda * 4,
        ldb = in(reg) W * 4,
        inout("ymm0") c00, inout("ymm1") c01,
        inout("ymm2") c10, inout("ymm3") c11,
        inout("ymm4") c20, inout("ymm5") c21,
        inout("ymm6") c30, inout("ymm7") c31,
        inout("ymm8") c40, inout("ymm9") c41,
        inout("ymm10") c50, inout("ymm11") c51,
        out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
        options(nostack, readonly),
    );
    #[rustfmt::skip]
    let acc = [[c00, c01], [c10, c11], [c20, c21], [c30, c31], [c40, c41], [c50, c51]];
    store_tile::<6, 2>(&acc, c, ldc, 8);
}

/// Lane mask of the first `n` (1..=8) lanes.
///
/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn lanes(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// 8 floats at `p`, or only the lanes of `mask` when `masked` (the others read as 0).
///
/// # Safety
/// AVX2 and FMA; `p` points at 8 readable floats, or at the lanes of `mask` when `masked`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_part(p: *const f32, masked: bool, mask: __m256i) -> __m256 {
    if masked {
        _mm256_maskload_ps(p, mask)
    } else {
        _mm256_loadu_ps(p)
    }
}

/// An `R x C`-register tile (`C` = 1 or 2 registers of 8 columns; the last one holds
/// `last` columns).
///
/// # Safety
/// AVX2 and FMA; `a` addresses the tile's rows of `kc` readable floats (row stride `lda`), `b`
/// `kc * W` readable floats (the panel), `c` the tile's rows (row stride `ldc`) writable, and
/// readable when `start` accumulates, for the tile's columns (`last` in its last register); `c`
/// overlaps neither `a` nor `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<const R: usize, const C: usize, const W: usize>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    start: Start,
    last: usize,
) {
    let mut acc = load_tile::<R, C>(c, ldc, start, last);
    let mut ap = a;
    let mut bp = b;
    for _ in 0..kc {
        let mut bv = [_mm256_setzero_ps(); C];
        for (j, v) in bv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(bp.add(8 * j));
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let av = _mm256_broadcast_ss(&*ap.add(r * lda));
            for (j, v) in row.iter_mut().enumerate() {
                *v = _mm256_fmadd_ps(av, bv[j], *v);
            }
        }
        ap = ap.add(1);
        bp = bp.add(W);
    }
    store_tile::<R, C>(&acc, c, ldc, last);
}
