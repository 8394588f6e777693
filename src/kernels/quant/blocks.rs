//! ggml's weight formats as stored in GGUF files: the block sizes of every type this crate
//! reads, and each block dequantized to f32 exactly as gguf-py's `dequantize` does (the
//! reference transformers loads GGUF files with): the same products and sums, each rounded
//! to f32 in the same order (`d * q + m` is a product then a sum, never a fused
//! multiply-add), so that a dequantized weight equals transformers' bit for bit.
//!
//! Blocks are read from little-endian bytes, so no alignment is needed; the field layouts
//! are ggml's (`ggml-common.h`): e.g. `block_q4_1 { f16 d; f16 m; u8 qs[16]; }`.

use half::{bf16, f16};

/// Values per super-block of the K-quants.
pub(crate) const QK_K: usize = 256;

/// A tensor type of a GGUF file (ggml's `ggml_type`), among those this crate reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 32 values: `d * (q - 8)`, 4-bit `q`.
    Q4_0,
    /// 32 values: `d * q + m`, 4-bit `q`.
    Q4_1,
    /// 32 values: `d * (q - 16)`, 5-bit `q`.
    Q5_0,
    /// 32 values: `d * q + m`, 5-bit `q`.
    Q5_1,
    /// 32 values: `d * q`, 8-bit `q`.
    Q8_0,
    /// 256 values in 16 groups, 2-bit `q`, 4-bit scales and mins.
    Q2K,
    /// 256 values in 16 groups, 3-bit `q`, 6-bit scales.
    Q3K,
    /// 256 values in 8 groups, 4-bit `q`, 6-bit scales and mins.
    Q4K,
    /// 256 values in 8 groups, 5-bit `q`, 6-bit scales and mins.
    Q5K,
    /// 256 values in 16 groups, 6-bit `q`, 8-bit scales.
    Q6K,
}

impl QuantType {
    /// Every type this crate reads.
    pub const ALL: [QuantType; 13] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
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

    /// The type of ggml's id (`ggml_type`), `None` for types this crate does not read.
    pub fn from_ggml_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// candle's name of this type (its quantized tensors hold the same bytes).
    pub fn candle_dtype(self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType as G;
        match self {
            Self::F32 => G::F32,
            Self::F16 => G::F16,
            Self::BF16 => G::BF16,
            Self::Q4_0 => G::Q4_0,
            Self::Q4_1 => G::Q4_1,
            Self::Q5_0 => G::Q5_0,
            Self::Q5_1 => G::Q5_1,
            Self::Q8_0 => G::Q8_0,
            Self::Q2K => G::Q2K,
            Self::Q3K => G::Q3K,
            Self::Q4K => G::Q4K,
            Self::Q5K => G::Q5K,
            Self::Q6K => G::Q6K,
        }
    }

    /// ggml's id.
    pub fn ggml_id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::BF16 => 30,
        }
    }

    /// ggml's name (`Q4_K`, `F16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }

    /// Values per block (1 for the float types).
    pub fn block_values(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Bytes of `values` values (a whole number of blocks), `None` when `values` is not a
    /// multiple of the block or the size overflows.
    pub fn bytes_of(self, values: usize) -> Option<usize> {
        if !values.is_multiple_of(self.block_values()) {
            return None;
        }
        (values / self.block_values()).checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes `bytes` (whole blocks of `ty`) into `out` (`out.len()` values); returns
/// `false`, writing nothing, when the sizes do not agree.
pub(crate) fn dequantize(ty: QuantType, bytes: &[u8], out: &mut [f32]) -> bool {
    if ty.bytes_of(out.len()) != Some(bytes.len()) {
        return false;
    }
    // One loop per type, so that each block's body is compiled (and vectorised) for it.
    fn each<const B: usize, const N: usize>(
        bytes: &[u8],
        out: &mut [f32],
        f: impl Fn(&[u8; B], &mut [f32; N]),
    ) {
        for (b, y) in bytes.chunks_exact(B).zip(out.chunks_exact_mut(N)) {
            // Always whole blocks (the sizes were checked); fixed-size for the compiler.
            if let (Ok(b), Ok(y)) = (<&[u8; B]>::try_from(b), <&mut [f32; N]>::try_from(y)) {
                f(b, y);
            }
        }
    }
    match ty {
        QuantType::F32 => {
            for (b, y) in bytes.chunks_exact(4).zip(out.iter_mut()) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QuantType::F16 => {
            for (b, y) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *y = half_at(b, 0);
            }
        }
        QuantType::BF16 => {
            for (b, y) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        QuantType::Q4_0 => each(bytes, out, q4_0),
        QuantType::Q4_1 => each(bytes, out, q4_1),
        QuantType::Q5_0 => each(bytes, out, q5_0),
        QuantType::Q5_1 => each(bytes, out, q5_1),
        QuantType::Q8_0 => each(bytes, out, q8_0),
        QuantType::Q2K => each(bytes, out, q2_k),
        QuantType::Q3K => each(bytes, out, q3_k),
        QuantType::Q4K => each(bytes, out, q4_k),
        QuantType::Q5K => each(bytes, out, q5_k),
        QuantType::Q6K => each(bytes, out, q6_k),
    }
    true
}

/// `{ f16 d; u8 qs[16] }`: low nibbles are values 0..16, high nibbles 16..32.
#[inline]
fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = half_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * ((q & 0x0F) as i32 - 8) as f32;
        y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

/// `{ f16 d; f16 m; u8 qs[16] }`.
#[inline]
fn q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = d * (q & 0x0F) as f32 + m;
        y[j + 16] = d * (q >> 4) as f32 + m;
    }
}

/// The fifth bits of `{ u8 qh[4] }`: bit `j` for value `j`.
fn high_bits(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// `{ f16 d; u8 qh[4]; u8 qs[16] }`.
#[inline]
fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = half_at(b, 0);
    let qh = high_bits(&b[2..6]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (((q & 0x0F) as u32 | h0) as i32 - 16) as f32;
        y[j + 16] = d * (((q >> 4) as u32 | h1) as i32 - 16) as f32;
    }
}

/// `{ f16 d; f16 m; u8 qh[4]; u8 qs[16] }`.
#[inline]
fn q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = high_bits(&b[4..8]);
    for (j, &q) in b[8..24].iter().enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * ((q & 0x0F) as u32 | h0) as f32 + m;
        y[j + 16] = d * ((q >> 4) as u32 | h1) as f32 + m;
    }
}

/// `{ f16 d; i8 qs[32] }`.
#[inline]
fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = half_at(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        y[j] = (q as i8) as f32 * d;
    }
}

/// `{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`: group `g` of 16 values has scale
/// `d * (scales[g] & 15)` and min `dmin * (scales[g] >> 4)`; value `i` of the 128-value half
/// `h` is bits `2 * (i / 32)` of `qs[32 * h + i % 32]`.
#[inline]
fn q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    for (g, yg) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * (scales[g] & 0x0F) as f32;
        let ml = dmin * (scales[g] >> 4) as f32;
        let (half, shift, first) = (g / 8, 2 * ((g % 8) / 2), 16 * (g % 2));
        for (i, v) in yg.iter_mut().enumerate() {
            let q = (qs[32 * half + first + i] >> shift) & 3;
            *v = dl * q as f32 - ml;
        }
    }
}

/// `{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`: 16 groups of 16 values, 6-bit
/// signed scales (`- 32`), values `q - 4` where the high-mask bit is clear.
#[inline]
fn q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = half_at(b, 108);
    for (g, yg) in y.chunks_exact_mut(16).enumerate() {
        let low = (sc[g % 8] >> (4 * (g / 8))) & 0x0F;
        let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 0x03;
        let scale = ((low | (high << 4)) as i8 - 32) as f32;
        let dl = d * scale;
        let (half, shift, first) = (g / 8, 2 * ((g % 8) / 2), 16 * (g % 2));
        let bit = (g / 2) as u32; // which bit of hmask: one per 32 values
        for (i, v) in yg.iter_mut().enumerate() {
            let l = first + i;
            let ql = ((qs[32 * half + l] >> shift) & 3) as i8;
            let hm = if (hmask[l] >> bit) & 1 == 1 { 0 } else { 4 };
            *v = dl * (ql - hm) as f32;
        }
    }
}

/// Scale and min of group `j` (0..8) of a Q4_K / Q5_K block's 12 scale bytes.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All 8 scales and all 8 mins of a Q4_K / Q5_K block's 12 scale bytes at once, byte `j`
/// of each for group `j` (as [`scale_min_k4`], with llama.cpp's masks over 32-bit words).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn scales_mins_k4(q: &[u8; 12]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let (six, four, two) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let scales = u64::from(u0 & six) | u64::from((u2 & four) | (((u0 >> 6) & two) << 4)) << 32;
    let mins = u64::from(u1 & six) | u64::from(((u2 >> 4) & four) | (((u1 >> 6) & two) << 4)) << 32;
    (scales, mins)
}

/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`: 8 groups of 32 values; group `2p` is
/// the low nibbles of `qs[32p..32p + 32]`, group `2p + 1` their high nibbles.
#[inline]
fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, qs) = (&b[4..16], &b[16..144]);
    for (g, yg) in y.chunks_exact_mut(32).enumerate() {
        let (s, m) = scale_min_k4(g, sc);
        let (dl, ml) = (d * s as f32, dmin * m as f32);
        let (q, shift) = (&qs[32 * (g / 2)..32 * (g / 2) + 32], 4 * (g % 2));
        for (v, &byte) in yg.iter_mut().zip(q) {
            *v = dl * ((byte >> shift) & 0x0F) as f32 - ml;
        }
    }
}

/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`: as Q4_K, with bit `g` of
/// `qh[i]` the fifth bit of value `i` of group `g`.
#[inline]
fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (g, yg) in y.chunks_exact_mut(32).enumerate() {
        let (s, m) = scale_min_k4(g, sc);
        let (dl, ml) = (d * s as f32, dmin * m as f32);
        let (q, shift) = (&qs[32 * (g / 2)..32 * (g / 2) + 32], 4 * (g % 2));
        for (i, v) in yg.iter_mut().enumerate() {
            let h = ((qh[i] >> g) & 1) << 4;
            *v = dl * (((q[i] >> shift) & 0x0F) | h) as f32 - ml;
        }
    }
}

/// `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`: 16 groups of 16 values, 6-bit values
/// `- 32`, group scale `d * scales[g]`.
#[inline]
fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    for (g, yg) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * (sc[g] as i8) as f32;
        // Value v = 128 * half + 32 * quarter + l (l in 0..32).
        let (half, quarter) = (g / 8, (g % 8) / 2);
        for (i, out) in yg.iter_mut().enumerate() {
            let l = 16 * (g % 2) + i;
            let low = ql[64 * half + l + 32 * (quarter % 2)] >> (4 * (quarter / 2)) & 0x0F;
            let high = (qh[32 * half + l] >> (2 * quarter)) & 0x03;
            let q = ((low | (high << 4)) as i8 - 32) as f32;
            *out = dl * q;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    #[test]
    fn all_k4_scales_and_mins_unpack_as_each_alone() {
        for seed in 0..64u32 {
            let q: [u8; 12] = std::array::from_fn(|i| {
                (seed.wrapping_mul(2654435761).rotate_left(i as u32 * 3) >> 7) as u8
            });
            let (scales, mins) = scales_mins_k4(&q);
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &q);
                assert_eq!(
                    ((scales >> (8 * j)) as u8, (mins >> (8 * j)) as u8),
                    (s, m),
                    "{seed} {j}"
                );
            }
        }
    }

    /// `rows` rows of `cols` varied values quantized to `ty` by candle's quantizer, as bytes.
    pub(crate) fn quantized_bytes(ty: QuantType, rows: usize, cols: usize, seed: usize) -> Vec<u8> {
        let values: Vec<f32> = crate::kernels::test_values(rows * cols, seed)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (1.0 + (i % 7) as f32))
            .collect();
        Tensor::from_vec(values, (rows, cols), &Device::Cpu)
            .and_then(|x| QTensor::quantize(&x, ggml(ty)))
            .and_then(|q| q.data().map(|d| d.to_vec()))
            .unwrap_or_default()
    }

    /// candle's name of `ty` (its quantizer is the tests' source of blocks).
    pub(crate) fn ggml(ty: QuantType) -> GgmlDType {
        ty.candle_dtype()
    }

    /// Every type against candle's quantizer and dequantizer (a port of ggml's reference):
    /// the same bytes give the same values, bit for bit.
    #[test]
    fn every_type_dequantizes_as_candle_does() -> candle_core::Result<()> {
        let n = 4 * QK_K;
        let values: Vec<f32> = crate::kernels::test_values(n, 5)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (1.0 + (i % 7) as f32))
            .collect();
        let x = Tensor::from_vec(values, (4, QK_K), &Device::Cpu)?;
        for ty in QuantType::ALL {
            assert_eq!(ggml(ty).type_size(), ty.block_bytes(), "{ty}");
            assert_eq!(ggml(ty).block_size(), ty.block_values(), "{ty}");
            let q = QTensor::quantize(&x, ggml(ty))?;
            let bytes = q.data()?;
            let want: Vec<f32> = q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?;
            let mut got = vec![f32::NAN; n];
            assert!(dequantize(ty, &bytes, &mut got), "{ty}: sizes");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{ty}[{i}]: {g} vs candle's {w}");
            }
        }
        Ok(())
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let mut out = vec![0f32; 32];
        assert!(!dequantize(QuantType::Q4_0, &[0u8; 17], &mut out));
        assert!(!dequantize(QuantType::Q4K, &[0u8; 144], &mut out));
        assert!(dequantize(QuantType::Q4_0, &[0u8; 18], &mut out));
        assert_eq!(QuantType::Q6K.bytes_of(255), None);
        assert_eq!(QuantType::from_ggml_id(16), None);
        for ty in QuantType::ALL {
            assert_eq!(QuantType::from_ggml_id(ty.ggml_id()), Some(ty));
        }
    }
}
