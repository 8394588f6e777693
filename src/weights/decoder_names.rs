//! GPT-2 and GPT-NeoX checkpoints seen with the decoder's (LLaMA's) names: the one place
//! where their tensors are renamed and re-shaped, as TransformerLens' `convert_gpt2_weights`
//! / `convert_neox_weights` do, so that the model code is the one that loads LLaMA.
//!
//! - GPT-2 (`transformer.` or no prefix): `Conv1D` weights stored `(in, out)` are transposed;
//!   `c_attn`'s columns are the query's, the key's and the value's one after the other.
//! - GPT-NeoX (`gpt_neox.`): `query_key_value`'s rows are laid out per head (head `h`'s query,
//!   key and value rows, then head `h + 1`'s), as transformers views them
//!   `(heads, 3 * head_dim)`.

use std::collections::BTreeSet;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

use crate::error::{Error, Result};
use crate::weights::checkpoint::{of_shape, Checkpoint};

/// Which renaming a family's checkpoints need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renaming {
    /// GPT-2's names and `Conv1D` layout.
    Gpt2,
    /// GPT-NeoX's names and per-head fused rows.
    GptNeoX,
}

/// Where a LLaMA-named tensor comes from.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    /// The tensor as stored.
    Same(String),
    /// A `Conv1D` weight `(in, out)`, transposed to `(out, in)`.
    Transposed(String),
    /// Part `part` of three equal column blocks of a `Conv1D` weight `(in, 3 out)`,
    /// transposed; of a bias `(3 out,)`, the part.
    Third { name: String, part: usize },
    /// Part `part` (query, key, value) of each head's `3 * head_dim` rows.
    HeadRows { name: String, part: usize },
}

impl Source {
    fn name(&self) -> &str {
        match self {
            Source::Same(n) | Source::Transposed(n) => n,
            Source::Third { name, .. } | Source::HeadRows { name, .. } => name,
        }
    }
}

impl Renaming {
    /// The prefix the base model's tensors sit under in `names` (`transformer.`, or `""` for
    /// GPT-2's original files; `gpt_neox.`).
    fn root(&self, has: impl Fn(&str) -> bool) -> &'static str {
        match self {
            Renaming::Gpt2 if has("transformer.wte.weight") => "transformer.",
            Renaming::Gpt2 => "",
            Renaming::GptNeoX if has("gpt_neox.embed_in.weight") => "gpt_neox.",
            Renaming::GptNeoX => "",
        }
    }

    /// The source of the LLaMA-named tensor `hf`, under `root`.
    fn source(&self, hf: &str, root: &str) -> Option<Source> {
        let same = |n: &str| Some(Source::Same(format!("{root}{n}")));
        let (top, layer) = match hf.strip_prefix("model.layers.") {
            Some(rest) => {
                let (i, part) = rest.split_once('.')?;
                (None, Some((i.parse::<usize>().ok()?, part)))
            }
            None => (Some(hf), None),
        };
        if let Some(top) = top {
            return match (self, top) {
                (Renaming::Gpt2, "model.embed_tokens.weight") => same("wte.weight"),
                (Renaming::Gpt2, "model.embed_positions.weight") => same("wpe.weight"),
                (Renaming::Gpt2, "model.norm.weight") => same("ln_f.weight"),
                (Renaming::Gpt2, "model.norm.bias") => same("ln_f.bias"),
                (Renaming::Gpt2, "lm_head.weight") => Some(Source::Same("lm_head.weight".into())),
                (Renaming::GptNeoX, "model.embed_tokens.weight") => same("embed_in.weight"),
                (Renaming::GptNeoX, "model.norm.weight") => same("final_layer_norm.weight"),
                (Renaming::GptNeoX, "model.norm.bias") => same("final_layer_norm.bias"),
                (Renaming::GptNeoX, "lm_head.weight") => {
                    Some(Source::Same("embed_out.weight".into()))
                }
                _ => None,
            };
        }
        let (i, part) = layer?;
        let (stem, what) = part.rsplit_once('.')?;
        if !matches!(what, "weight" | "bias") {
            return None;
        }
        let qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"];
        match self {
            Renaming::Gpt2 => {
                let l = format!("{root}h.{i}.");
                let conv = |n: &str| match what {
                    "weight" => Some(Source::Transposed(format!("{l}{n}.weight"))),
                    _ => Some(Source::Same(format!("{l}{n}.bias"))),
                };
                match stem {
                    "input_layernorm" => Some(Source::Same(format!("{l}ln_1.{what}"))),
                    "post_attention_layernorm" => Some(Source::Same(format!("{l}ln_2.{what}"))),
                    "self_attn.o_proj" => conv("attn.c_proj"),
                    "mlp.up_proj" => conv("mlp.c_fc"),
                    "mlp.down_proj" => conv("mlp.c_proj"),
                    s => qkv.iter().position(|p| *p == s).map(|part| Source::Third {
                        name: format!("{l}attn.c_attn.{what}"),
                        part,
                    }),
                }
            }
            Renaming::GptNeoX => {
                let l = format!("{root}layers.{i}.");
                let named = |n: &str| Some(Source::Same(format!("{l}{n}.{what}")));
                match stem {
                    "input_layernorm" | "post_attention_layernorm" => named(stem),
                    "self_attn.o_proj" => named("attention.dense"),
                    "mlp.up_proj" => named("mlp.dense_h_to_4h"),
                    "mlp.down_proj" => named("mlp.dense_4h_to_h"),
                    s => qkv
                        .iter()
                        .position(|p| *p == s)
                        .map(|part| Source::HeadRows {
                            name: format!("{l}attention.query_key_value.{what}"),
                            part,
                        }),
                }
            }
        }
    }

    /// The checkpoint names the LLaMA-named `expected` come from, and the buffers a
    /// checkpoint of the family may hold beside them (never read).
    pub(crate) fn sources<'a>(
        &self,
        expected: impl Iterator<Item = &'a String>,
        names: &BTreeSet<&str>,
    ) -> BTreeSet<String> {
        let root = self.root(|n| names.contains(n));
        let mut out: BTreeSet<String> = expected
            .filter_map(|hf| self.source(hf, root))
            .map(|s| s.name().to_string())
            .collect();
        let buffers: &[&str] = match self {
            Renaming::Gpt2 => &[".attn.bias", ".attn.masked_bias"],
            Renaming::GptNeoX => &[
                ".attention.bias",
                ".attention.masked_bias",
                ".attention.rotary_emb.inv_freq",
            ],
        };
        out.extend(
            names
                .iter()
                .filter(|n| buffers.iter().any(|b| n.ends_with(b)))
                .map(|n| n.to_string()),
        );
        out
    }
}

/// A checkpoint of a renamed family under LLaMA's names (a `VarBuilder` backend).
pub(crate) struct RenamedWeights {
    ckpt: Checkpoint,
    renaming: Renaming,
    root: &'static str,
    /// Query heads and features per head (GPT-NeoX's rows are laid out per head).
    heads: usize,
    head_dim: usize,
}

impl RenamedWeights {
    pub(crate) fn new(ckpt: Checkpoint, renaming: Renaming, heads: usize, head_dim: usize) -> Self {
        let root = renaming.root(|n| ckpt.contains(n));
        Self {
            ckpt,
            renaming,
            root,
            heads,
            head_dim,
        }
    }

    fn load(&self, hf: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let source = self
            .renaming
            .source(hf, self.root)
            .filter(|s| self.ckpt.contains(s.name()))
            .ok_or_else(|| self.ckpt.missing(hf))?;
        let t = self.ckpt.tensor(source.name(), &Device::Cpu)?;
        let t = match &source {
            Source::Same(_) => t,
            Source::Transposed(_) => t.t()?.contiguous()?,
            Source::Third { part, .. } => {
                let axis = t.rank() - 1; // columns of `(in, 3 out)`, or the bias
                let n = t.dim(axis)? / 3;
                let third = t.narrow(axis, part * n, n)?;
                match t.rank() {
                    2 => third.t()?.contiguous()?, // (out, in)
                    _ => third.contiguous()?,
                }
            }
            Source::HeadRows { part, .. } => {
                let (h, hd) = (self.heads, self.head_dim);
                if t.dim(0)? != 3 * h * hd {
                    return Err(Error::ShapeMismatch {
                        tensor: source.name().to_string(),
                        expected: format!("({} rows, ...) for {h} heads of {hd}", 3 * h * hd),
                        found: t.dims().to_vec(),
                    });
                }
                let rest: Vec<usize> = t.dims()[1..].to_vec();
                let mut shape = vec![h, 3, hd];
                shape.extend(&rest);
                let per_head = t.reshape(shape)?; // (h, 3, hd, ...)
                let mut out = vec![h * hd];
                out.extend(&rest);
                per_head.narrow(1, *part, 1)?.contiguous()?.reshape(out)?
            }
        };
        Ok(t.to_dtype(dtype)?.to_device(device)?)
    }
}

impl SimpleBackend for RenamedWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.load(name, dtype, dev).map_err(Error::into_candle)?;
        of_shape(t, &s, || match self.renaming.source(name, self.root) {
            Some(src) => format!("{} (`{name}`)", src.name()),
            None => name.to_string(),
        })
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.load(name, dtype, dev).map_err(Error::into_candle)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.renaming
            .source(name, self.root)
            .is_some_and(|s| self.ckpt.contains(s.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_the_families_checkpoints() {
        let gpt2 = |hf: &str| Renaming::Gpt2.source(hf, "transformer.");
        assert_eq!(
            gpt2("model.layers.3.self_attn.k_proj.weight"),
            Some(Source::Third {
                name: "transformer.h.3.attn.c_attn.weight".into(),
                part: 1
            })
        );
        assert_eq!(
            gpt2("model.layers.0.mlp.down_proj.weight"),
            Some(Source::Transposed(
                "transformer.h.0.mlp.c_proj.weight".into()
            ))
        );
        assert_eq!(
            gpt2("model.embed_positions.weight"),
            Some(Source::Same("transformer.wpe.weight".into()))
        );
        let neox = |hf: &str| Renaming::GptNeoX.source(hf, "gpt_neox.");
        assert_eq!(
            neox("model.layers.1.self_attn.v_proj.bias"),
            Some(Source::HeadRows {
                name: "gpt_neox.layers.1.attention.query_key_value.bias".into(),
                part: 2
            })
        );
        assert_eq!(
            neox("lm_head.weight"),
            Some(Source::Same("embed_out.weight".into()))
        );
        assert_eq!(neox("model.layers.1.self_attn.q_norm.weight"), None);
    }

    /// GPT-NeoX's per-head rows: head `h`'s query rows are rows `h * 3 hd ..` of the fused
    /// tensor, its key rows the next `hd`, its value rows the next.
    #[test]
    fn neox_rows_are_taken_per_head() -> Result<()> {
        let (h, hd, d) = (2, 3, 2);
        let fused: Vec<f32> = (0..3 * h * hd * d).map(|i| i as f32).collect();
        let tensors = std::collections::HashMap::from([(
            "gpt_neox.layers.0.attention.query_key_value.weight".to_string(),
            Tensor::from_vec(fused, (3 * h * hd, d), &Device::Cpu)?,
        )]);
        let bytes = safetensors::tensor::serialize(tensors, None)
            .map_err(|e| Error::Kernel(e.to_string()))?;
        let ckpt = Checkpoint::from_bytes(bytes, "neox.safetensors")?;
        // The root is found by the embeddings, absent here: stated.
        let w = RenamedWeights {
            ckpt,
            renaming: Renaming::GptNeoX,
            root: "gpt_neox.",
            heads: h,
            head_dim: hd,
        };
        let k = w.load(
            "model.layers.0.self_attn.k_proj.weight",
            DType::F32,
            &Device::Cpu,
        )?;
        let rows: Vec<Vec<f32>> = k.to_vec2()?;
        // Head 0's key rows are fused rows 3..6, head 1's rows 12..15.
        let want: Vec<Vec<f32>> = [3, 4, 5, 12, 13, 14]
            .iter()
            .map(|&r| vec![(r * d) as f32, (r * d + 1) as f32])
            .collect();
        assert_eq!(rows, want);
        Ok(())
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;
    use crate::weights::layout::{LayerSizes, WeightLayout};
    use candle_nn::VarBuilder;

    /// `WeightLayout::GptNeoX` (a Candle user's layer on Pythia's own names) reads the same
    /// projections as the decoder's renaming of the same checkpoint.
    #[test]
    fn the_gpt_neox_layout_equals_the_renamed_checkpoint() -> Result<()> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/decoders/pythia/model.safetensors");
        let ckpt = Checkpoint::open(&path)?;
        let (d, heads) = (64, 4);
        let sizes = LayerSizes {
            hidden: d,
            heads,
            kv_heads: heads,
            head_dim: d / heads,
            v_head_dim: d / heads,
            bias: true,
        };
        let vb = ckpt.var_builder(DType::F32, &Device::Cpu);
        let p = WeightLayout::GptNeoX
            .load_sized(&vb.pp("gpt_neox.layers.1.attention"), Some(&sizes))?;
        let renamed = RenamedWeights::new(ckpt.clone(), Renaming::GptNeoX, heads, d / heads);
        let rvb = VarBuilder::from_backend(Box::new(renamed), DType::F32, Device::Cpu);
        let a = rvb.pp("model.layers.1.self_attn");
        for (got, name) in [(&p.q, "q_proj"), (&p.k, "k_proj"), (&p.v, "v_proj")] {
            let want = a.pp(name).get((d, d), "weight")?;
            let diff = (&got.weight - &want)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{name} weight");
            let want_b = a.pp(name).get(d, "bias")?;
            let got_b = got
                .bias
                .as_ref()
                .ok_or_else(|| Error::Kernel("no bias".into()))?;
            let diff = (got_b - &want_b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{name} bias");
        }
        Ok(())
    }
}
