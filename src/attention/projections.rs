//! The loaded projections of a multi-head layer: Q, K and V fused into one stored matrix at
//! load time where they read one input width and nothing tracks gradients (the caller's
//! tensors as they are otherwise), `W_O`, and the products and parameter views every route
//! of [`crate::attention::layer_routes`] reads.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::attention::cost::HeadDims;
use crate::attention::dispatch;
use crate::error::{Error, Result};
use crate::kernels::attend::fused_layer;
use crate::kernels::decode::gemv::one_row_linear;
use crate::kernels::gemm::WeightRef;
use crate::weights::config::AttentionConfig;
use crate::weights::layout::{LinearWeights, PackedQkv, Projections};
use crate::weights::quantized::QuantWeight;
use crate::weights::stored::StoredWeight;

/// Q, K and V projections. Fused into one matrix at load time whenever the three read the
/// same input width, so self-attention takes one matrix multiply.
#[derive(Debug, Clone)]
pub(crate) enum QkvProjection {
    Fused {
        /// `(hidden, q_out + k_out + v_out)`: the fused `W^T`, split `q | k, v`.
        weight_t: StoredWeight,
        /// `(q_out + k_out + v_out,)`
        bias: Option<Tensor>,
    },
    /// The caller's tensors as they are: K/V reading a different width than Q (PyTorch
    /// `kdim`/`vdim`, cross-attention only), or weights that track gradients (variables an
    /// optimizer updates in place), which every call reads afresh.
    Separate {
        q: LinearWeights,
        k: LinearWeights,
        v: LinearWeights,
    },
}

/// The output projection `W_O`.
#[derive(Debug, Clone)]
pub(crate) struct OutProjection {
    /// `(heads * v_head_dim, out)`: `W_O^T`.
    pub weight_t: StoredWeight,
    /// The caller's `(out, in)` tensor, kept for a trainable layer.
    pub weight: Option<Tensor>,
    /// `(out,)`
    pub bias: Option<Tensor>,
}

/// The Q/K/V and output projections of a layer, with their head sizes.
#[derive(Debug, Clone)]
pub(crate) struct LayerProjections {
    pub qkv: QkvProjection,
    pub out_proj: Option<OutProjection>,
    pub dims: HeadDims,
    /// For a trainable layer whose checkpoint stores Q, K and V as one tensor: that tensor,
    /// which the differentiable CPU layer multiplies by as it is.
    pub packed_qkv: Option<PackedQkv>,
}

/// The fused layer's weights as the CPU kernels read them: `W_qkv`, its bias, `W_O`.
pub(crate) type FusedWeights<'a> = (WeightRef<'a>, Option<&'a Tensor>, Option<WeightRef<'a>>);

impl LayerProjections {
    /// Checks every size of `p` against `cfg`'s head counts and stores the projections
    /// (fused where they can be).
    pub fn new(p: Projections, cfg: &AttentionConfig) -> Result<Self> {
        let heads = cfg.num_heads;
        if heads == 0 {
            return Err(Error::Heads(
                "the number of heads must be at least 1, found 0".into(),
            ));
        }
        let (q_out, hidden) = p.q.dims()?;
        let (k_out, k_in) = p.k.dims()?;
        let (v_out, v_in) = p.v.dims()?;
        if q_out % heads != 0 {
            return Err(Error::Heads(format!(
                "{heads} heads do not divide the {q_out} outputs of the query projection `{}`",
                p.q.name
            )));
        }
        let head_dim = q_out / heads;
        let kv_heads = match cfg.num_kv_heads {
            Some(0) => {
                return Err(Error::Heads(
                    "the number of key/value heads must be at least 1, found 0".into(),
                ))
            }
            Some(n) => {
                if !heads.is_multiple_of(n) {
                    return Err(Error::Heads(format!(
                        "{n} key/value heads do not divide the {heads} query heads"
                    )));
                }
                if k_out != n * head_dim {
                    return Err(Error::ShapeMismatch {
                        tensor: p.k.name.clone(),
                        expected: format!(
                            "{} rows (kv_heads {n} x head_dim {head_dim}), in = {k_in}",
                            n * head_dim
                        ),
                        found: vec![k_out, k_in],
                    });
                }
                n
            }
            None => {
                if k_out % head_dim != 0
                    || !heads.is_multiple_of((k_out / head_dim).max(1))
                    || k_out == 0
                {
                    return Err(Error::ShapeMismatch {
                        tensor: p.k.name.clone(),
                        expected: format!(
                            "a multiple of head_dim {head_dim} rows whose head count divides {heads}"
                        ),
                        found: vec![k_out, k_in],
                    });
                }
                k_out / head_dim
            }
        };
        if v_out % kv_heads != 0 {
            return Err(Error::ShapeMismatch {
                tensor: p.v.name.clone(),
                expected: format!("a multiple of the {kv_heads} key/value heads rows"),
                found: vec![v_out, v_in],
            });
        }
        if k_in != v_in {
            return Err(Error::ShapeMismatch {
                tensor: p.v.name.clone(),
                expected: format!("input width {k_in} like the key projection"),
                found: vec![v_out, v_in],
            });
        }
        let v_head_dim = v_out / kv_heads;
        if let Some(o) = &p.o {
            let (_o_out, o_in) = o.dims()?;
            if o_in != heads * v_head_dim {
                return Err(Error::ShapeMismatch {
                    tensor: o.name.clone(),
                    expected: format!("(out, {}) = (out, heads x v_head_dim)", heads * v_head_dim),
                    found: o.weight.dims().to_vec(),
                });
            }
        }
        let dtype = p.q.weight.dtype();
        for w in [&p.k, &p.v].into_iter().chain(p.o.as_ref()) {
            if w.weight.dtype() != dtype {
                return Err(Error::WrongDtype {
                    tensor: w.name.clone(),
                    expected: format!("{dtype:?} like the query projection"),
                    found: format!("{:?}", w.weight.dtype()),
                });
            }
        }
        // Weights that track gradients are kept as the caller's tensors (views, no copy).
        let trainable = p.tracks_gradients();
        let qkv = if k_in == hidden && !trainable {
            let weight = Tensor::cat(&[&p.q.weight, &p.k.weight, &p.v.weight], 0)?; // (q+k+v, hidden)
            let weight_t = StoredWeight::new(&weight, &[q_out])?; // (hidden, q+k+v)
            let bias = linear_biases(&p.q, &p.k, &p.v)?;
            QkvProjection::Fused { weight_t, bias }
        } else {
            QkvProjection::Separate {
                q: p.q,
                k: p.k,
                v: p.v,
            }
        };
        let out_proj = match p.o {
            Some(o) => Some(OutProjection {
                weight_t: if trainable {
                    StoredWeight::Tensor(o.weight.t()?) // a view of the caller's tensor
                } else {
                    StoredWeight::new(&o.weight, &[])? // (heads*v_head_dim, out)
                },
                weight: trainable.then(|| o.weight.clone()),
                bias: o.bias,
            }),
            None => None,
        };
        Ok(Self {
            qkv,
            out_proj,
            packed_qkv: None,
            dims: HeadDims {
                hidden,
                kv_hidden: k_in,
                heads,
                kv_heads,
                head_dim,
                v_head_dim,
            },
        })
    }

    /// The projections of a layer whose weights are GGUF matrices kept in their blocks:
    /// `q` `(heads * head_dim, hidden)`, `k` and `v` `(kv_heads * head_dim, hidden)`, `o`
    /// `(out, heads * head_dim)`; `qkv_bias` `(q + k + v,)` f32, `o_bias` `(out,)`.
    pub fn quantized(
        [q, k, v]: [QuantWeight; 3],
        qkv_bias: Option<Tensor>,
        o: Option<(QuantWeight, Option<Tensor>)>,
        heads: usize,
        kv_heads: usize,
    ) -> Result<Self> {
        let hidden = q.dims().1;
        if let Some(w) = [&k, &v].into_iter().find(|w| w.dims().1 != hidden) {
            return Err(Error::ShapeMismatch {
                tensor: format!("{w:?}"),
                expected: format!("(_, {hidden}) like the query projection"),
                found: vec![w.dims().0, w.dims().1],
            });
        }
        let rows = [q.dims().0, k.dims().0, v.dims().0];
        let o = o.map(|(o, bias)| (StoredWeight::Quantized(Arc::from([o])), bias));
        Self::from_stored(
            StoredWeight::Quantized(Arc::from([q, k, v])),
            rows,
            qkv_bias,
            o,
            heads,
            kv_heads,
        )
    }

    /// The projections of a layer whose weights were stored at load time (GGUF blocks, or
    /// half-precision matrices packed from a file's map): `qkv` is the `(hidden, q + k + v)`
    /// fused `W^T` with `rows` = the `(q, k, v)` output counts, `o` the `(heads * v_head_dim,
    /// out)` `W_O^T`; `qkv_bias` `(q + k + v,)`, `o`'s bias `(out,)`. Every size is checked.
    pub fn from_stored(
        qkv: StoredWeight,
        [q_out, k_out, v_out]: [usize; 3],
        qkv_bias: Option<Tensor>,
        o: Option<(StoredWeight, Option<Tensor>)>,
        heads: usize,
        kv_heads: usize,
    ) -> Result<Self> {
        let (hidden, qkv_out) = qkv.dims()?;
        if qkv_out != q_out + k_out + v_out {
            return Err(Error::ShapeMismatch {
                tensor: "q, k, v projections".into(),
                expected: format!("{q_out} + {k_out} + {v_out} outputs"),
                found: vec![hidden, qkv_out],
            });
        }
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) || q_out % heads != 0 {
            return Err(Error::Heads(format!(
                "{heads} heads and {kv_heads} key/value heads for {q_out} query rows"
            )));
        }
        let head_dim = q_out / heads;
        if k_out != kv_heads * head_dim || v_out % kv_heads != 0 {
            return Err(Error::ShapeMismatch {
                tensor: "key / value projections".into(),
                expected: format!(
                    "{} key rows and a multiple of {kv_heads} value rows",
                    kv_heads * head_dim
                ),
                found: vec![k_out, v_out],
            });
        }
        if let Some(b) = &qkv_bias {
            if b.dims() != [qkv_out] {
                return Err(Error::ShapeMismatch {
                    tensor: "q, k, v biases".into(),
                    expected: format!("({qkv_out},)"),
                    found: b.dims().to_vec(),
                });
            }
        }
        let v_head_dim = v_out / kv_heads;
        let out_proj = match o {
            Some((weight_t, bias)) => {
                let (o_in, o_out) = weight_t.dims()?;
                if o_in != heads * v_head_dim || bias.as_ref().is_some_and(|b| b.dims() != [o_out])
                {
                    return Err(Error::ShapeMismatch {
                        tensor: "output projection".into(),
                        expected: format!("(out, {}) and an (out,) bias", heads * v_head_dim),
                        found: vec![o_out, o_in],
                    });
                }
                Some(OutProjection {
                    weight_t,
                    weight: None,
                    bias,
                })
            }
            None => None,
        };
        Ok(Self {
            qkv: QkvProjection::Fused {
                weight_t: qkv,
                bias: qkv_bias,
            },
            out_proj,
            dims: HeadDims {
                hidden,
                kv_hidden: hidden,
                heads,
                kv_heads,
                head_dim,
                v_head_dim,
            },
            packed_qkv: None,
        })
    }

    /// Number of weights and biases of the Q, K, V and output projections.
    pub(crate) fn parameter_count(&self) -> Result<u64> {
        let n = |t: &Tensor| t.elem_count() as u64;
        let lin = |l: &LinearWeights| n(&l.weight) + l.bias.as_ref().map_or(0, n);
        let qkv = match &self.qkv {
            QkvProjection::Fused { weight_t, bias } => {
                weight_t.elem_count() as u64 + bias.as_ref().map_or(0, n)
            }
            QkvProjection::Separate { q, k, v } => lin(q) + lin(k) + lin(v),
        };
        let out = self.out_proj.as_ref().map_or(0, |o| {
            o.weight_t.elem_count() as u64 + o.bias.as_ref().map_or(0, n)
        });
        Ok(qkv + out)
    }

    /// Whether the Q/K/V projections have biases.
    pub fn has_bias(&self) -> bool {
        match &self.qkv {
            QkvProjection::Fused { bias, .. } => bias.is_some(),
            QkvProjection::Separate { q, .. } => q.bias.is_some(),
        }
    }

    /// Output width of `W_O`, `None` without an output projection.
    pub fn out_width(&self) -> Result<Option<usize>> {
        Ok(match &self.out_proj {
            Some(o) => Some(o.weight_t.dims()?.1),
            None => None,
        })
    }

    /// Whether Q, K and V are fused into one stored matrix.
    pub fn is_fused(&self) -> bool {
        matches!(self.qkv, QkvProjection::Fused { .. })
    }

    /// Whether a weight tracks gradients.
    pub fn is_trainable(&self) -> bool {
        let lin = |l: &LinearWeights| dispatch::tracks(&[Some(&l.weight), l.bias.as_ref()]);
        let qkv = match &self.qkv {
            QkvProjection::Fused { bias, .. } => dispatch::tracks(&[bias.as_ref()]),
            QkvProjection::Separate { q, k, v } => lin(q) || lin(k) || lin(v),
        };
        qkv || self.out_proj.as_ref().is_some_and(|o| {
            let w = match &o.weight_t {
                StoredWeight::Tensor(t) => Some(t),
                StoredWeight::Packed(_) | StoredWeight::Quantized(_) => None,
            };
            dispatch::tracks(&[w, o.bias.as_ref()])
        })
    }

    /// Dtype of the weights.
    pub fn dtype(&self) -> DType {
        match &self.qkv {
            QkvProjection::Fused { weight_t, .. } => weight_t.dtype(),
            QkvProjection::Separate { q, .. } => q.weight.dtype(),
        }
    }

    /// The weights the fused CPU layer reads, when it can read them all (f32 on the CPU).
    pub fn fused_weights(&self) -> Option<FusedWeights<'_>> {
        let QkvProjection::Fused { weight_t, bias } = &self.qkv else {
            return None;
        };
        let out = match &self.out_proj {
            Some(o) => Some(o.weight_t.cpu_f32()?),
            None => None,
        };
        Some((weight_t.cpu_f32()?, bias.as_ref(), out))
    }

    /// `x W_qkv^T + b`: Q, K and V side by side in one product's rows, on the weights as
    /// they are now (the packed micro-kernels or the one-row kernels where nothing tracks
    /// gradients).
    ///
    /// # Shapes
    /// - `x2`: `(rows, hidden)`; returns `(rows, q + k + v)`
    pub fn qkv_rows(&self, x2: &Tensor) -> Result<Tensor> {
        if let QkvProjection::Fused { weight_t, bias } = &self.qkv {
            if !x2.track_op() {
                if let Some(y) = weight_t.quantized_forward(x2)? {
                    return add_bias(y, bias.as_ref());
                }
            }
        }
        Ok(match &self.qkv {
            QkvProjection::Fused { weight_t, bias } => match weight_t.cpu_f32() {
                Some(w) if x2.device().is_cpu() && x2.dtype() == DType::F32 && !x2.track_op() => {
                    fused_layer::linear_rows(x2, w, bias.as_ref())?
                }
                _ => {
                    let w = weight_t.tensor()?; // (hidden, q+k+v)
                    match one_row_linear(x2, &w, bias.as_ref(), false)? {
                        Some(y) => y,
                        None => linear_in_out(x2, &w, bias.as_ref())?,
                    }
                }
            },
            QkvProjection::Separate { q, k, v } => {
                if self.dims.kv_hidden != self.dims.hidden {
                    return Err(Error::input(
                        "x",
                        format!(
                            "cross-attention: this layer's keys/values read width {} but queries read {}",
                            self.dims.kv_hidden, self.dims.hidden
                        ),
                        "self-attention call",
                    ));
                }
                let w = Tensor::cat(&[&q.weight, &k.weight, &v.weight], 0)?; // (q+k+v, hidden)
                linear(x2, &w, linear_biases(q, k, v)?.as_ref())?
            }
        })
    }

    /// `ctx W_O^T + b_O` (the rows unchanged without an output projection), on the packed
    /// micro-kernels or the one-row kernels where nothing tracks gradients.
    ///
    /// # Shapes
    /// - `ctx`: `(rows, heads * v_head_dim)`; returns `(rows, out)`
    pub fn output_rows(&self, ctx: &Tensor) -> Result<Tensor> {
        let Some(o) = &self.out_proj else {
            return Ok(ctx.clone());
        };
        if !ctx.track_op() {
            if let Some(y) = o.weight_t.quantized_forward(ctx)? {
                return add_bias(y, o.bias.as_ref());
            }
        }
        Ok(match o.weight_t.cpu_f32() {
            Some(w) if ctx.device().is_cpu() && ctx.dtype() == DType::F32 && !ctx.track_op() => {
                fused_layer::linear_rows(ctx, w, o.bias.as_ref())?
            }
            _ => {
                let w = o.weight_t.tensor()?; // (h*vhd, out)
                match one_row_linear(ctx, &w, o.bias.as_ref(), false)? {
                    Some(y) => y,
                    None => linear_in_out(ctx, &w, o.bias.as_ref())?,
                }
            }
        })
    }

    /// The parameters as the differentiable CPU layer takes them (see
    /// `kernels::trainable_layer::LayerShape`): `W_qkv` as stored where it can be (and
    /// whether that is `(hidden, q + k + v)`), `W_O` as stored (and whether that is
    /// `(in, out)`), and the Q/K/V and output biases in one vector, zeros for missing biases.
    /// Read from the current tensors, with no node between a stored variable and the layer,
    /// so that gradients flow back to them at no extra cost.
    #[allow(clippy::type_complexity)]
    pub fn layer_parameters(&self) -> Result<(Tensor, bool, Option<(Tensor, bool)>, Tensor)> {
        let (w_qkv, qkv_t, b_qkv) = match (&self.qkv, &self.packed_qkv) {
            (_, Some(p)) => (p.weight.clone(), p.transposed, p.bias.clone()),
            (QkvProjection::Fused { weight_t, bias }, None) => {
                (weight_t.tensor()?, true, bias.clone()) // (hidden, q+k+v)
            }
            (QkvProjection::Separate { q, k, v }, None) => (
                Tensor::cat(&[&q.weight, &k.weight, &v.weight], 0)?, // (q+k+v, hidden)
                false,
                linear_biases(q, k, v)?,
            ),
        };
        let c = if qkv_t { w_qkv.dim(1)? } else { w_qkv.dim(0)? };
        let dev = w_qkv.device().clone();
        let dtype = w_qkv.dtype();
        let b_qkv = match b_qkv {
            Some(b) => b,
            None => Tensor::zeros(c, dtype, &dev)?,
        };
        let mut biases = vec![b_qkv];
        let mut w_o = None;
        if let Some(o) = &self.out_proj {
            let w_t = o.weight_t.tensor()?; // (h*vhd, out)
            let out = w_t.dim(1)?;
            let stored = self.packed_qkv.as_ref().and_then(|p| p.out_in_out.as_ref());
            w_o = Some(match (&o.weight, stored) {
                // GPT-2's `(in, out)` variable.
                (_, Some(w)) => (w.clone(), true),
                // The caller's `(out, in)` tensor (PyTorch, BERT, LLaMA).
                (Some(w), None) if w.is_contiguous() => (w.clone(), false),
                // `(in, out)` when that is the contiguous side (GPT-2, a frozen layer).
                _ if w_t.is_contiguous() => (w_t, true),
                _ => (w_t.t()?.contiguous()?, false),
            });
            biases.push(match &o.bias {
                Some(b) => b.clone(),
                None => Tensor::zeros(out, dtype, &dev)?,
            });
        }
        Ok((w_qkv.contiguous()?, qkv_t, w_o, Tensor::cat(&biases, 0)?))
    }

    /// `(W_q^T, b_q, W_kv^T, b_kv)` for cross-attention (weights as `(in, out)`).
    pub fn split_for_cross(&self) -> Result<(Tensor, Option<Tensor>, Tensor, Option<Tensor>)> {
        let (h, kvh, hd, vhd) = (
            self.dims.heads,
            self.dims.kv_heads,
            self.dims.head_dim,
            self.dims.v_head_dim,
        );
        match &self.qkv {
            QkvProjection::Fused { weight_t, bias } => {
                let q_rows = h * hd;
                let kv_rows = kvh * (hd + vhd);
                let w = weight_t.tensor()?; // (hidden, q+k+v)
                let wq = w.narrow(1, 0, q_rows)?; // (hidden, q)
                let wkv = w.narrow(1, q_rows, kv_rows)?; // (hidden, k+v)
                let (bq, bkv) = match bias {
                    Some(b) => (
                        Some(b.narrow(0, 0, q_rows)?),
                        Some(b.narrow(0, q_rows, kv_rows)?),
                    ),
                    None => (None, None),
                };
                Ok((wq, bq, wkv, bkv))
            }
            QkvProjection::Separate { q, k, v } => {
                let wkv = Tensor::cat(&[&k.weight, &v.weight], 0)?.t()?; // (kv_hidden, k+v)
                let bkv = match (&k.bias, &v.bias) {
                    (None, None) => None,
                    (kb, vb) => {
                        let dtype = k.weight.dtype();
                        let dev = k.weight.device();
                        let kb = match kb {
                            Some(b) => b.clone(),
                            None => Tensor::zeros(kvh * hd, dtype, dev)?,
                        };
                        let vb = match vb {
                            Some(b) => b.clone(),
                            None => Tensor::zeros(kvh * vhd, dtype, dev)?,
                        };
                        Some(Tensor::cat(&[kb, vb], 0)?)
                    }
                };
                Ok((q.weight.t()?, q.bias.clone(), wkv, bkv))
            }
        }
    }
}

/// The Q/K/V biases of `LinearWeights` as one `(q + k + v,)` vector ([`fused_bias`]).
fn linear_biases(
    q: &LinearWeights,
    k: &LinearWeights,
    v: &LinearWeights,
) -> Result<Option<Tensor>> {
    fused_bias(
        [
            (q.bias.clone(), q.weight.dim(0)?),
            (k.bias.clone(), k.weight.dim(0)?),
            (v.bias.clone(), v.weight.dim(0)?),
        ],
        q.weight.dtype(),
        q.weight.device(),
    )
}

/// `y + b` (`y` unchanged without a bias).
///
/// # Shapes
/// - `y`: `(n, out)`, `bias`: `(out,)`
fn add_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
        None => y,
    })
}

/// `x W + b` for a weight already in `(in, out)` form.
///
/// # Shapes
/// - `x`: `(n, in)`, `weight_t`: `(in, out)`, `bias`: `(out,)`; returns `(n, out)`
pub(crate) fn linear_in_out(
    x: &Tensor,
    weight_t: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let y = x.matmul(weight_t)?;
    Ok(match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// The fused `(q + k + v,)` bias of three projections `(bias, outputs)` whose biases may be
/// missing (zeros in their place); `None` when none has one.
pub(crate) fn fused_bias(
    parts: [(Option<Tensor>, usize); 3],
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if parts.iter().all(|(b, _)| b.is_none()) {
        return Ok(None);
    }
    let all = parts
        .into_iter()
        .map(|(b, n)| match b {
            Some(b) => Ok(b),
            None => Ok(Tensor::zeros(n, dtype, device)?),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(Tensor::cat(&all, 0)?))
}

/// `x W^T + b`.
///
/// # Shapes
/// - `x`: `(n, in)`, `weight`: `(out, in)`, `bias`: `(out,)`; returns `(n, out)`
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&weight.t()?)?;
    Ok(match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}
