// One f32 row times a K-quant weight (Q2_K .. Q6_K) on CUDA, exact: each value made as
// gguf-py (and this crate's CPU code, `src/kernels/quant/blocks.rs`) makes it, every product
// and difference rounded as there (the `__f*_rn` intrinsics are never contracted), times the
// activation, summed in f32. candle's K-quant kernels scale each group's sum instead.
// One warp a row; compiled to PTX by build.rs (feature `cuda`).

#include <stdint.h>
#include <cuda_fp16.h>

#define QK_K 256

static __device__ __forceinline__ float half_at(const uint8_t *b, int at) {
    const unsigned short h = (unsigned short)b[at] | ((unsigned short)b[at + 1] << 8);
    return __half2float(__ushort_as_half(h));
}

// Scale and min of group `j` (0..8) of a Q4_K / Q5_K block's 12 scale bytes.
static __device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int &s, int &m) {
    if (j < 4) {
        s = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        s = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// `{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`: value `v` of the block.
static __device__ __forceinline__ float q2_k(const uint8_t *b, int v) {
    const uint8_t *scales = b, *qs = b + 16;
    const int g = v / 16, i = v % 16;
    const float dl = __fmul_rn(half_at(b, 80), (float)(scales[g] & 0x0F));
    const float ml = __fmul_rn(half_at(b, 82), (float)(scales[g] >> 4));
    const int half = g / 8, shift = 2 * ((g % 8) / 2), first = 16 * (g % 2);
    const int q = (qs[32 * half + first + i] >> shift) & 3;
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// `{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`.
static __device__ __forceinline__ float q3_k(const uint8_t *b, int v) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const int g = v / 16, i = v % 16;
    const int low = (sc[g % 8] >> (4 * (g / 8))) & 0x0F;
    const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 0x03;
    const float dl = __fmul_rn(half_at(b, 108), (float)((low | (high << 4)) - 32));
    const int half = g / 8, shift = 2 * ((g % 8) / 2), l = 16 * (g % 2) + i;
    const int ql = (qs[32 * half + l] >> shift) & 3;
    const int hm = ((hmask[l] >> (g / 2)) & 1) ? 0 : 4;
    return __fmul_rn(dl, (float)(ql - hm));
}

// The warp's 32 partial sums added (a butterfly, every lane ends with the total), written
// by lane 0 as `dst[row]`.
static __device__ __forceinline__ void store_row_sum(float acc, float *dst, int row) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    }
    if (threadIdx.x == 0) {
        dst[row] = acc;
    }
}

template <int T>
static __device__ __forceinline__ float value(const uint8_t *b, int v) {
    if (T == 2) return q2_k(b, v);
    return q3_k(b, v);
}

// `dst[row] = sum_j W[row, j] x[j]` for the `nrows` rows of `ncols` values (a multiple of
// 256) in `vx`, blocks of `BYTES` one after another; one warp (`threadIdx.x`) a row
// (`blockIdx.x * blockDim.y + threadIdx.y`), lane `t` taking values `t, t + 32, ...`.
template <int T, int BYTES>
static __device__ void gemv(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= nrows) {
        return;
    }
    const int nb = ncols / QK_K;
    const uint8_t *r = vx + (size_t)row * nb * BYTES;
    float acc = 0.0f;
    for (int blk = 0; blk < nb; ++blk) {
        const uint8_t *b = r + (size_t)blk * BYTES;
        const float *xb = x + blk * QK_K;
#pragma unroll
        for (int k = 0; k < QK_K / 32; ++k) {
            const int v = 32 * k + threadIdx.x;
            acc = __fmaf_rn(value<T>(b, v), xb[v], acc);
        }
    }
    store_row_sum(acc, dst, row);
}

// Q4_K (`{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`) and Q5_K (`FIVE`: `qh[32]` before
// `qs`, bit `g` of `qh[i]` the fifth bit of value `i` of group `g`), each value `d sc q -
// dmin m` as gguf-py makes it, summed as `gemv` sums, in another order: lane `t`
// takes bytes `4 (t % 8)..4 (t % 8) + 4` of the quarter `p = t / 8` of a block's `qs` (one
// 32-bit load), whose low nibbles are values of group `2 p` and high ones of `2 p + 1`, so
// each lane works out two groups' scales and mins a block instead of one a value.
template <bool FIVE>
static __device__ void gemv_k4(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= nrows) {
        return;
    }
    const int bytes = FIVE ? 176 : 144;
    const int qs_at = FIVE ? 48 : 16;
    const int nb = ncols / QK_K;
    const int p = threadIdx.x / 8, i0 = 4 * (threadIdx.x % 8);
    const uint8_t *r = vx + (size_t)row * nb * bytes;
    float acc = 0.0f;
    // Four blocks an iteration: their loads in flight together (a warp's row was one
    // load's latency after another: 2x the time; the value-at-a-time loop above got slower
    // so, and keeps one block an iteration for Q2_K / Q3_K).
#pragma unroll 4
    for (int blk = 0; blk < nb; ++blk) {
        const uint8_t *b = r + (size_t)blk * bytes;
        const float d = half_at(b, 0), dmin = half_at(b, 2);
        int s0, m0, s1, m1;
        scale_min_k4(2 * p, b + 4, s0, m0);
        scale_min_k4(2 * p + 1, b + 4, s1, m1);
        const float dl0 = __fmul_rn(d, (float)s0), ml0 = __fmul_rn(dmin, (float)m0);
        const float dl1 = __fmul_rn(d, (float)s1), ml1 = __fmul_rn(dmin, (float)m1);
        // The blocks start on an aligned allocation, 144 or 176 bytes apart (multiples of
        // 16), and these offsets in them are multiples of 4: aligned 32-bit loads.
        const uint32_t q4 = *(const uint32_t *)(b + qs_at + 32 * p + i0);
        const uint32_t h4 = FIVE ? *(const uint32_t *)(b + 16 + i0) : 0u;
        const float *x0 = x + blk * QK_K + 64 * p + i0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int byte = (q4 >> (8 * j)) & 0xFF;
            const int hbyte = (h4 >> (8 * j)) & 0xFF;
            const int lo = (byte & 0x0F) | (FIVE ? ((hbyte >> (2 * p)) & 1) << 4 : 0);
            const int hi = (byte >> 4) | (FIVE ? ((hbyte >> (2 * p + 1)) & 1) << 4 : 0);
            acc = __fmaf_rn(__fsub_rn(__fmul_rn(dl0, (float)lo), ml0), x0[j], acc);
            acc = __fmaf_rn(__fsub_rn(__fmul_rn(dl1, (float)hi), ml1), x0[32 + j], acc);
        }
    }
    store_row_sum(acc, dst, row);
}

// Q6_K (`{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`), each value `d sc (q - 32)` as
// gguf-py makes it (`d sc` rounded, then the product), its bytes read once a block: lane `t`
// takes value `t` of each 32-value quarter (`128 h + 32 q + t`), whose low four bits are in
// `ql[64 h + t]` (quarters 0, 2) or `ql[64 h + 32 + t]` (1, 3) and high two in `qh[32 h + t]`;
// `UNROLL` blocks an iteration (4: 0.58-0.62x the time of the value-at-a-time loop on an
// H200 at 4096 x 4096 to 4096 x 11008, 1: 0.66x, 2: 0.61x).
template <int UNROLL>
static __device__ void gemv_q6(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= nrows) {
        return;
    }
    const int nb = ncols / QK_K, t = threadIdx.x;
    const uint8_t *r = vx + (size_t)row * nb * 210;
    float acc = 0.0f;
#pragma unroll UNROLL
    for (int blk = 0; blk < nb; ++blk) {
        const uint8_t *b = r + (size_t)blk * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b, 208);
        const float *xb = x + blk * QK_K;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int b0 = b[64 * h + t], b1 = b[64 * h + 32 + t], hb = b[128 + 32 * h + t];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int low = ((q % 2 == 0 ? b0 : b1) >> (4 * (q / 2))) & 0x0F;
                const int high = (hb >> (2 * q)) & 0x03;
                const float dl = __fmul_rn(d, (float)sc[8 * h + 2 * q + t / 16]);
                const float w = __fmul_rn(dl, (float)((low | (high << 4)) - 32));
                acc = __fmaf_rn(w, xb[128 * h + 32 * q + t], acc);
            }
        }
    }
    store_row_sum(acc, dst, row);
}

extern "C" __global__ void exact_gemv_q2_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv<2, 84>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q3_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv<3, 110>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q4_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv_k4<false>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q5_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv_k4<true>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q6_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv_q6<4>(vx, x, dst, ncols, nrows);
}
