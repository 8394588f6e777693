//! Differentiable attention on the CPU kernels: a candle [`CustomOp3`] on `(q, k, v)` whose
//! forward is the tiled kernel and whose backward is the FlashAttention-2-style kernel, so
//! candle's autograd sees the attention while it runs at kernel speed and in memory linear
//! in the sequence (see [`crate::attention::dispatch`] for when it runs).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use crate::attention::mask::{kernel_plan, AttentionMask};
use crate::error::{Error, Result};
use crate::kernels::attend::mask_plan::MaskPlan;
use crate::kernels::attend::on_tensors::{self, PackedHeads};
use crate::kernels::cpu_tensor::{storage_f32, CpuF32};
use crate::kernels::train::sdpa_backward::{self, PackedGrad};

/// `softmax(scale * Q K^T + mask) V` as a candle op. The mask is a constant of the op.
struct SdpaOp {
    mask: MaskPlan,
    scale: f64,
    /// The forward's log-sum-exp per query row, for the backward.
    lse: Mutex<Option<Vec<f32>>>,
}

/// The context `(batch, heads, seq_q, d_v)` f32 of `q`, `k`, `v` (f32 on the CPU), with a
/// backward to all three.
///
/// # Shapes
/// - `q`: `(batch, heads, seq_q, d_k)`, `k`: `(batch, kv_heads, seq_k, d_k)`,
///   `v`: `(batch, kv_heads, seq_k, d_v)`; checked by the caller
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: f64,
) -> Result<Tensor> {
    let (b, h, sq, _) = q.dims4()?;
    let (_, _, sk, _) = k.dims4()?;
    let op = SdpaOp {
        mask: kernel_plan(mask, b, h, sq, sk)?,
        scale,
        lse: Mutex::new(None),
    };
    // The kernels read rows with a contiguous last dimension.
    let rows = |t: &Tensor| -> Result<Tensor> {
        let (_, _, _, d) = t.dims4()?;
        Ok(if t.layout().stride()[3] != 1 && d > 1 {
            t.contiguous()?
        } else {
            t.clone()
        })
    };
    Ok(rows(q)?.apply_op3(&rows(k)?, &rows(v)?, op)?)
}

/// A tensor's dims as a `(batch, heads, seq, width)` quadruple.
fn dims4(l: &Layout) -> Result<(usize, usize, usize, usize)> {
    match l.dims() {
        &[b, h, s, d] => Ok((b, h, s, d)),
        d => Err(Error::Kernel(format!(
            "attention operands must be rank 4, found {d:?}"
        ))),
    }
}

impl CustomOp3 for SdpaOp {
    fn name(&self) -> &'static str {
        "candle-attention-sdpa"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let run = || -> Result<(CpuStorage, Shape)> {
            let (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) = (s1, s2, s3) else {
                return Err(Error::Kernel(format!(
                    "the differentiable CPU attention takes f32, found q {:?}, k {:?}, v {:?}",
                    s1.dtype(),
                    s2.dtype(),
                    s3.dtype()
                )));
            };
            let (b, h, sq, _) = dims4(l1)?;
            let (_, _, _, dv) = dims4(l3)?;
            let mut lse = vec![0f32; b * h * sq];
            let ctx = on_tensors::attention_on_slices(
                (q, l1),
                (k, l2),
                (v, l3),
                &self.mask,
                self.scale,
                Some(&mut lse),
            )?;
            if let Ok(mut slot) = self.lse.lock() {
                *slot = Some(lse);
            }
            Ok((CpuStorage::F32(ctx), Shape::from((b, h, sq, dv))))
        };
        run().map_err(Error::into_candle)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let run = || -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let grad = grad_res.to_dtype(candle_core::DType::F32)?.contiguous()?;
            let saved = self.lse.lock().ok();
            let lse = saved.as_ref().and_then(|s| s.as_deref());
            let (dq, dk, dv) = sdpa_backward::attention_backward(
                q,
                k,
                v,
                (res, &grad, lse),
                &self.mask,
                self.scale,
            )?;
            Ok((Some(dq), Some(dk), Some(dv)))
        };
        run().map_err(Error::into_candle)
    }
}

/// Sizes of attention on fused projection outputs: Q, K and V heads side by side in rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackedSizes {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub v_head_dim: usize,
}

impl PackedSizes {
    fn q_cols(&self) -> usize {
        self.heads * self.head_dim
    }
    fn kv_cols(&self) -> usize {
        self.kv_heads * (self.head_dim + self.v_head_dim)
    }
    /// Q heads in `(batch * seq_q, q)` rows, K and V in `(batch * seq_k, k | v)` rows.
    fn cross_heads<'a>(
        &self,
        q: &'a [f32],
        kv: &'a [f32],
    ) -> (PackedHeads<'a>, PackedHeads<'a>, PackedHeads<'a>) {
        let k_cols = self.kv_heads * self.head_dim;
        let kv_at = |col0, width| PackedHeads {
            data: kv,
            offset: 0,
            seq: self.seq_k,
            cols: self.kv_cols(),
            col0,
            heads: self.kv_heads,
            width,
        };
        (
            PackedHeads {
                data: q,
                offset: 0,
                seq: self.seq_q,
                cols: self.q_cols(),
                col0: 0,
                heads: self.heads,
                width: self.head_dim,
            },
            kv_at(0, self.head_dim),
            kv_at(k_cols, self.v_head_dim),
        )
    }
    fn context_shape(&self) -> Shape {
        Shape::from((self.batch, self.seq_q, self.heads * self.v_head_dim))
    }
}

/// Cross-attention on `(batch * seq_q, q)` and `(batch * seq_k, k | v)` projections;
/// differentiable to both.
struct PackedCrossOp {
    mask: MaskPlan,
    scale: f64,
    sizes: PackedSizes,
    /// The forward's log-sum-exp per query row, for the backward.
    lse: Mutex<Option<Vec<f32>>>,
}

/// `t` in f32 and contiguous (a no-op for the op's own inputs and outputs).
fn dense(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(candle_core::DType::F32)?.contiguous()?)
}

/// `(batch * seq_q | batch * seq_k, cols)` rows of a projection for the op.
fn rows(t: &Tensor) -> Result<Tensor> {
    Ok(t.contiguous()?)
}

/// Cross-attention on `q` `(batch * seq_q, q)` and `kv` `(batch * seq_k, k | v)`; returns
/// the context `(batch, seq_q, heads * v_head_dim)`.
pub(crate) fn packed_cross_attention(
    q: &Tensor,
    kv: &Tensor,
    sizes: PackedSizes,
    mask: Option<&AttentionMask>,
    scale: f64,
) -> Result<Tensor> {
    let op = PackedCrossOp {
        mask: kernel_plan(mask, sizes.batch, sizes.heads, sizes.seq_q, sizes.seq_k)?,
        scale,
        sizes,
        lse: Mutex::new(None),
    };
    Ok(rows(q)?.apply_op2(&rows(kv)?, op)?)
}

impl candle_core::CustomOp2 for PackedCrossOp {
    fn name(&self) -> &'static str {
        "candle-attention-packed-cross-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let run = || -> Result<(CpuStorage, Shape)> {
            let q = storage_f32(s1, l1, "q")?;
            let kv = storage_f32(s2, l2, "kv")?;
            let z = self.sizes;
            let mut ctx = vec![0f32; z.batch * z.seq_q * z.heads * z.v_head_dim];
            let mut lse = vec![0f32; z.batch * z.heads * z.seq_q];
            on_tensors::packed_attention_into(
                z.batch,
                z.cross_heads(q, kv),
                &self.mask,
                self.scale,
                &mut ctx,
                Some(&mut lse),
            )?;
            if let Ok(mut slot) = self.lse.lock() {
                *slot = Some(lse);
            }
            Ok((CpuStorage::F32(ctx), self.sizes.context_shape()))
        };
        run().map_err(Error::into_candle)
    }

    fn bwd(
        &self,
        q: &Tensor,
        kv: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let run = || -> Result<(Option<Tensor>, Option<Tensor>)> {
            let z = self.sizes;
            let (q_t, kv_t) = (dense(q)?, dense(kv)?);
            let (res_t, grad_t) = (dense(res)?, dense(grad_res)?);
            let (qc, kvc, oc, doc) = (
                CpuF32::new(&q_t, "q")?,
                CpuF32::new(&kv_t, "kv")?,
                CpuF32::new(&res_t, "context")?,
                CpuF32::new(&grad_t, "context gradient")?,
            );
            let (qd, kvd) = (qc.contiguous()?, kvc.contiguous()?);
            let (o, d_o) = (oc.contiguous()?, doc.contiguous()?);
            let saved = self.lse.lock().ok();
            let lse = saved.as_ref().and_then(|s| s.as_deref());
            let mut gq = vec![0f32; qd.len()];
            let mut gkv = vec![0f32; kvd.len()];
            let kv_at = |col0| PackedGrad {
                cols: z.kv_cols(),
                col0,
            };
            sdpa_backward::packed_attention_backward(
                z.batch,
                z.cross_heads(qd, kvd),
                o,
                d_o,
                (&self.mask, self.scale, lse),
                (
                    &mut gq,
                    PackedGrad {
                        cols: z.q_cols(),
                        col0: 0,
                    },
                ),
                Some(&mut gkv),
                (kv_at(0), kv_at(z.kv_heads * z.head_dim)),
            )?;
            Ok((
                Some(Tensor::from_vec(gq, q.shape(), q.device())?),
                Some(Tensor::from_vec(gkv, kv.shape(), kv.device())?),
            ))
        };
        run().map_err(Error::into_candle)
    }
}
