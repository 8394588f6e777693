//! The whole multi-head attention forward on the CPU in f32 with three large allocations:
//! the fused Q/K/V projection, the merged context and the output. The attention kernels
//! read the heads straight out of the projection (strides, no split copy) and write the
//! context already merged as `(batch * seq, heads * d_v)`, so `W_O` is one matrix multiply.

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::kernels::attend::mask_plan::MaskPlan;
use crate::kernels::attend::problem::{Operand, OutOperand, Problem};
use crate::kernels::attend::{run, WeightsMode};
use crate::kernels::cpu_tensor::CpuF32;
use crate::kernels::gemm::matrix::{MatRef, SharedOut};
use crate::kernels::gemm::packed;
use crate::kernels::gemm::projection::linear_into;
use crate::kernels::gemm::WeightRef;

/// The weights and sizes of a layer with fused Q/K/V, borrowed for one call.
pub(crate) struct FusedLayer<'a> {
    /// `(hidden, q | k | v)` with `q = heads * head_dim`, `k = kv_heads * head_dim`,
    /// `v = kv_heads * v_head_dim`; packed weights have the split `q | k, v`.
    pub qkv: WeightRef<'a>,
    /// `(q + k + v,)`
    pub qkv_bias: Option<&'a Tensor>,
    /// `(heads * v_head_dim, out)`
    pub out: Option<WeightRef<'a>>,
    pub out_bias: Option<&'a Tensor>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub v_head_dim: usize,
    pub scale: f64,
}

/// Which output columns of a projection to compute.
#[derive(Debug, Clone, Copy)]
enum Columns {
    All,
    /// The queries (`q`, the first split).
    Queries,
    /// Keys and values (`k, v`, after the first split).
    KeysValues,
}

/// `x W[:, cols] + b[cols]`, `(rows, cols)` row-major.
fn project(
    x: MatRef<'_>,
    w: WeightRef<'_>,
    bias: Option<&Tensor>,
    cols: Columns,
    q_cols: usize,
) -> Result<Vec<f32>> {
    let bias_view = bias.map(|t| CpuF32::new(t, "bias")).transpose()?;
    let bias = bias_view.as_ref().map(|b| b.vector()).transpose()?;
    match w {
        WeightRef::Packed(p) => {
            let segments = match cols {
                Columns::All => 0..p.segment_count(),
                Columns::Queries => 0..1,
                Columns::KeysValues => 1..p.segment_count(),
            };
            packed::linear(x, p, segments, bias.as_deref())
        }
        WeightRef::Tensor(t) => {
            let wv = CpuF32::new(t, "weight")?;
            let wm = wv.matrix()?; // (in, out)
            let (c0, c1) = match cols {
                Columns::All => (0, wm.cols),
                Columns::Queries => (0, q_cols),
                Columns::KeysValues => (q_cols, wm.cols),
            };
            let mut out = vec![0f32; x.rows * (c1 - c0)];
            let b = bias.as_deref().map(|b| &b[c0..c1]);
            linear_into(&mut out, x, wm.columns(c0, c1 - c0)?, b)?;
            Ok(out)
        }
    }
}

/// `x W + b` for `x` `(rows, in)` f32 on the CPU and a stored `(in, out)` weight: the
/// projection on the packed micro-kernels where the weight is packed.
///
/// # Shapes
/// - `x`: `(rows, in)`; returns `(rows, out)`
pub(crate) fn linear_rows(x: &Tensor, w: WeightRef<'_>, bias: Option<&Tensor>) -> Result<Tensor> {
    let (rows, _) = x.dims2()?;
    let xc = x.contiguous()?;
    let xv = CpuF32::new(&xc, "x")?;
    let out = project(xv.matrix()?, w, bias, Columns::All, 0)?;
    let cols = out.len() / rows.max(1);
    Ok(Tensor::from_vec(out, (rows, cols), &Device::Cpu)?)
}

/// `(rows, width)` row-major view of a `(batch, seq, width)` tensor (copied only when it is
/// not contiguous).
fn rows_of(t: &Tensor) -> Result<Tensor> {
    Ok(t.contiguous()?)
}

/// Self-attention (`kv = None`) or cross-attention: context `(batch, seq_q, out)` and, in
/// [`WeightsMode::Return`], the weights `(batch, heads, seq_q, seq_k)`.
///
/// # Shapes
/// - `x`: `(batch, seq_q, hidden)`, `kv`: `(batch, seq_k, hidden)`, f32 on the CPU (checked
///   by the caller); `mask` lowered for `(batch, heads, seq_q, seq_k)`
pub(crate) fn forward(
    layer: &FusedLayer<'_>,
    x: &Tensor,
    kv: Option<&Tensor>,
    mask: &MaskPlan,
    mode: WeightsMode<'_>,
) -> Result<(Tensor, Option<Tensor>)> {
    // Each step (projection, attention, W_O) is parallel. Called from outside the rayon
    // pool, every step would hand its tasks to the pool and put the caller to sleep until
    // they are done, waking threads three times per call; run from a pool thread instead,
    // the steps follow one another on threads that are already awake (one hand-over per
    // call, which matters at sentence scale: ~0.25 ms per layer). The streaming callback
    // is not `Send`, so streaming calls stay on the caller's thread.
    let in_pool = rayon::current_thread_index().is_some();
    match mode {
        WeightsMode::Skip if !in_pool => {
            rayon::scope(|_| forward_steps(layer, x, kv, mask, WeightsMode::Skip))
        }
        WeightsMode::Return if !in_pool => {
            rayon::scope(|_| forward_steps(layer, x, kv, mask, WeightsMode::Return))
        }
        mode => forward_steps(layer, x, kv, mask, mode),
    }
}

/// [`forward`] on the current thread.
fn forward_steps(
    layer: &FusedLayer<'_>,
    x: &Tensor,
    kv: Option<&Tensor>,
    mask: &MaskPlan,
    mode: WeightsMode<'_>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, t, d) = x.dims3()?;
    let (h, kvh, hd, vhd) = (
        layer.heads,
        layer.kv_heads,
        layer.head_dim,
        layer.v_head_dim,
    );
    let q_cols = h * hd;
    let kv_cols = kvh * (hd + vhd);
    let x = rows_of(x)?;
    let xs = CpuF32::new(&x, "x")?;
    let xm = MatRef::new(xs.slice()?, xs.layout().start_offset(), b * t, d, d, 1)?; // (b*t, d)

    // Q, K, V: one buffer (b*t, q+k+v) for self-attention, (b*t, q) and (b*s, k+v) for
    // cross-attention.
    let (qbuf, kvbuf, s) = match kv {
        None => {
            let all = project(xm, layer.qkv, layer.qkv_bias, Columns::All, q_cols)?; // (b*t, q+k+v)
            (all, None, t)
        }
        Some(kv) => {
            let (_, s, dk) = kv.dims3()?;
            let kv = rows_of(kv)?;
            let kvs = CpuF32::new(&kv, "kv")?;
            let kvm = MatRef::new(kvs.slice()?, kvs.layout().start_offset(), b * s, dk, dk, 1)?;
            let q = project(xm, layer.qkv, layer.qkv_bias, Columns::Queries, q_cols)?; // (b*t, q)
            let kvp = project(kvm, layer.qkv, layer.qkv_bias, Columns::KeysValues, q_cols)?; // (b*s, k+v)
            (q, Some(kvp), s)
        }
    };
    let plan = mask;
    let dense = plan.dense().map(|t| CpuF32::new(t, "mask")).transpose()?;
    // Heads read in place: q[b, h, i, :] at row b*t + i, columns h*hd.. of its buffer.
    let (q, k, v) = match &kvbuf {
        None => {
            let width = q_cols + kv_cols;
            let op = |offset, sh| Operand {
                data: &qbuf,
                offset,
                sb: t * width,
                sh,
                sr: width,
            };
            (op(0, hd), op(q_cols, hd), op(q_cols + kvh * hd, vhd))
        }
        Some(kvb) => {
            let q = Operand {
                data: &qbuf,
                offset: 0,
                sb: t * q_cols,
                sh: hd,
                sr: q_cols,
            };
            let op = |offset, sh| Operand {
                data: kvb,
                offset,
                sb: s * kv_cols,
                sh,
                sr: kv_cols,
            };
            (q, op(0, hd), op(kvh * hd, vhd))
        }
    };
    let problem = Problem {
        batch: b,
        heads: h,
        kv_heads: kvh,
        seq_q: t,
        seq_k: s,
        dk: hd,
        dv: vhd,
        q,
        k,
        v,
        scale: layer.scale as f32,
        mask: plan.kernel_mask(dense.as_ref())?,
    };
    // Context merged as (b, t, h*vhd): head h of token i at row b*t + i, columns h*vhd.. .
    let cw = h * vhd;
    let mut ctx = vec![0f32; b * t * cw];
    let weights = {
        let out = OutOperand {
            buf: SharedOut::new(&mut ctx),
            offset: 0,
            sb: t * cw,
            sh: vhd,
            sr: cw,
            lse: None,
        };
        run(&problem, &out, mode)?
    };
    drop((qbuf, kvbuf));

    let weights = weights
        .map(|w| Tensor::from_vec(w, (b, h, t, s), &Device::Cpu)) // (b, h, t, s)
        .transpose()?;
    let Some(out_w) = layer.out else {
        return Ok((Tensor::from_vec(ctx, (b, t, cw), &Device::Cpu)?, weights)); // (b, t, h*vhd)
    };
    // out = ctx W_O + b_O, (b*t, out)
    let out = project(
        MatRef::row_major(&ctx, b * t, cw)?,
        out_w,
        layer.out_bias,
        Columns::All,
        0,
    )?;
    let o_out = out.len() / (b * t).max(1);
    drop(ctx);
    Ok((Tensor::from_vec(out, (b, t, o_out), &Device::Cpu)?, weights)) // (b, t, out)
}
