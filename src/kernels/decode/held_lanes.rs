//! Scale factors kept in memory and read back one lane broadcast at a time (`vbroadcastss`
//! from memory, or the broadcast operand of the FMA that uses it), where a lane permute or a
//! register broadcast would move them: a K-quant block's per-group `d * sc` and `dmin * m`,
//! and the `d` of 8 Q4_0 / Q5_0 blocks converted at once (off AMD also Q4_1's and Q5_1's `d`
//! and `m` and Q8_0's `d`: an Intel Xeon's one shuffle port). In the exact row kernels those
//! shuffles compete with the unpacking's for the same pipes, which bound the loops (the
//! gain per type: docs/performance-archive.md). One `black_box` per hold keeps LLVM from
//! turning the loads back into permutes.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// 16 f32 lanes on one 64-byte line.
#[repr(align(64))]
pub(crate) struct HeldLanes([f32; 16]);

impl HeldLanes {
    /// Room for 16 lanes.
    pub(crate) fn new() -> Self {
        Self([0.0; 16])
    }

    /// `v`'s 16 lanes stored here, to be read through the returned reference.
    ///
    /// # Safety
    /// AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn hold512(&mut self, v: __m512) -> &Self {
        _mm512_store_ps(self.0.as_mut_ptr(), v);
        std::hint::black_box(self)
    }

    /// `lo`'s 8 lanes as lanes 0..8, `hi`'s as 8..16, to be read through the returned
    /// reference.
    ///
    /// # Safety
    /// AVX.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx")]
    pub(crate) unsafe fn hold256(&mut self, lo: __m256, hi: __m256) -> &Self {
        _mm256_store_ps(self.0.as_mut_ptr(), lo);
        _mm256_store_ps(self.0.as_mut_ptr().add(8), hi);
        std::hint::black_box(self)
    }

    /// Lane `i` (below 16) in all 16 lanes.
    ///
    /// # Safety
    /// AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn lane512(&self, i: usize) -> __m512 {
        _mm512_set1_ps(self.0[i])
    }

    /// Lane `i` (below 16) in all 8 lanes.
    ///
    /// # Safety
    /// AVX.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx")]
    pub(crate) unsafe fn lane256(&self, i: usize) -> __m256 {
        _mm256_set1_ps(self.0[i])
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Each lane read back is the lane stored, in both widths.
    #[test]
    fn lanes_come_back_as_stored() {
        let v: [f32; 16] = std::array::from_fn(|i| i as f32 * 1.5 - 7.0);
        if is_x86_feature_detected!("avx512f") {
            let mut held = HeldLanes::new();
            // SAFETY: AVX-512F checked above.
            unsafe {
                let h = held.hold512(_mm512_loadu_ps(v.as_ptr()));
                for (i, &want) in v.iter().enumerate() {
                    let mut out = [0f32; 16];
                    _mm512_storeu_ps(out.as_mut_ptr(), h.lane512(i));
                    assert_eq!(out, [want; 16]);
                }
            }
        }
        if is_x86_feature_detected!("avx") {
            let mut held = HeldLanes::new();
            // SAFETY: AVX checked above.
            unsafe {
                let h = held.hold256(
                    _mm256_loadu_ps(v.as_ptr()),
                    _mm256_loadu_ps(v[8..].as_ptr()),
                );
                for (i, &want) in v.iter().enumerate() {
                    let mut out = [0f32; 8];
                    _mm256_storeu_ps(out.as_mut_ptr(), h.lane256(i));
                    assert_eq!(out, [want; 8]);
                }
            }
        }
    }
}
