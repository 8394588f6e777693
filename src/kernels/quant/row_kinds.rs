//! The block types the GGUF row kernels take (exact and 8-bit, every instruction set), and
//! the const parameters their loops are compiled for: one loop per type.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use crate::kernels::quant::blocks::QuantType;

/// The block types the SIMD row kernels take, exact (AVX-512, AVX2) and 8-bit (AVX-512
/// VNNI): those of real files' matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants
/// Q2_K-Q6_K).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const ROW_KERNEL_TYPES: [QuantType; 10] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q2K,
    QuantType::Q3K,
    QuantType::Q4K,
    QuantType::Q5K,
    QuantType::Q6K,
];

/// The 32-value block types as const parameters of the row kernels (one loop compiled per
/// type).
#[cfg(target_arch = "x86_64")]
pub(crate) mod kind {
    use crate::kernels::quant::blocks::QuantType;

    pub(crate) const Q8_0: u8 = 0;
    pub(crate) const Q4_0: u8 = 1;
    pub(crate) const Q4_1: u8 = 2;
    pub(crate) const Q5_0: u8 = 3;
    pub(crate) const Q5_1: u8 = 4;

    /// The type of kind `k`.
    pub(crate) fn quant_type(k: u8) -> QuantType {
        match k {
            Q8_0 => QuantType::Q8_0,
            Q4_0 => QuantType::Q4_0,
            Q4_1 => QuantType::Q4_1,
            Q5_0 => QuantType::Q5_0,
            _ => QuantType::Q5_1,
        }
    }
}

/// `(inputs a row of x, bytes a weight row)` when `rows` (whole rows of `ty`), `xs` (`r` rows
/// of `x`) and `out` (row stride `ldo`, `r` values a weight row) fit together for the row
/// kernels' `rows_dots`; `None` otherwise.
pub(crate) fn rows_dots_shape(
    ty: QuantType,
    rows: &[u8],
    xs: &[f32],
    r: usize,
    out: &[f32],
    ldo: usize,
) -> Option<(usize, usize)> {
    let inp = xs.len() / r.max(1);
    let row_bytes = ty.bytes_of(inp).filter(|&rb| rb > 0)?;
    let n = rows.len() / row_bytes;
    let fits = r > 0
        && xs.len() == r * inp
        && rows.len() == n * row_bytes
        && ldo >= r
        && (n == 0 || out.len() >= (n - 1) * ldo + r);
    fits.then_some((inp, row_bytes))
}

/// The K-quant kernels' `Q5` parameter: Q4_K (four bits) or Q5_K (five) rows.
pub(crate) const FOUR_BITS: bool = false;
pub(crate) const FIVE_BITS: bool = true;

/// The K-quant kernels' `Q3` parameter: Q2_K (two bits) or Q3_K (three) rows.
pub(crate) const TWO_BITS: bool = false;
pub(crate) const THREE_BITS: bool = true;
