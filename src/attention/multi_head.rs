//! Multi-head self-attention (and cross-attention) with fused Q/K/V projections.

use candle_core::{DType, Module, Tensor, D};
use candle_nn::VarBuilder;

use crate::attention::cost::{layer_cost, AttentionCost, LayerDims};
use crate::attention::dispatch::{self, Call, Route};
use crate::attention::layer_routes::{self, LayerCall};
use crate::attention::mask::AttentionMask;
use crate::attention::output::AttentionOutput;
use crate::attention::path::AttentionPath;
use crate::attention::projections::{fused_bias, LayerProjections};
use crate::error::{Error, Result};
use crate::kernels::attend::{WeightsBlock, WeightsMode};
use crate::weights::checkpoint::Checkpoint;
use crate::weights::config::AttentionConfig;
use crate::weights::layout::Projections;
use crate::weights::stored::StoredWeight;

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
/// reads. [`crate::attention::dispatch`] tells which implementation runs a call.
#[derive(Debug, Clone)]
pub struct MultiHeadSelfAttention {
    proj: LayerProjections,
    causal: bool,
    scale: Option<f64>,
    path: AttentionPath,
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
            layer.proj.packed_qkv = packed;
        }
        Ok(layer)
    }

    /// [`MultiHeadSelfAttention::load`] for a layer that computes in f32 on this CPU's packed
    /// kernels from a checkpoint that stores its matrices in f16 or bf16: each matrix stays
    /// where the file is mapped, read in place by short inputs and packed on the first long
    /// one ([`PackedWeight::from_half`](crate::kernels::gemm::packed::PackedWeight::from_half)),
    /// so loading makes no f32 copy. `Ok(None)` where this does not apply (another dtype,
    /// device, CPU or layout, sizes stated in `cfg`, or matrices `load` would reject), and
    /// the caller loads through `load`.
    pub(crate) fn load_half_packed(
        vb: &VarBuilder,
        cfg: &AttentionConfig,
        ckpt: &Checkpoint,
    ) -> Result<Option<Self>> {
        let Some(names) = cfg.layout.separate_projections() else {
            return Ok(None);
        };
        if vb.dtype() != DType::F32 || !vb.device().is_cpu() || cfg.sizes()?.is_some() {
            return Ok(None);
        }
        let full = |name: &str, what: &str| match vb.prefix().as_str() {
            "" => format!("{name}.{what}"),
            prefix => format!("{prefix}.{name}.{what}"),
        };
        let mut parts = Vec::with_capacity(4);
        let mut keys = Vec::with_capacity(4);
        for name in names {
            let key = full(name, "weight");
            if !ckpt.contains(&key) {
                return Ok(None);
            }
            match ckpt.half_matrix(&key)? {
                Some(m) => parts.push(m),
                None => return Ok(None),
            }
            keys.push(key);
        }
        let [q, k, v, o] = [parts[0], parts[1], parts[2], parts[3]];
        let heads = cfg.num_heads;
        let hidden = q.cols;
        let head_dim = q.rows / heads.max(1);
        let kv_heads = cfg.num_kv_heads.unwrap_or(k.rows / head_dim.max(1));
        let sizes_ok = heads > 0
            && q.rows % heads == 0
            && kv_heads > 0
            && k.rows == kv_heads * head_dim
            && k.cols == hidden
            && v.cols == hidden
            && v.rows % kv_heads == 0
            && o.cols == heads * (v.rows / kv_heads);
        if !sizes_ok {
            return Ok(None);
        }
        let (Some(qkv), Some(out)) = (
            StoredWeight::from_half(ckpt.half_source(keys[..3].to_vec()), &[q.rows])?,
            StoredWeight::from_half(ckpt.half_source(keys[3..].to_vec()), &[])?,
        ) else {
            return Ok(None);
        };
        let bias = |name: &str, n: usize| -> Result<Option<Tensor>> {
            let vb = vb.pp(name);
            Ok(if vb.contains_tensor("bias") {
                Some(vb.get(n, "bias")?)
            } else {
                None
            })
        };
        let biases = [
            (bias(names[0], q.rows)?, q.rows),
            (bias(names[1], k.rows)?, k.rows),
            (bias(names[2], v.rows)?, v.rows),
        ];
        let qkv_bias = fused_bias(biases, DType::F32, vb.device())?;
        let proj = LayerProjections::from_stored(
            qkv,
            [q.rows, k.rows, v.rows],
            qkv_bias,
            Some((out, bias(names[3], o.rows)?)),
            heads,
            kv_heads,
        )?;
        let cfg = cfg.clone().with_kv_heads(kv_heads);
        Ok(Some(Self::from_projections(proj, &cfg)))
    }

    /// Builds the layer from projection tensors, checking every size.
    pub fn new(p: Projections, cfg: &AttentionConfig) -> Result<Self> {
        Ok(Self {
            proj: LayerProjections::new(p, cfg)?,
            causal: cfg.causal,
            scale: cfg.scale,
            path: AttentionPath::Auto,
        })
    }

    /// A layer on projections built elsewhere (GGUF weights in their blocks, say).
    pub(crate) fn from_projections(proj: LayerProjections, cfg: &AttentionConfig) -> Self {
        Self {
            proj,
            causal: cfg.causal,
            scale: cfg.scale,
            path: AttentionPath::Auto,
        }
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
        self.proj.parameter_count()
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
        let dims = LayerDims {
            head: self.proj.dims,
            out: self.proj.out_width()?,
            bias: self.proj.has_bias(),
        };
        let mut cost = layer_cost(&dims, batch, seq_q, seq_k, causal);
        cost.parameters = self.parameter_count()?;
        Ok(cost)
    }

    /// Width of the input activations.
    pub fn hidden_size(&self) -> usize {
        self.proj.dims.hidden
    }
    /// Width of the output (after W_O, or `heads * v_head_dim` without it).
    pub fn output_size(&self) -> Result<usize> {
        let d = self.proj.dims;
        Ok(self.proj.out_width()?.unwrap_or(d.heads * d.v_head_dim))
    }
    /// Query heads.
    pub fn num_heads(&self) -> usize {
        self.proj.dims.heads
    }
    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.proj.dims.kv_heads
    }
    /// Query/key head dimension.
    pub fn head_dim(&self) -> usize {
        self.proj.dims.head_dim
    }
    /// Value head dimension.
    pub fn v_head_dim(&self) -> usize {
        self.proj.dims.v_head_dim
    }
    /// Whether self-attention is causal.
    pub fn is_causal(&self) -> bool {
        self.causal
    }
    /// Whether Q, K and V are fused into one stored matrix at load time (weights that do not
    /// track gradients and read one input width).
    pub fn is_fused(&self) -> bool {
        self.proj.is_fused()
    }

    /// Whether the layer's weights track gradients (variables): every call then reads them
    /// afresh and is differentiable.
    pub fn is_trainable(&self) -> bool {
        self.proj.is_trainable()
    }
    /// Dtype of the weights (inputs must match it).
    pub fn dtype(&self) -> DType {
        self.proj.dtype()
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
        let (b, _, _) = self.check_input("x", x, self.proj.dims.hidden)?;
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
            let (bk, _, _) = self.check_input("kv", kv, self.proj.dims.kv_hidden)?;
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
            weights: dispatch::weights_of(&mode),
            tracking,
            mask,
            path: self.path,
        };
        let layer_call = LayerCall {
            x,
            kv,
            mask,
            scale: self.scale_or_default(),
        };
        match dispatch::route(&call, self.proj.fused_weights().is_some()) {
            Route::FusedLayer => layer_routes::fused(&self.proj, layer_call, mode),
            Route::CpuKernelsTrainable if kv.is_none() => {
                layer_routes::trainable_self(&self.proj, layer_call)
            }
            route => layer_routes::composed(route, &self.proj, layer_call, mode),
        }
    }

    /// The configured score scale (`None`: `1 / sqrt(head_dim)`).
    pub(crate) fn scale(&self) -> Option<f64> {
        self.scale
    }

    /// The score scale: the configured one or `1 / sqrt(head_dim)`.
    fn scale_or_default(&self) -> f64 {
        self.scale
            .unwrap_or(1.0 / (self.proj.dims.head_dim as f64).sqrt())
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
        let (b, t, d) = self.check_input("x", x, self.proj.dims.hidden)?;
        let dims = self.proj.dims;
        let (h, kvh, hd, vhd) = (dims.heads, dims.kv_heads, dims.head_dim, dims.v_head_dim);
        let qkv = self.proj.qkv_rows(&x.reshape((b * t, d))?)?; // (b*t, q+k+v)
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

    /// The score scale: the configured one or `1 / sqrt(head_dim)`.
    pub(crate) fn score_scale(&self) -> f64 {
        self.scale_or_default()
    }

    /// `‖f_h(x_j)‖` for every head `h` and position `j`: the norm of `x_j`'s value carried
    /// through the head's slice of `W_O`, `f_h(x_j) = (x_j W_V^h + b_V^h) W_O^h` (no output
    /// bias), what head `h` can move of token `j` (Kobayashi et al. 2020). Without `W_O`, the
    /// value's norm. Query heads read their group's key/value head.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`; returns `(batch, heads, seq)` f32
    pub fn value_output_norms(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, v) = self.project_qkv(x)?; // (b, kvh, t, vhd)
        let (b, kvh, t, vhd) = v.dims4()?;
        let h = self.proj.dims.heads;
        let v = v
            .to_dtype(DType::F32)?
            .unsqueeze(2)?
            .expand((b, kvh, h / kvh, t, vhd))?
            .reshape((b, h, t, vhd))?; // (b, h, t, vhd): query head h reads kv head h / group
        let f = match &self.proj.out_proj {
            Some(o) => {
                let w = o.weight_t.tensor()?.to_dtype(DType::F32)?; // (h * vhd, out)
                let out = w.dim(1)?;
                let w = w.reshape((h, vhd, out))?.unsqueeze(0)?; // (1, h, vhd, out)
                v.broadcast_matmul(&w)? // (b, h, t, out)
            }
            None => v,
        };
        Ok(f.sqr()?.sum(D::Minus1)?.sqrt()?)
    }

    /// The heads merged and `W_O` applied: the second half of an attention call (see
    /// [`MultiHeadSelfAttention::project_qkv`]).
    ///
    /// # Shapes
    /// - `context`: `(batch, heads, seq, v_head_dim)`; returns `(batch, seq, hidden_out)`
    pub fn merge_heads(&self, context: &Tensor) -> Result<Tensor> {
        let (b, h, t, vhd) = context.dims4()?;
        let dims = self.proj.dims;
        if (h, vhd) != (dims.heads, dims.v_head_dim) {
            return Err(Error::input(
                "context",
                format!("({}, {}) heads x v_head_dim", dims.heads, dims.v_head_dim),
                format!("shape {:?}", context.dims()),
            ));
        }
        let ctx = context.transpose(1, 2)?.reshape((b * t, h * vhd))?; // (b*t, h*vhd)
        let out = self.proj.output_rows(&ctx)?; // (b*t, out)
        let (_, o_out) = out.dims2()?;
        Ok(out.reshape((b, t, o_out))?) // (b, t, out)
    }
}

impl Module for MultiHeadSelfAttention {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        MultiHeadSelfAttention::forward(self, xs, None)
            .map(|o| o.context)
            .map_err(Error::into_candle)
    }
}
