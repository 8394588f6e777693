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

// `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`.
static __device__ __forceinline__ float q4_k(const uint8_t *b, int v) {
    const uint8_t *sc = b + 4, *qs = b + 16;
    const int g = v / 32, i = v % 32;
    int s, m;
    scale_min_k4(g, sc, s, m);
    const float dl = __fmul_rn(half_at(b, 0), (float)s);
    const float ml = __fmul_rn(half_at(b, 2), (float)m);
    const int q = (qs[32 * (g / 2) + i] >> (4 * (g % 2))) & 0x0F;
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`.
static __device__ __forceinline__ float q5_k(const uint8_t *b, int v) {
    const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 48;
    const int g = v / 32, i = v % 32;
    int s, m;
    scale_min_k4(g, sc, s, m);
    const float dl = __fmul_rn(half_at(b, 0), (float)s);
    const float ml = __fmul_rn(half_at(b, 2), (float)m);
    const int h = ((qh[i] >> g) & 1) << 4;
    const int q = ((qs[32 * (g / 2) + i] >> (4 * (g % 2))) & 0x0F) | h;
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`.
static __device__ __forceinline__ float q6_k(const uint8_t *b, int v) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const int g = v / 16, i = v % 16;
    const float dl = __fmul_rn(half_at(b, 208), (float)sc[g]);
    const int half = g / 8, quarter = (g % 8) / 2, l = 16 * (g % 2) + i;
    const int low = (ql[64 * half + l + 32 * (quarter % 2)] >> (4 * (quarter / 2))) & 0x0F;
    const int high = (qh[32 * half + l] >> (2 * quarter)) & 0x03;
    return __fmul_rn(dl, (float)((low | (high << 4)) - 32));
}

template <int T>
static __device__ __forceinline__ float value(const uint8_t *b, int v) {
    if (T == 2) return q2_k(b, v);
    if (T == 3) return q3_k(b, v);
    if (T == 4) return q4_k(b, v);
    if (T == 5) return q5_k(b, v);
    return q6_k(b, v);
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
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    }
    if (threadIdx.x == 0) {
        dst[row] = acc;
    }
}

extern "C" __global__ void exact_gemv_q2_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv<2, 84>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q3_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv<3, 110>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q4_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv<4, 144>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q5_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv<5, 176>(vx, x, dst, ncols, nrows);
}
extern "C" __global__ void exact_gemv_q6_k(const uint8_t *vx, const float *x, float *dst, int ncols, int nrows) {
    gemv<6, 210>(vx, x, dst, ncols, nrows);
}
