//! The attention kernels on candle tensors and CPU storages (behind
//! [`crate::scaled_dot_product_attention`] and the differentiable ops): Q, K and V read in place
//! (any strides with a contiguous last dimension, so a `transpose(1, 2)` view costs nothing),
//! f16 / bf16 computed in f32.

use candle_core::{DType, Device, Layout, Tensor};

use crate::error::{Error, Result};
use crate::kernels::attend::mask_plan::MaskPlan;
use crate::kernels::attend::problem::{Operand, OutOperand, Problem};
use crate::kernels::attend::{run, WeightsMode};
use crate::kernels::cpu_tensor::CpuF32;
use crate::kernels::gemm::matrix::SharedOut;

/// `t` in f32 with a contiguous last dimension (a no-op for most inputs).
pub(crate) fn f32_rows(t: &Tensor) -> Result<Tensor> {
    let t = t.to_dtype(DType::F32)?;
    let (_, _, _, d) = t.dims4()?;
    let stride = t.layout().stride();
    Ok(if stride[3] != 1 && d > 1 {
        t.contiguous()?
    } else {
        t
    })
}

/// Sizes of one call: `(batch, heads, kv_heads, seq_q, seq_k, d_k, d_v)`.
pub(crate) type Sizes = (usize, usize, usize, usize, usize, usize, usize);

/// Builds the [`Problem`] of `q`, `k`, `v` under `mask` (its plan borrowed for the call),
/// checks it and hands it to `f`.
pub(crate) fn with_problem<R>(
    (q, k, v): (Operand<'_>, Operand<'_>, Operand<'_>),
    (b, h, kvh, sq, sk, dk, dv): Sizes,
    plan: &MaskPlan,
    scale: f64,
    f: impl FnOnce(&Problem<'_>) -> Result<R>,
) -> Result<R> {
    let dense = plan.dense().map(|t| CpuF32::new(t, "mask")).transpose()?;
    let problem = Problem {
        batch: b,
        heads: h,
        kv_heads: kvh,
        seq_q: sq,
        seq_k: sk,
        dk,
        dv,
        q,
        k,
        v,
        scale: scale as f32,
        mask: plan.kernel_mask(dense.as_ref())?,
    };
    problem.validate()?;
    f(&problem)
}

/// The log-sum-exp slots of `rows` query rows, set to `-inf` (rows that see no key are left
/// alone by the kernels).
pub(crate) fn lse_slots(lse: Option<&mut [f32]>, rows: usize) -> Result<Option<SharedOut<'_>>> {
    match lse {
        Some(l) if l.len() == rows => {
            l.fill(f32::NEG_INFINITY);
            Ok(Some(SharedOut::new(l)))
        }
        Some(l) => Err(Error::Kernel(format!(
            "{} log-sum-exp slots for {rows} query rows",
            l.len()
        ))),
        None => Ok(None),
    }
}

/// Context `(batch, heads, seq_q, d_v)` in `v`'s dtype, and the weights `(batch, heads,
/// seq_q, seq_k)` f32 in [`WeightsMode::Return`]. Shapes were checked by the caller.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &MaskPlan,
    scale: f64,
    mode: WeightsMode<'_>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, h, sq, dk) = q.dims4()?;
    let (_, kvh, sk, _) = k.dims4()?;
    let (_, _, _, dv) = v.dims4()?;
    let out_dtype = v.dtype();
    if matches!(mode, WeightsMode::Skip) && mask.is_empty() {
        // A decode step: the cache read as stored (no contiguous f32 copy of its views).
        if let Some(context) = crate::kernels::decode::one_query::attention(q, k, v, scale)? {
            return Ok((context, None));
        }
    }
    let (q, k, v) = (f32_rows(q)?, f32_rows(k)?, f32_rows(v)?);
    let (qs, ks, vs) = (
        CpuF32::new(&q, "q")?,
        CpuF32::new(&k, "k")?,
        CpuF32::new(&v, "v")?,
    );
    let mut ctx = vec![0f32; b * h * sq * dv];
    let operands = (
        tensor_operand(&qs, "q")?,
        tensor_operand(&ks, "k")?,
        tensor_operand(&vs, "v")?,
    );
    let weights = with_problem(operands, (b, h, kvh, sq, sk, dk, dv), mask, scale, |p| {
        let out = OutOperand {
            buf: SharedOut::new(&mut ctx),
            offset: 0,
            sb: h * sq * dv,
            sh: sq * dv,
            sr: dv,
            lse: None,
        };
        run(p, &out, mode)
    })?;
    let context = Tensor::from_vec(ctx, (b, h, sq, dv), &Device::Cpu)?.to_dtype(out_dtype)?; // (b, h, sq, dv)
    let weights = weights
        .map(|w| Tensor::from_vec(w, (b, h, sq, sk), &Device::Cpu)) // (b, h, sq, sk)
        .transpose()?;
    Ok((context, weights))
}

/// A rank-4 `(batch, heads, seq, width)` tensor as a kernel operand; the last dimension
/// must be contiguous.
pub(crate) fn tensor_operand<'a>(t: &'a CpuF32<'a>, name: &str) -> Result<Operand<'a>> {
    operand(t.slice()?, t.layout(), name)
}

/// A rank-4 operand straight from a storage slice and its layout (last dimension contiguous).
pub(crate) fn operand<'a>(data: &'a [f32], l: &Layout, name: &str) -> Result<Operand<'a>> {
    let (dims, stride) = (l.dims(), l.stride());
    if dims.len() != 4 || (stride[3] != 1 && dims[3] > 1) {
        return Err(Error::Kernel(format!(
            "`{name}` must be rank 4 with a contiguous last dimension, found dims {dims:?} strides {stride:?}"
        )));
    }
    Ok(Operand {
        data,
        offset: l.start_offset(),
        sb: stride[0],
        sh: stride[1],
        sr: stride[2],
    })
}

/// The context `(batch, heads, seq_q, d_v)` of f32 storages (the forward of the
/// differentiable op, which sees storages rather than tensors).
pub(crate) fn attention_on_slices(
    q: (&[f32], &Layout),
    k: (&[f32], &Layout),
    v: (&[f32], &Layout),
    mask: &MaskPlan,
    scale: f64,
    lse: Option<&mut [f32]>,
) -> Result<Vec<f32>> {
    let (qo, ko, vo) = (
        operand(q.0, q.1, "q")?,
        operand(k.0, k.1, "k")?,
        operand(v.0, v.1, "v")?,
    );
    let d4 = |l: &Layout| -> Result<[usize; 4]> {
        l.dims()
            .try_into()
            .map_err(|_| Error::Kernel(format!("rank 4 expected, found {:?}", l.dims())))
    };
    let [b, h, sq, dk] = d4(q.1)?;
    let [_, kvh, sk, _] = d4(k.1)?;
    let [_, _, _, dv] = d4(v.1)?;
    let mut ctx = vec![0f32; b * h * sq * dv];
    let lse = lse_slots(lse, b * h * sq)?;
    with_problem(
        (qo, ko, vo),
        (b, h, kvh, sq, sk, dk, dv),
        mask,
        scale,
        |p| {
            let out = OutOperand {
                buf: SharedOut::new(&mut ctx),
                offset: 0,
                sb: h * sq * dv,
                sh: sq * dv,
                sr: dv,
                lse,
            };
            run(p, &out, WeightsMode::Skip).map(|_| ())
        },
    )?;
    Ok(ctx)
}

/// The heads of one of Q, K or V inside a row-major `(batch * seq, cols)` f32 matrix (a fused
/// projection's output): head `h` of row `(b, i)` is `data[offset + (b * seq + i) * cols +
/// col0 + h * width ..][..width]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedHeads<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub seq: usize,
    pub cols: usize,
    pub col0: usize,
    pub heads: usize,
    pub width: usize,
}

impl<'a> PackedHeads<'a> {
    pub(crate) fn operand(&self) -> Operand<'a> {
        Operand {
            data: self.data,
            offset: self.offset + self.col0,
            sb: self.seq * self.cols,
            sh: self.width,
            sr: self.cols,
        }
    }
}

/// The problem of `q`, `k` and `v` in packed form, built and handed to `f`.
pub(crate) fn with_packed_problem<R>(
    batch: usize,
    (q, k, v): (PackedHeads<'_>, PackedHeads<'_>, PackedHeads<'_>),
    mask: &MaskPlan,
    scale: f64,
    f: impl FnOnce(&Problem<'_>) -> Result<R>,
) -> Result<R> {
    if k.seq != v.seq || k.heads != v.heads || q.width != k.width {
        return Err(Error::Kernel(format!(
            "packed heads do not fit together: q {} x {}, k {} x {} over {} keys, v {} x {} over {}",
            q.heads, q.width, k.heads, k.width, k.seq, v.heads, v.width, v.seq
        )));
    }
    let sizes = (batch, q.heads, k.heads, q.seq, k.seq, q.width, v.width);
    let operands = (q.operand(), k.operand(), v.operand());
    with_problem(operands, sizes, mask, scale, f)
}

/// The context of packed Q, K, V into `ctx`, `(batch * seq_q, heads * d_v)` rows with the
/// heads merged (overwritten), and each
/// query row's log-sum-exp into `lse`, `(batch, heads, seq_q)`, when given (for the
/// backward).
pub(crate) fn packed_attention_into(
    batch: usize,
    qkv: (PackedHeads<'_>, PackedHeads<'_>, PackedHeads<'_>),
    mask: &MaskPlan,
    scale: f64,
    ctx: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    with_packed_problem(batch, qkv, mask, scale, |p| {
        let (h, sq, dv) = (p.heads, p.seq_q, p.dv);
        if ctx.len() != batch * sq * h * dv {
            return Err(Error::Kernel(format!(
                "context buffer of {} for ({batch} x {sq}, {h} x {dv})",
                ctx.len()
            )));
        }
        // Rows that see no key are left alone by the kernels: they must read as zeros.
        ctx.fill(0.0);
        let lse = lse_slots(lse, batch * h * sq)?;
        let out = OutOperand {
            buf: SharedOut::new(ctx),
            offset: 0,
            sb: sq * h * dv,
            sh: dv,
            sr: h * dv,
            lse,
        };
        run(p, &out, WeightsMode::Skip)?;
        Ok(())
    })
}
