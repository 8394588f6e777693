//! Single-head self-attention: `softmax(x W_Q^T (x W_K^T)^T / sqrt(d_k)) x W_V^T`.

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

use crate::attention::mask::AttentionMask;
use crate::attention::output::AttentionOutput;
use crate::attention::projections::linear;
use crate::attention::sdpa::{scaled_dot_product_attention, SdpaOptions};
use crate::error::{Error, Result};
use crate::weights::config::AttentionConfig;
use crate::weights::layout::{LinearWeights, WeightLayout};

/// One attention head with its own W_Q `(d_k, hidden)`, W_K `(d_k, hidden)` and W_V
/// `(d_v, hidden)`; no output projection, so the output width is `d_v` (which may differ
/// from `d_k`).
#[derive(Debug, Clone)]
pub struct SingleHeadSelfAttention {
    query: LinearWeights,
    key: LinearWeights,
    value: LinearWeights,
    hidden: usize,
    d_k: usize,
    d_v: usize,
    causal: bool,
}

impl SingleHeadSelfAttention {
    /// Loads `query`, `key`, `value` (`.weight` `(out, in)`, optional `.bias`) under `vb`;
    /// `hidden`, `d_k` and `d_v` are read from the tensors.
    pub fn load(vb: VarBuilder) -> Result<Self> {
        let p = WeightLayout::Single.load(&vb)?;
        Self::new(p.q, p.k, p.v)
    }

    /// Loads or creates the head as `cfg` states it (layout [`WeightLayout::Single`],
    /// causal flag): with the sizes stated (`with_hidden_size`, `with_head_dim` for `d_k`,
    /// `with_v_head_dim` for `d_v`), a `VarBuilder` that makes variables (a `VarMap`)
    /// creates `query`, `key` and `value` with candle-nn's default initialisation, and a
    /// checkpoint's tensors must have those shapes.
    pub fn load_with(vb: VarBuilder, cfg: &AttentionConfig) -> Result<Self> {
        if cfg.layout != WeightLayout::Single {
            return Err(Error::config(format!(
                "a single head reads the `single` layout, the config names `{}`",
                cfg.layout
            )));
        }
        let p = WeightLayout::Single.load_sized(&vb, cfg.sizes()?.as_ref())?;
        Ok(Self::new(p.q, p.k, p.v)?.with_causal(cfg.causal))
    }

    /// Builds the head from its three projections, checking their sizes.
    pub fn new(query: LinearWeights, key: LinearWeights, value: LinearWeights) -> Result<Self> {
        let (d_k, hidden) = query.dims()?;
        let (dk2, hk) = key.dims()?;
        let (d_v, hv) = value.dims()?;
        if (dk2, hk) != (d_k, hidden) {
            return Err(Error::ShapeMismatch {
                tensor: key.name.clone(),
                expected: format!("[{d_k}, {hidden}] like the query projection"),
                found: vec![dk2, hk],
            });
        }
        if hv != hidden {
            return Err(Error::ShapeMismatch {
                tensor: value.name.clone(),
                expected: format!("(d_v, {hidden})"),
                found: vec![d_v, hv],
            });
        }
        Ok(Self {
            query,
            key,
            value,
            hidden,
            d_k,
            d_v,
            causal: false,
        })
    }

    /// Makes the head causal.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Input width.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }
    /// Query/key width.
    pub fn d_k(&self) -> usize {
        self.d_k
    }
    /// Value (and output) width.
    pub fn d_v(&self) -> usize {
        self.d_v
    }

    /// Self-attention without the weights.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`
    /// - returns: `context` `(batch, seq, d_v)`
    pub fn forward(&self, x: &Tensor, mask: Option<&AttentionMask>) -> Result<AttentionOutput> {
        self.attend(x, mask, false)
    }

    /// Self-attention with the weights.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`
    /// - returns: `context` `(batch, seq, d_v)`, `weights` `(batch, 1, seq, seq)`
    pub fn forward_with_weights(
        &self,
        x: &Tensor,
        mask: Option<&AttentionMask>,
    ) -> Result<AttentionOutput> {
        self.attend(x, mask, true)
    }

    fn attend(
        &self,
        x: &Tensor,
        mask: Option<&AttentionMask>,
        need_weights: bool,
    ) -> Result<AttentionOutput> {
        let (b, t, d) = x.dims3().map_err(|_| {
            Error::input(
                "x",
                format!("rank 3 (batch, seq, {})", self.hidden),
                format!("shape {:?}", x.dims()),
            )
        })?;
        if d != self.hidden {
            return Err(Error::input(
                "x",
                format!("hidden size {}", self.hidden),
                format!("shape {:?}", x.dims()),
            ));
        }
        if x.dtype() != self.query.weight.dtype() {
            return Err(Error::input(
                "x",
                format!("dtype {:?} (the weights' dtype)", self.query.weight.dtype()),
                format!("{:?}", x.dtype()),
            ));
        }
        let x2 = x.reshape((b * t, d))?; // (b*t, hidden)
        let proj = |l: &LinearWeights, out: usize| -> Result<Tensor> {
            Ok(linear(&x2, &l.weight, l.bias.as_ref())?.reshape((b, 1, t, out))?)
            // (b, 1, t, out)
        };
        let q = proj(&self.query, self.d_k)?;
        let k = proj(&self.key, self.d_k)?;
        let v = proj(&self.value, self.d_v)?;
        let combined;
        let mask = match (self.causal, mask) {
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
        let out = scaled_dot_product_attention(
            &q,
            &k,
            &v,
            mask,
            SdpaOptions {
                scale: None,
                need_weights,
            },
        )?;
        Ok(AttentionOutput {
            context: out.context.squeeze(1)?, // (b, t, d_v)
            weights: out.weights,
        })
    }
}

impl Module for SingleHeadSelfAttention {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        SingleHeadSelfAttention::forward(self, xs, None)
            .map(|o| o.context)
            .map_err(Error::into_candle)
    }
}
