//! How a product's depth is cut into blocks, and what each block's accumulators start
//! from (shared by the AVX-512 and AVX2 + FMA micro-kernels).

/// What the accumulators start from.
#[derive(Debug, Clone, Copy)]
// Only the x86-64 kernels read the bias pointer.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Start {
    /// Zero (`c = a @ panel`).
    Zero,
    /// A bias row of `width` floats, the same for every row (`c = a @ panel + bias`).
    Bias(*const f32),
    /// The values already in `c` (`c += a @ panel`).
    Accumulate,
}

/// Calls `f(k0, kc, start)` for the depth blocks `k0..k0 + kc` of `0..k` (at least one,
/// so that `Zero` and `Bias` starts still write `c` when `k == 0`); `start` for the first
/// block, `Accumulate` for the others.
#[cfg(target_arch = "x86_64")]
pub(crate) fn depth_blocks(
    k: usize,
    block: usize,
    start: Start,
    mut f: impl FnMut(usize, usize, Start),
) {
    // Blocks of equal depth (within one), not full blocks and a short last one.
    let blocks = k.div_ceil(block.max(1)).max(1);
    let mut k0 = 0;
    let mut start = start;
    let mut i = 0;
    loop {
        let kc = (k * (i + 1)) / blocks - k0;
        i += 1;
        f(k0, kc, start);
        k0 += kc;
        start = Start::Accumulate;
        if k0 >= k {
            break;
        }
    }
}
