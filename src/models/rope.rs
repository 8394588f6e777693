//! Rotary position embeddings (RoPE), configured as Hugging Face `config.json` files hold
//! them: `rope_theta` with `rope_scaling` (the older form most hub checkpoints use) or
//! `rope_parameters` (newer transformers), `head_dim`, `partial_rotary_factor`; the
//! half-rotation layout of HF LLaMA (`rotate_half`) and the interleaved one (GPT-J,
//! llama.cpp); scaling types `default`, `linear` and `llama3`.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::error::{Error, Result};

/// Which pairs of features a rotation turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Feature `i` with feature `i + d / 2` (HF LLaMA's `rotate_half`).
    Half,
    /// Feature `2i` with feature `2i + 1` (GPT-J, llama.cpp).
    Interleaved,
}

/// How the rotation frequencies are scaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `theta^(-2i / d)`.
    Default,
    /// Frequencies divided by `factor` (positions interpolated).
    Linear {
        /// The positions' divisor.
        factor: f64,
    },
    /// LLaMA 3.1's frequency-dependent scaling.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` stay as they are.
        high_freq_factor: f64,
        /// The context the model was first trained for.
        original_max_position_embeddings: usize,
    },
    /// Each frequency divided by its own factor: how llama.cpp's files store LLaMA 3.1's
    /// scaling (the `rope_freqs` tensor, `rotary_dim / 2` factors).
    Factors {
        /// One divisor per frequency.
        factors: Vec<f32>,
    },
}

/// The rotary configuration of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// Base of the frequencies (`rope_theta`).
    pub theta: f64,
    /// Features per head (`head_dim`).
    pub head_dim: usize,
    /// Features rotated, the first `rotary_dim` of each head (`partial_rotary_factor *
    /// head_dim`); the rest pass through.
    pub rotary_dim: usize,
    /// How the frequencies are scaled (`rope_scaling` / `rope_parameters`).
    pub scaling: RopeScaling,
    /// Which features are rotated together.
    pub layout: RopeLayout,
}

fn number(v: &Value, key: &str, what: &str) -> Result<f64> {
    v.get(key).and_then(Value::as_f64).ok_or_else(|| {
        Error::config(format!(
            "`{what}` of type `{}` needs a number `{key}`",
            v.get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("?")
        ))
    })
}

impl RopeConfig {
    /// The rotary configuration of a `config.json` (parsed as JSON): `rope_parameters`
    /// (newer transformers) or `rope_theta` + `rope_scaling` (older form), with `head_dim`
    /// (default `hidden_size / num_attention_heads`) and `partial_rotary_factor` (default 1).
    pub fn from_hf_json(cfg: &Value, layout: RopeLayout) -> Result<Self> {
        let usize_of = |k: &str| cfg.get(k).and_then(Value::as_u64).map(|v| v as usize);
        let head_dim = match usize_of("head_dim") {
            Some(d) => d,
            None => {
                let hidden = usize_of("hidden_size")
                    .ok_or_else(|| Error::config("`hidden_size` is missing"))?;
                let heads = usize_of("num_attention_heads")
                    .filter(|&h| h > 0)
                    .ok_or_else(|| Error::config("`num_attention_heads` is missing"))?;
                hidden / heads
            }
        };
        // The newer form holds everything in `rope_parameters`; the older one has
        // `rope_theta` at the top and the scaling (or null) in `rope_scaling`.
        let params = cfg.get("rope_parameters").filter(|v| v.is_object());
        let scaling = params.or_else(|| cfg.get("rope_scaling").filter(|v| v.is_object()));
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| cfg.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        let partial = params
            .and_then(|p| p.get("partial_rotary_factor"))
            .or_else(|| cfg.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .unwrap_or(1.0);
        let kind = scaling
            .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let scaling = match (kind, scaling) {
            ("default", _) | (_, None) => RopeScaling::Default,
            ("linear", Some(s)) => RopeScaling::Linear {
                factor: number(s, "factor", "rope scaling")?,
            },
            ("llama3", Some(s)) => RopeScaling::Llama3 {
                factor: number(s, "factor", "rope scaling")?,
                low_freq_factor: number(s, "low_freq_factor", "rope scaling")?,
                high_freq_factor: number(s, "high_freq_factor", "rope scaling")?,
                original_max_position_embeddings: number(
                    s,
                    "original_max_position_embeddings",
                    "rope scaling",
                )? as usize,
            },
            (other, _) => {
                return Err(Error::config(format!(
                    "rope scaling type `{other}` is not supported (default, linear, llama3)"
                )))
            }
        };
        let rotary_dim = ((head_dim as f64 * partial) as usize) & !1;
        let c = Self {
            theta,
            head_dim,
            rotary_dim,
            scaling,
            layout,
        };
        c.validate()?;
        Ok(c)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.head_dim == 0
            || self.rotary_dim == 0
            || self.rotary_dim > self.head_dim
            || !self.rotary_dim.is_multiple_of(2)
        {
            return Err(Error::config(format!(
                "rotary dims: {} of a head of {} (an even number, partial_rotary_factor in (0, 1])",
                self.rotary_dim, self.head_dim
            )));
        }
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return Err(Error::config(format!(
                "`rope_theta` must be above 1, found {}",
                self.theta
            )));
        }
        match &self.scaling {
            RopeScaling::Linear { factor } | RopeScaling::Llama3 { factor, .. }
                if !(factor.is_finite() && *factor > 0.0) =>
            {
                Err(Error::config(format!(
                    "rope scaling factor must be positive, found {factor}"
                )))
            }
            RopeScaling::Factors { factors }
                if factors.len() != self.rotary_dim / 2
                    || !factors.iter().all(|f| f.is_finite() && *f > 0.0) =>
            {
                Err(Error::config(format!(
                    "{} rope frequency factors for {} rotated features: one positive factor per frequency needed",
                    factors.len(),
                    self.rotary_dim
                )))
            }
            RopeScaling::Llama3 {
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
                ..
            } if high_freq_factor <= low_freq_factor || *original_max_position_embeddings == 0 => {
                Err(Error::config(
                    "llama3 rope scaling needs high_freq_factor > low_freq_factor and original_max_position_embeddings > 0",
                ))
            }
            _ => Ok(()),
        }
    }

    /// The `rotary_dim / 2` inverse frequencies, computed in f32 as transformers does.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.rotary_dim;
        let base = self.theta as f32;
        let mut inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        match &self.scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                let f = *factor as f32;
                inv.iter_mut().for_each(|x| *x /= f);
            }
            RopeScaling::Factors { factors } => {
                inv.iter_mut().zip(factors).for_each(|(x, f)| *x /= f);
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                );
                let old = *original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                for x in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *x;
                    if wavelen > low_wavelen {
                        *x /= factor;
                    } else if wavelen >= high_wavelen {
                        // Between the two: interpolated.
                        let smooth = (old / wavelen - low) / (high - low);
                        *x = (1.0 - smooth) * *x / factor + smooth * *x;
                    }
                }
            }
        }
        inv
    }
}

/// One position's rotation as plain values ([`RotaryEmbedding::row`]).
#[derive(Debug, Clone)]
pub(crate) struct RopeRow {
    /// The position the values are for.
    pub(crate) position: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    layout: RopeLayout,
    head_dim: usize,
    rotary_dim: usize,
}

impl RopeRow {
    /// Rotates in place the rows `x` of this position (rows of `head_dim` f32 one after
    /// another, any number of heads): the values [`RotaryEmbedding::apply`] gives, by the
    /// same expressions as candle's kernels.
    pub(crate) fn rotate(&self, x: &mut [f32]) -> Result<()> {
        let d = self.head_dim;
        let half = self.rotary_dim / 2;
        if d == 0 || !x.len().is_multiple_of(d) || self.cos.len() < half || self.sin.len() < half {
            return Err(Error::input(
                "x",
                format!("rows of head dim {d}"),
                format!("{} values", x.len()),
            ));
        }
        let (c, s) = (&self.cos[..half], &self.sin[..half]);
        for row in x.chunks_exact_mut(d) {
            for i in 0..half {
                let (j, k) = match self.layout {
                    RopeLayout::Half => (i, i + half),
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                };
                let (u, v) = (row[j], row[k]);
                row[j] = u * c[i] - v * s[i];
                row[k] = u * s[i] + v * c[i];
            }
        }
        Ok(())
    }
}

/// Cos/sin tables `(positions, rotary_dim / 2)` in f32, computed once per length and grown
/// on demand, and the rotation of queries and keys.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    cfg: RopeConfig,
    inv_freq: Vec<f32>,
    device: Device,
    tables: Arc<Mutex<Option<(Tensor, Tensor)>>>,
}

impl RotaryEmbedding {
    /// Tables for `cfg` on `device`, the first `initial_positions` computed now.
    pub fn new(cfg: RopeConfig, initial_positions: usize, device: &Device) -> Result<Self> {
        cfg.validate()?;
        let inv_freq = cfg.inv_freq();
        let rope = Self {
            cfg,
            inv_freq,
            device: device.clone(),
            tables: Arc::new(Mutex::new(None)),
        };
        rope.tables(initial_positions.max(1))?;
        Ok(rope)
    }

    /// The configuration.
    pub fn config(&self) -> &RopeConfig {
        &self.cfg
    }

    /// `(cos, sin)`, each `(n >= positions, rotary_dim / 2)` f32.
    fn tables(&self, positions: usize) -> Result<(Tensor, Tensor)> {
        let mut slot = self
            .tables
            .lock()
            .map_err(|_| Error::Kernel("rotary tables poisoned".into()))?;
        if let Some((c, s)) = slot.as_ref() {
            if c.dim(0)? >= positions {
                return Ok((c.clone(), s.clone()));
            }
        }
        // Grow by doubling, so that a long generation recomputes them O(log n) times.
        let n = positions.next_power_of_two().max(64);
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for &f in &self.inv_freq {
                // As transformers: the angle is an f32 product, its cos/sin in f32.
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (n, half), &self.device)?;
        let sin = Tensor::from_vec(sin, (n, half), &self.device)?;
        *slot = Some((cos.clone(), sin.clone()));
        Ok((cos, sin))
    }

    /// The cos/sin values of `position` as plain f32 values, to rotate one position's rows
    /// without tensors (a decode step's path: fetched once for all the layers).
    pub(crate) fn row(&self, position: usize) -> Result<RopeRow> {
        let (cos, sin) = self.tables(position + 1)?;
        let row = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.narrow(0, position, 1)?.flatten_all()?.to_vec1()?)
        };
        Ok(RopeRow {
            position,
            cos: row(&cos)?,
            sin: row(&sin)?,
            layout: self.cfg.layout,
            head_dim: self.cfg.head_dim,
            rotary_dim: self.cfg.rotary_dim,
        })
    }

    /// Rotates `x` for positions `offset..offset + seq`.
    ///
    /// # Shapes
    /// - `x`: `(batch, heads, seq, head_dim)`; returns the same shape and dtype
    pub fn apply(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        let (_, _, t, d) = x.dims4()?;
        if d != self.cfg.head_dim {
            return Err(Error::input(
                "x",
                format!("head dim {} for the rotary embedding", self.cfg.head_dim),
                format!("shape {:?}", x.dims()),
            ));
        }
        let (cos, sin) = self.tables(offset + t)?;
        let cos = cos.narrow(0, offset, t)?; // (t, rot/2)
        let sin = sin.narrow(0, offset, t)?; // (t, rot/2)
        let dtype = x.dtype();
        let r = self.cfg.rotary_dim;
        let xf = x.to_dtype(DType::F32)?;
        let (rot, pass) = if r == d {
            (xf.contiguous()?, None)
        } else {
            (
                xf.narrow(3, 0, r)?.contiguous()?, // (b, h, t, rot)
                Some(xf.narrow(3, r, d - r)?),     // (b, h, t, d - rot)
            )
        };
        // candle's fused kernels have no backward: the composed forms where gradients flow.
        let rotated = match (self.cfg.layout, rot.track_op()) {
            (RopeLayout::Half, false) => candle_nn::rotary_emb::rope(&rot, &cos, &sin)?,
            (RopeLayout::Half, true) => candle_nn::rotary_emb::rope_slow(&rot, &cos, &sin)?,
            (RopeLayout::Interleaved, false) => candle_nn::rotary_emb::rope_i(&rot, &cos, &sin)?,
            (RopeLayout::Interleaved, true) => {
                candle_nn::rotary_emb::rope_i_slow(&rot, &cos, &sin)?
            }
        };
        let out = match pass {
            Some(p) => Tensor::cat(&[&rotated, &p], 3)?,
            None => rotated,
        };
        Ok(out.to_dtype(dtype)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, in f64: pairs (i, i + r/2) or (2i, 2i + 1) turned by `p * inv_freq[i]`.
    fn reference(x: &[f32], t: usize, d: usize, cfg: &RopeConfig, offset: usize) -> Vec<f32> {
        let inv = cfg.inv_freq();
        let r = cfg.rotary_dim;
        let mut out = x.to_vec();
        for p in 0..t {
            for (i, &f) in inv.iter().enumerate() {
                let a = ((offset + p) as f32 * f) as f64;
                let (c, s) = (a.cos(), a.sin());
                let (j, k) = match cfg.layout {
                    RopeLayout::Half => (i, i + r / 2),
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                };
                let (u, v) = (x[p * d + j] as f64, x[p * d + k] as f64);
                out[p * d + j] = (u * c - v * s) as f32;
                out[p * d + k] = (u * s + v * c) as f32;
            }
        }
        out
    }

    #[test]
    fn both_layouts_and_partial_rotation_equal_the_definition() -> Result<()> {
        let (t, d) = (7, 12);
        let x: Vec<f32> = (0..t * d)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) / 7.0)
            .collect();
        for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
            for rotary_dim in [12, 8] {
                let cfg = RopeConfig {
                    theta: 10_000.0,
                    head_dim: d,
                    rotary_dim,
                    scaling: RopeScaling::Default,
                    layout,
                };
                let rope = RotaryEmbedding::new(cfg.clone(), 4, &Device::Cpu)?;
                let xt = Tensor::from_vec(x.clone(), (1, 1, t, d), &Device::Cpu)?;
                for offset in [0, 5, 100] {
                    let got: Vec<f32> = rope.apply(&xt, offset)?.flatten_all()?.to_vec1()?;
                    let want = reference(&x, t, d, &cfg, offset);
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() < 1e-5,
                            "{layout:?} r={rotary_dim} off={offset}: {g} vs {w}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn config_forms_and_scalings() -> Result<()> {
        let old: Value = serde_json::from_str(
            r#"{"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
        )
        .map_err(|e| Error::config(e.to_string()))?;
        let new: Value = serde_json::from_str(
            r#"{"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {"rope_type": "llama3",
                "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
        )
        .map_err(|e| Error::config(e.to_string()))?;
        let a = RopeConfig::from_hf_json(&old, RopeLayout::Half)?;
        assert_eq!(a, RopeConfig::from_hf_json(&new, RopeLayout::Half)?);
        assert_eq!((a.theta, a.head_dim), (500_000.0, 16));
        // LLaMA 3 leaves the high frequencies alone and divides the low ones by the factor.
        let plain = RopeConfig {
            scaling: RopeScaling::Default,
            ..a.clone()
        };
        let (s, p) = (a.inv_freq(), plain.inv_freq());
        assert_eq!(s[0], p[0]);
        assert!((s[7] - p[7] / 8.0).abs() < 1e-12);
        let linear: Value = serde_json::from_str(
            r#"{"hidden_size": 32, "num_attention_heads": 2, "head_dim": 8, "partial_rotary_factor": 0.5,
                "rope_scaling": {"type": "linear", "factor": 2.0}}"#,
        )
        .map_err(|e| Error::config(e.to_string()))?;
        let l = RopeConfig::from_hf_json(&linear, RopeLayout::Half)?;
        assert_eq!((l.head_dim, l.rotary_dim, l.theta), (8, 4, 10_000.0));
        assert_eq!(l.scaling, RopeScaling::Linear { factor: 2.0 });
        let yarn: Value = serde_json::from_str(
            r#"{"hidden_size": 32, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}"#,
        )
        .map_err(|e| Error::config(e.to_string()))?;
        let err = RopeConfig::from_hf_json(&yarn, RopeLayout::Half).expect_err("yarn");
        assert!(err.to_string().contains("`yarn`"), "{err}");
        Ok(())
    }
}
