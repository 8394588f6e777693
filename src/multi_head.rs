//! Multi-head self-attention (and cross-attention) with fused Q/K/V projections.

use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;

use crate::config::AttentionConfig;
use crate::cost::{layer_cost, AttentionCost, LayerDims};
use crate::dispatch::{self, Call, Route};
use crate::error::{Error, Result};
use crate::kernels::gemv::one_row_linear;
use crate::kernels::trainable_layer::LayerShape;
use crate::kernels::{self_attention, WeightsBlock, WeightsMode};
use crate::layer_op;
use crate::layout::{LinearWeights, PackedQkv, Projections};
use crate::mask::AttentionMask;
use crate::output::AttentionOutput;
use crate::sdpa::{self, scaled_dot_product_attention_streamed, AttentionPath};
use crate::sdpa_op::{self, PackedSizes};
use crate::stored_weight::StoredWeight;

/// Q, K and V projections. Fused into one matrix at load time whenever the three read the
/// same input width, so self-attention takes one matrix multiply.
#[derive(Debug, Clone)]
enum QkvProjection {
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
struct OutProjection {
    /// `(heads * v_head_dim, out)`: `W_O^T`.
    weight_t: StoredWeight,
    /// The caller's `(out, in)` tensor, kept for a trainable layer.
    weight: Option<Tensor>,
    /// `(out,)`
    bias: Option<Tensor>,
}

/// Multi-head attention: `concat(head_1..head_h) W_O` with
/// `head_i = softmax(Q_i K_i^T / sqrt(d_head) + mask) V_i`.
///
/// Supports grouped key/value heads (`num_kv_heads` dividing `num_heads`), optional biases,
/// optional causal masking, self-attention ([`MultiHeadSelfAttention::forward`]) and
/// cross-attention ([`MultiHeadSelfAttention::cross_attention`]). Implements
/// [`candle_core::Module`] (context only).
///
/// On the CPU with f32 weights, self-attention runs as one fused pass: the Q/K/V projection
/// (one matrix multiply, bias fused), the attention kernels reading the heads in place out of
/// it and writing the context already merged, then `W_O`; the tiled kernel (memory linear in
/// the sequence) when no weights are asked for. [`AttentionPath::Explicit`] (see
/// [`MultiHeadSelfAttention::with_path`]) runs the explicit composition of candle ops instead.
///
/// Built from tensors that track gradients (variables of a `VarMap`, see
/// [`AttentionConfig::with_hidden_size`] for a fresh layer), the layer keeps them as they are
/// (no fused or packed copy) and every call is differentiable: gradients reach the variables
/// in their checkpoint layout, and what an optimizer writes into them is what the next call
/// reads. [`crate::dispatch`] tells which implementation runs a call.
#[derive(Debug, Clone)]
pub struct MultiHeadSelfAttention {
    qkv: QkvProjection,
    out_proj: Option<OutProjection>,
    hidden: usize,
    kv_hidden: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    v_head_dim: usize,
    causal: bool,
    scale: Option<f64>,
    path: AttentionPath,
    /// For a trainable layer whose checkpoint stores Q, K and V as one tensor: that tensor,
    /// which the differentiable CPU layer multiplies by as it is.
    packed_qkv: Option<PackedQkv>,
}

impl MultiHeadSelfAttention {
    /// Loads the layer from a checkpoint; `vb` points at the attention prefix
    /// (e.g. `encoder.layer.3.attention` for BERT). Sizes come from the tensors.
    ///
    /// With the sizes stated ([`AttentionConfig::with_hidden_size`]), every tensor is read with
    /// its full shape, and a `VarBuilder` that makes variables (`VarBuilder::from_varmap`)
    /// creates the missing ones under the layout's checkpoint names with candle-nn's default
    /// initialisation: a fresh, trainable layer that `VarMap::save` writes as a checkpoint.
    pub fn load(vb: VarBuilder, cfg: &AttentionConfig) -> Result<Self> {
        let sizes = cfg.sizes()?;
        let (projections, packed) = cfg.layout.load_with_packed(&vb, sizes.as_ref())?;
        let cfg = match sizes {
            Some(z) => cfg.clone().with_kv_heads(z.kv_heads),
            None => cfg.clone(),
        };
        let mut layer = Self::new(projections, &cfg)?;
        if layer.is_trainable() && !layer.is_fused() {
            layer.packed_qkv = packed;
        }
        Ok(layer)
    }

    /// Builds the layer from projection tensors, checking every size.
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
                if heads % n != 0 {
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
                if k_out % head_dim != 0 || heads % (k_out / head_dim).max(1) != 0 || k_out == 0 {
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
            let bias = if p.q.bias.is_none() && p.k.bias.is_none() && p.v.bias.is_none() {
                None
            } else {
                let or_zeros = |l: &LinearWeights, n: usize| -> Result<Tensor> {
                    match &l.bias {
                        Some(b) => Ok(b.clone()),
                        None => Ok(Tensor::zeros(n, dtype, l.weight.device())?),
                    }
                };
                Some(Tensor::cat(
                    &[
                        or_zeros(&p.q, q_out)?,
                        or_zeros(&p.k, k_out)?,
                        or_zeros(&p.v, v_out)?,
                    ],
                    0,
                )?)
            };
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
            hidden,
            kv_hidden: k_in,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            v_head_dim,
            causal: cfg.causal,
            scale: cfg.scale,
            path: AttentionPath::Auto,
            packed_qkv: None,
        })
    }

    /// Chooses the implementation ([`AttentionPath::Auto`] by default; `Explicit` is the
    /// reference composition of candle ops).
    pub fn with_path(mut self, path: AttentionPath) -> Self {
        self.path = path;
        self
    }

    /// The implementation this layer runs.
    pub fn path(&self) -> AttentionPath {
        self.path
    }

    /// Number of weights and biases of the Q, K, V and output projections.
    pub fn parameter_count(&self) -> Result<u64> {
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

    /// Parameters and forward FLOPs of one call on `batch` sequences of `seq_q` queries and
    /// `seq_k` keys (`seq_k == seq_q` for self-attention); with `causal`, only the visible
    /// (query, key) pairs are counted. See [`AttentionCost`].
    pub fn cost(
        &self,
        batch: usize,
        seq_q: usize,
        seq_k: usize,
        causal: bool,
    ) -> Result<AttentionCost> {
        let bias = match &self.qkv {
            QkvProjection::Fused { bias, .. } => bias.is_some(),
            QkvProjection::Separate { q, .. } => q.bias.is_some(),
        };
        let dims = LayerDims {
            hidden: self.hidden,
            kv_hidden: self.kv_hidden,
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            v_head_dim: self.v_head_dim,
            out: match &self.out_proj {
                Some(o) => Some(o.weight_t.dims()?.1),
                None => None,
            },
            bias,
        };
        let mut cost = layer_cost(&dims, batch, seq_q, seq_k, causal);
        cost.parameters = self.parameter_count()?;
        Ok(cost)
    }

    /// Width of the input activations.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }
    /// Width of the output (after W_O, or `heads * v_head_dim` without it).
    pub fn output_size(&self) -> Result<usize> {
        Ok(match &self.out_proj {
            Some(o) => o.weight_t.dims()?.1,
            None => self.num_heads * self.v_head_dim,
        })
    }
    /// Query heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }
    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    /// Query/key head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Value head dimension.
    pub fn v_head_dim(&self) -> usize {
        self.v_head_dim
    }
    /// Whether self-attention is causal.
    pub fn is_causal(&self) -> bool {
        self.causal
    }
    /// Whether Q, K and V are fused into one stored matrix at load time (weights that do not
    /// track gradients and read one input width).
    pub fn is_fused(&self) -> bool {
        matches!(self.qkv, QkvProjection::Fused { .. })
    }

    /// Whether the layer's weights track gradients (variables): every call then reads them
    /// afresh and is differentiable.
    pub fn is_trainable(&self) -> bool {
        let lin = |l: &LinearWeights| dispatch::tracks(&[Some(&l.weight), l.bias.as_ref()]);
        let qkv = match &self.qkv {
            QkvProjection::Fused { bias, .. } => dispatch::tracks(&[bias.as_ref()]),
            QkvProjection::Separate { q, k, v } => lin(q) || lin(k) || lin(v),
        };
        qkv || self.out_proj.as_ref().is_some_and(|o| {
            let w = match &o.weight_t {
                StoredWeight::Tensor(t) => Some(t),
                StoredWeight::Packed(_) => None,
            };
            dispatch::tracks(&[w, o.bias.as_ref()])
        })
    }
    /// Dtype of the weights (inputs must match it).
    pub fn dtype(&self) -> DType {
        match &self.qkv {
            QkvProjection::Fused { weight_t, .. } => weight_t.dtype(),
            QkvProjection::Separate { q, .. } => q.weight.dtype(),
        }
    }

    /// Self-attention without the weights (the fast path).
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`
    /// - `mask`: see [`AttentionMask`] (combined with the causal mask when the layer is causal)
    /// - returns: `context` `(batch, seq, hidden_out)`, `weights` `None`
    pub fn forward(&self, x: &Tensor, mask: Option<&AttentionMask>) -> Result<AttentionOutput> {
        self.attend(x, None, mask, false)
    }

    /// Self-attention that also returns the weights.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`
    /// - returns: `context` `(batch, seq, hidden_out)`, `weights` `(batch, heads, seq, seq)`
    pub fn forward_with_weights(
        &self,
        x: &Tensor,
        mask: Option<&AttentionMask>,
    ) -> Result<AttentionOutput> {
        self.attend(x, None, mask, true)
    }

    /// Cross-attention: queries from `x`, keys and values from `kv` (a different length is
    /// fine). The layer's causal flag does not apply; pass a mask for that.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq_q, hidden)`
    /// - `kv`: `(batch, seq_k, kv_hidden)`
    /// - `mask`: e.g. [`AttentionMask::padding`] of `(batch, seq_k)`
    /// - returns: `context` `(batch, seq_q, hidden_out)`, `weights`
    ///   `(batch, heads, seq_q, seq_k)` when `need_weights`
    pub fn cross_attention(
        &self,
        x: &Tensor,
        kv: &Tensor,
        mask: Option<&AttentionMask>,
        need_weights: bool,
    ) -> Result<AttentionOutput> {
        self.attend(x, Some(kv), mask, need_weights)
    }

    /// Self-attention whose weights go to `on_block` one block of queries at a time
    /// (in order of batch, head and query) instead of being returned, so that memory stays
    /// linear in the sequence length: at `seq = 16384` with 8 heads the full weights would
    /// be 8.6 GB ([`crate::attention_weights_bytes`] tells before allocating). Each block
    /// holds exactly the rows [`MultiHeadSelfAttention::forward_with_weights`] returns.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`
    /// - each [`WeightsBlock`]: `(rows, seq)` weights of one `(batch, head)`
    /// - returns: `context` `(batch, seq, hidden_out)`, `weights` `None`
    pub fn forward_streamed(
        &self,
        x: &Tensor,
        mask: Option<&AttentionMask>,
        mut on_block: impl FnMut(WeightsBlock<'_>) -> Result<()>,
    ) -> Result<AttentionOutput> {
        self.attend_with(x, None, mask, WeightsMode::Stream(&mut on_block), true)
    }

    /// Self-attention (`kv = None`) or cross-attention, with or without the weights.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq_q, hidden)`, `kv`: `(batch, seq_k, kv_hidden)`
    /// - returns: `context` `(batch, seq_q, hidden_out)`, `weights`
    ///   `(batch, heads, seq_q, seq_k)` when `need_weights`
    pub fn attend(
        &self,
        x: &Tensor,
        kv: Option<&Tensor>,
        mask: Option<&AttentionMask>,
        need_weights: bool,
    ) -> Result<AttentionOutput> {
        let mode = if need_weights {
            WeightsMode::Return
        } else {
            WeightsMode::Skip
        };
        self.attend_with(x, kv, mask, mode, true)
    }

    /// The call behind every public one; `grad = false` computes without gradients even where
    /// inputs or weights track them (used for streamed weights next to a differentiable
    /// context).
    fn attend_with(
        &self,
        x: &Tensor,
        kv: Option<&Tensor>,
        mask: Option<&AttentionMask>,
        mode: WeightsMode<'_>,
        grad: bool,
    ) -> Result<AttentionOutput> {
        let (b, t, d) = self.check_input("x", x, self.hidden)?;
        let (h, kvh, hd, vhd) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
        );
        let causal = self.causal && kv.is_none();
        let combined;
        let mask = match (causal, mask) {
            (false, m) => m,
            (true, None) => {
                combined = AttentionMask::causal();
                Some(&combined)
            }
            (true, Some(m)) => {
                combined = AttentionMask::causal().and(m.clone());
                Some(&combined)
            }
        };
        if let Some(kv) = kv {
            let (bk, _, _) = self.check_input("kv", kv, self.kv_hidden)?;
            if bk != b {
                return Err(Error::input(
                    "kv",
                    format!("batch {b} like x"),
                    format!("batch {bk}"),
                ));
            }
        }
        let tracking = grad && (dispatch::tracks(&[Some(x), kv]) || self.is_trainable());
        if tracking {
            if let WeightsMode::Stream(f) = mode {
                // A differentiable context; the streamed blocks computed again without it.
                let out = self.attend_with(x, kv, mask, WeightsMode::Skip, true)?;
                let (xd, kvd) = (x.detach(), kv.map(Tensor::detach));
                self.attend_with(&xd, kvd.as_ref(), mask, WeightsMode::Stream(f), false)?;
                return Ok(out);
            }
        }
        let call = Call {
            device: x.device(),
            dtype: x.dtype(),
            weights: mode.kind(),
            tracking,
            mask,
            path: self.path,
        };
        // The whole layer on the CPU kernels: f32 weights they can read.
        let fused = match (&self.qkv, &self.out_proj) {
            (QkvProjection::Fused { weight_t, bias }, out) => {
                let out = match out {
                    Some(o) => o.weight_t.cpu_f32().map(Some),
                    None => Some(None),
                };
                weight_t
                    .cpu_f32()
                    .zip(out)
                    .map(|(qkv, out)| (qkv, bias, out))
            }
            _ => None,
        };
        let route = dispatch::route(&call, fused.is_some());
        if let (Route::FusedLayer, Some((qkv, bias, out))) = (route, fused) {
            let layer = self_attention::FusedLayer {
                qkv,
                qkv_bias: bias.as_ref(),
                out,
                out_bias: self.out_proj.as_ref().and_then(|o| o.bias.as_ref()),
                heads: h,
                kv_heads: kvh,
                head_dim: hd,
                v_head_dim: vhd,
                scale: self.scale.unwrap_or(1.0 / (hd as f64).sqrt()),
            };
            let (context, weights) = self_attention::forward(&layer, x, kv, mask, mode)?;
            return Ok(AttentionOutput { context, weights });
        }
        let scale = self.scale.unwrap_or(1.0 / (hd as f64).sqrt());
        if route == Route::CpuKernelsTrainable && kv.is_none() {
            // The whole layer as one differentiable op on the CPU kernels.
            let (w_qkv, qkv_t, w_o, biases) = self.layer_parameters()?;
            let shape = LayerShape {
                batch: b,
                seq: t,
                hidden: d,
                heads: h,
                kv_heads: kvh,
                head_dim: hd,
                v_head_dim: vhd,
                out: match &self.out_proj {
                    Some(o) => Some(o.weight_t.dims()?.1),
                    None => None,
                },
                scale,
                qkv_t,
                o_t: w_o.as_ref().is_some_and(|(_, t)| *t),
            };
            let w_o = w_o.as_ref().map(|(w, _)| w);
            let context = layer_op::self_attention(x, &w_qkv, w_o, &biases, shape, mask)?;
            return Ok(AttentionOutput {
                context,
                weights: None,
            });
        }
        // The projections: Q, K, V side by side in one product's rows for self-attention,
        // Q and K | V in two for cross-attention.
        let (rows, kv_rows, s) = match kv {
            None => {
                let qkv = self.qkv_rows(&x.reshape((b * t, d))?)?; // (b*t, q+k+v)
                (qkv, None, t)
            }
            Some(kv) => {
                let (_, s, dk) = kv.dims3()?; // checked above
                let (wq, bq, wkv, bkv) = self.split_for_cross()?;
                let q = linear_in_out(&x.reshape((b * t, d))?, &wq, bq.as_ref())?; // (b*t, h*hd)
                let kvp = linear_in_out(&kv.reshape((b * s, dk))?, &wkv, bkv.as_ref())?; // (b*s, kvh*(hd+vhd))
                (q, Some(kvp), s)
            }
        };
        let (ctx, weights) = if let (Route::CpuKernelsTrainable, Some(kvp)) = (route, &kv_rows) {
            // Cross-attention: heads read in place from the projections, context written
            // merged, and the backward writes straight into the projections' gradient layout.
            let sizes = PackedSizes {
                batch: b,
                seq_q: t,
                seq_k: s,
                heads: h,
                kv_heads: kvh,
                head_dim: hd,
                v_head_dim: vhd,
            };
            let context = sdpa_op::packed_cross_attention(&rows, kvp, sizes, mask, scale)?; // (b, t, h*vhd)
            (context, None)
        } else {
            let (q, k, v) = match &kv_rows {
                None => (
                    rows.narrow(1, 0, h * hd)?,                 // (b*t, h*hd)
                    rows.narrow(1, h * hd, kvh * hd)?,          // (b*t, kvh*hd)
                    rows.narrow(1, (h + kvh) * hd, kvh * vhd)?, // (b*t, kvh*vhd)
                ),
                Some(kvp) => (
                    rows.clone(),                        // (b*t, h*hd)
                    kvp.narrow(1, 0, kvh * hd)?,         // (b*s, kvh*hd)
                    kvp.narrow(1, kvh * hd, kvh * vhd)?, // (b*s, kvh*vhd)
                ),
            };
            let q = q.reshape((b, t, h, hd))?.transpose(1, 2)?; // (b, h, t, hd)
            let k = k.reshape((b, s, kvh, hd))?.transpose(1, 2)?; // (b, kvh, s, hd)
            let v = v.reshape((b, s, kvh, vhd))?.transpose(1, 2)?; // (b, kvh, s, vhd)
            let out = match mode {
                WeightsMode::Stream(f) => AttentionOutput {
                    context: scaled_dot_product_attention_streamed(
                        &q, &k, &v, mask, self.scale, f,
                    )?,
                    weights: None,
                },
                mode => sdpa::run_route(route, &q, &k, &v, mask, scale, mode)?,
            };
            let ctx = out.context.transpose(1, 2)?.reshape((b, t, h * vhd))?; // (b, t, h*vhd)
            (ctx, out.weights)
        };
        let out = self.output_rows(&ctx.reshape((b * t, h * vhd))?)?; // (b*t, out)
        let (_, o_out) = out.dims2()?;
        Ok(AttentionOutput {
            context: out.reshape((b, t, o_out))?, // (b, t, out)
            weights,
        })
    }

    fn check_input(&self, name: &str, x: &Tensor, width: usize) -> Result<(usize, usize, usize)> {
        let (b, t, d) = x.dims3().map_err(|_| {
            Error::input(
                name,
                format!("rank 3 (batch, seq, {width})"),
                format!("shape {:?}", x.dims()),
            )
        })?;
        if d != width {
            return Err(Error::input(
                name,
                format!("hidden size {width} (batch, seq, {width})"),
                format!("shape {:?}", x.dims()),
            ));
        }
        if x.dtype() != self.dtype() {
            return Err(Error::input(
                name,
                format!("dtype {:?} (the weights' dtype)", self.dtype()),
                format!("{:?}", x.dtype()),
            ));
        }
        if t == 0 || b == 0 {
            return Err(Error::input(
                name,
                "at least one sequence of at least one token",
                format!("shape {:?}", x.dims()),
            ));
        }
        Ok((b, t, d))
    }

    /// `x W_qkv^T + b`: Q, K and V side by side in one product's rows, on the weights as
    /// they are now (the packed micro-kernels or the one-row kernels where nothing tracks
    /// gradients).
    ///
    /// # Shapes
    /// - `x2`: `(rows, hidden)`; returns `(rows, q + k + v)`
    fn qkv_rows(&self, x2: &Tensor) -> Result<Tensor> {
        Ok(match &self.qkv {
            QkvProjection::Fused { weight_t, bias } => match weight_t.cpu_f32() {
                Some(w) if x2.device().is_cpu() && x2.dtype() == DType::F32 && !x2.track_op() => {
                    self_attention::linear_rows(x2, w, bias.as_ref())?
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
                if self.kv_hidden != self.hidden {
                    return Err(Error::input(
                        "x",
                        format!(
                            "cross-attention: this layer's keys/values read width {} but queries read {}",
                            self.kv_hidden, self.hidden
                        ),
                        "self-attention call",
                    ));
                }
                let w = Tensor::cat(&[&q.weight, &k.weight, &v.weight], 0)?; // (q+k+v, hidden)
                linear(x2, &w, fused_bias(q, k, v)?.as_ref())?
            }
        })
    }

    /// The heads of Q, K and V of `x`, before any position encoding: the first half of an
    /// attention call, for decoders that rotate queries and keys and keep a cache (see
    /// [`crate::LlamaModel`]). On the CPU in f32, with nothing tracking gradients, the
    /// projection runs on the packed micro-kernels.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`
    /// - returns q `(batch, heads, seq, head_dim)`, k `(batch, kv_heads, seq, head_dim)`,
    ///   v `(batch, kv_heads, seq, v_head_dim)` (views with a contiguous last dimension)
    pub fn project_qkv(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, d) = self.check_input("x", x, self.hidden)?;
        let (h, kvh, hd, vhd) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
        );
        let qkv = self.qkv_rows(&x.reshape((b * t, d))?)?; // (b*t, q+k+v)
        let q = qkv
            .narrow(1, 0, h * hd)?
            .reshape((b, t, h, hd))?
            .transpose(1, 2)?; // (b, h, t, hd)
        let k = qkv
            .narrow(1, h * hd, kvh * hd)?
            .reshape((b, t, kvh, hd))?
            .transpose(1, 2)?; // (b, kvh, t, hd)
        let v = qkv
            .narrow(1, (h + kvh) * hd, kvh * vhd)?
            .reshape((b, t, kvh, vhd))?
            .transpose(1, 2)?; // (b, kvh, t, vhd)
        Ok((q, k, v))
    }

    /// The heads merged and `W_O` applied: the second half of an attention call (see
    /// [`MultiHeadSelfAttention::project_qkv`]).
    ///
    /// # Shapes
    /// - `context`: `(batch, heads, seq, v_head_dim)`; returns `(batch, seq, hidden_out)`
    pub fn merge_heads(&self, context: &Tensor) -> Result<Tensor> {
        let (b, h, t, vhd) = context.dims4()?;
        if (h, vhd) != (self.num_heads, self.v_head_dim) {
            return Err(Error::input(
                "context",
                format!(
                    "({}, {}) heads x v_head_dim",
                    self.num_heads, self.v_head_dim
                ),
                format!("shape {:?}", context.dims()),
            ));
        }
        let ctx = context.transpose(1, 2)?.reshape((b * t, h * vhd))?; // (b*t, h*vhd)
        let out = self.output_rows(&ctx)?; // (b*t, out)
        let (_, o_out) = out.dims2()?;
        Ok(out.reshape((b, t, o_out))?) // (b, t, out)
    }

    /// `ctx W_O^T + b_O` (the rows unchanged without an output projection), on the packed
    /// micro-kernels or the one-row kernels where nothing tracks gradients.
    ///
    /// # Shapes
    /// - `ctx`: `(rows, heads * v_head_dim)`; returns `(rows, out)`
    fn output_rows(&self, ctx: &Tensor) -> Result<Tensor> {
        let Some(o) = &self.out_proj else {
            return Ok(ctx.clone());
        };
        Ok(match o.weight_t.cpu_f32() {
            Some(w) if ctx.device().is_cpu() && ctx.dtype() == DType::F32 && !ctx.track_op() => {
                self_attention::linear_rows(ctx, w, o.bias.as_ref())?
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
    fn layer_parameters(&self) -> Result<(Tensor, bool, Option<(Tensor, bool)>, Tensor)> {
        let (w_qkv, qkv_t, b_qkv) = match (&self.qkv, &self.packed_qkv) {
            (_, Some(p)) => (p.weight.clone(), p.transposed, p.bias.clone()),
            (QkvProjection::Fused { weight_t, bias }, None) => {
                (weight_t.tensor()?, true, bias.clone()) // (hidden, q+k+v)
            }
            (QkvProjection::Separate { q, k, v }, None) => (
                Tensor::cat(&[&q.weight, &k.weight, &v.weight], 0)?, // (q+k+v, hidden)
                false,
                fused_bias(q, k, v)?,
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
    fn split_for_cross(&self) -> Result<(Tensor, Option<Tensor>, Tensor, Option<Tensor>)> {
        let (h, kvh, hd, vhd) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
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

/// The Q/K/V biases as one `(q + k + v,)` vector (zeros for a missing one), or `None` when
/// none has a bias.
fn fused_bias(q: &LinearWeights, k: &LinearWeights, v: &LinearWeights) -> Result<Option<Tensor>> {
    if q.bias.is_none() && k.bias.is_none() && v.bias.is_none() {
        return Ok(None);
    }
    let or_zeros = |l: &LinearWeights| -> Result<Tensor> {
        match &l.bias {
            Some(b) => Ok(b.clone()),
            None => Ok(Tensor::zeros(
                l.weight.dim(0)?,
                l.weight.dtype(),
                l.weight.device(),
            )?),
        }
    };
    Ok(Some(Tensor::cat(
        &[or_zeros(q)?, or_zeros(k)?, or_zeros(v)?],
        0,
    )?))
}

/// `x W + b` for a weight already in `(in, out)` form.
///
/// # Shapes
/// - `x`: `(n, in)`, `weight_t`: `(in, out)`, `bias`: `(out,)`; returns `(n, out)`
fn linear_in_out(x: &Tensor, weight_t: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(weight_t)?;
    Ok(match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
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

impl Module for MultiHeadSelfAttention {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        MultiHeadSelfAttention::forward(self, xs, None)
            .map(|o| o.context)
            .map_err(Error::into_candle)
    }
}
