//! A sentence embedding from an encoder's last hidden states, as the model's
//! sentence-transformers pipeline makes it: `modules.json` names a `Pooling` module (its
//! `config.json`: CLS token, mean, max, mean over `sqrt(len)`, or last token) and, where it
//! lists a `Normalize` module, unit length. A directory without `modules.json` gets what
//! sentence-transformers builds for a plain checkpoint: mean pooling, not normalized. A
//! module the crate does not implement (a `Dense` projection, weighted-mean pooling, several
//! modes at once) is an error naming it.

use std::path::Path;

use candle_core::{DType, Tensor, D};
use serde_json::Value;

use crate::error::{Error, Result};

/// How the token rows become one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingMode {
    /// The first token's row (`[CLS]`, `<s>`).
    Cls,
    /// The mean over the real tokens.
    Mean,
    /// The largest value per feature over the real tokens.
    Max,
    /// The sum over the real tokens divided by `sqrt(count)`.
    MeanSqrtLen,
    /// The last real token's row.
    LastToken,
}

/// The pooling and normalization of a model's embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pooling {
    /// How the rows are pooled.
    pub mode: PoolingMode,
    /// Whether the pooled row is scaled to unit length (a `Normalize` module).
    pub normalize: bool,
}

impl Default for Pooling {
    /// Mean pooling, unit length (all-MiniLM-L6-v2's).
    fn default() -> Self {
        Self {
            mode: PoolingMode::Mean,
            normalize: true,
        }
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|cause| Error::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    serde_json::from_str(&text).map_err(|e| Error::Config {
        path: Some(path.to_path_buf()),
        message: e.to_string(),
    })
}

impl Pooling {
    /// The pooling of the model in `dir`: its `modules.json` (and the `Pooling` module's
    /// `config.json`), or, without one, sentence-transformers' default for a plain
    /// checkpoint (mean, not normalized).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let modules_path = dir.join("modules.json");
        if !modules_path.is_file() {
            return Ok(Self {
                mode: PoolingMode::Mean,
                normalize: false,
            });
        }
        let modules = read_json(&modules_path)?;
        let list = modules.as_array().ok_or_else(|| Error::Config {
            path: Some(modules_path.clone()),
            message: "`modules.json` should be a list of modules".into(),
        })?;
        let mut mode = None;
        let mut normalize = false;
        for module in list {
            let kind = module["type"].as_str().unwrap_or_default();
            let short = kind.rsplit('.').next().unwrap_or(kind);
            match short {
                "Transformer" => {}
                "Normalize" => normalize = true,
                "Pooling" => {
                    let sub = module["path"].as_str().unwrap_or_default();
                    mode = Some(Self::mode_of(&dir.join(sub).join("config.json"))?);
                }
                _ => {
                    return Err(Error::Config {
                        path: Some(modules_path.clone()),
                        message: format!(
                            "module `{kind}` is not implemented (Transformer, Pooling and \
                             Normalize are)"
                        ),
                    })
                }
            }
        }
        Ok(Self {
            // A pipeline without a Pooling module returns token rows, not sentences.
            mode: mode.ok_or_else(|| Error::Config {
                path: Some(modules_path),
                message: "no `sentence_transformers.models.Pooling` module".into(),
            })?,
            normalize,
        })
    }

    /// The mode a `Pooling` module's `config.json` sets.
    fn mode_of(path: &Path) -> Result<PoolingMode> {
        let cfg = read_json(path)?;
        let on = |key: &str| cfg[key].as_bool().unwrap_or(false);
        let refuse = |message: String| Error::Config {
            path: Some(path.to_path_buf()),
            message,
        };
        if on("pooling_mode_weightedmean_tokens") {
            return Err(refuse(
                "`pooling_mode_weightedmean_tokens` is not implemented".into(),
            ));
        }
        if cfg["include_prompt"] == Value::Bool(false) {
            return Err(refuse("`include_prompt` = false is not implemented".into()));
        }
        let modes = [
            ("pooling_mode_cls_token", PoolingMode::Cls),
            ("pooling_mode_mean_tokens", PoolingMode::Mean),
            ("pooling_mode_max_tokens", PoolingMode::Max),
            (
                "pooling_mode_mean_sqrt_len_tokens",
                PoolingMode::MeanSqrtLen,
            ),
            ("pooling_mode_lasttoken", PoolingMode::LastToken),
        ];
        let set: Vec<_> = modes.iter().filter(|(k, _)| on(k)).collect();
        match set.as_slice() {
            [(_, mode)] => Ok(*mode),
            [] => Err(refuse("no `pooling_mode_*` is set".into())),
            several => Err(refuse(format!(
                "several pooling modes at once ({}) are not implemented",
                several
                    .iter()
                    .map(|(k, _)| *k)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// The sentence embeddings of a padded batch, in f32.
    ///
    /// # Shapes
    /// - `hidden`: `(batch, seq, hidden)`, `attention_mask`: `(batch, seq)` 0/1 (padding on
    ///   the right); returns `(batch, hidden)`
    pub fn pool(&self, hidden: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let h = hidden.to_dtype(DType::F32)?;
        let (b, _, d) = h.dims3()?;
        let m = attention_mask.to_dtype(DType::F32)?; // (b, t)
        let count = m.sum_keepdim(1)?; // (b, 1)
        let pooled = match self.mode {
            PoolingMode::Cls => h.narrow(1, 0, 1)?.squeeze(1)?,
            PoolingMode::Mean | PoolingMode::MeanSqrtLen => {
                let sum = h.broadcast_mul(&m.unsqueeze(2)?)?.sum(1)?; // (b, d)
                let by = match self.mode {
                    PoolingMode::Mean => count.clamp(1e-9f32, f32::INFINITY)?,
                    _ => count.clamp(1e-9f32, f32::INFINITY)?.sqrt()?,
                };
                sum.broadcast_div(&by)?
            }
            PoolingMode::Max => {
                // Padding rows set to -1e9 first, as sentence-transformers does.
                let pad = ((m.unsqueeze(2)? - 1.0)? * 1e9)?; // 0 real, -1e9 padding
                h.broadcast_add(&pad)?.max(1)?
            }
            PoolingMode::LastToken => {
                let last: Vec<u32> = count
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|&c| (c.max(1.0) as u32) - 1)
                    .collect();
                let idx = Tensor::from_vec(last, (b, 1, 1), h.device())?
                    .broadcast_as((b, 1, d))?
                    .contiguous()?;
                h.gather(&idx, 1)?.squeeze(1)?
            }
        };
        Ok(match self.normalize {
            true => {
                let norm = pooled
                    .sqr()?
                    .sum_keepdim(D::Minus1)?
                    .sqrt()?
                    .clamp(1e-12f32, f32::INFINITY)?;
                pooled.broadcast_div(&norm)?
            }
            false => pooled,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn write(dir: &Path, name: &str, text: &str) -> Result<()> {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|cause| Error::Io {
                path: parent.to_path_buf(),
                cause,
            })?;
        }
        std::fs::write(&path, text).map_err(|cause| Error::Io { path, cause })
    }

    /// Every mode against its definition on a padded batch, normalized or not.
    #[test]
    fn modes_follow_their_definitions() -> Result<()> {
        let dev = Device::Cpu;
        let h = Tensor::new(
            &[
                [[1f32, 2.], [3., -4.], [5., 6.]],
                [[-1., 0.5], [7., 8.], [100., 100.]],
            ],
            &dev,
        )?;
        let mask = Tensor::new(&[[1u32, 1, 1], [1, 1, 0]], &dev)?;
        let run = |mode, normalize| -> Result<Vec<Vec<f32>>> {
            Ok(Pooling { mode, normalize }.pool(&h, &mask)?.to_vec2()?)
        };
        assert_eq!(
            run(PoolingMode::Cls, false)?,
            vec![vec![1., 2.], vec![-1., 0.5]]
        );
        assert_eq!(
            run(PoolingMode::Mean, false)?,
            vec![vec![3., 4. / 3.], vec![3., 4.25]]
        );
        assert_eq!(
            run(PoolingMode::Max, false)?,
            vec![vec![5., 6.], vec![7., 8.]]
        );
        assert_eq!(
            run(PoolingMode::LastToken, false)?,
            vec![vec![5., 6.], vec![7., 8.]]
        );
        let sqrt = run(PoolingMode::MeanSqrtLen, false)?;
        assert!((sqrt[1][0] - 6. / 2f32.sqrt()).abs() < 1e-6);
        let unit = run(PoolingMode::Cls, true)?;
        assert!((unit[0][0] - 1. / 5f32.sqrt()).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn modules_json_picks_the_mode_and_the_normalization() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("pooling-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            Pooling::from_dir(&dir)?,
            Pooling {
                mode: PoolingMode::Mean,
                normalize: false
            }
        );
        let modules = |extra: &str| {
            format!(
                r#"[{{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}},
                   {{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}}{extra}]"#
            )
        };
        write(&dir, "modules.json", &modules(""))?;
        write(
            &dir,
            "1_Pooling/config.json",
            r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#,
        )?;
        assert_eq!(
            Pooling::from_dir(&dir)?,
            Pooling {
                mode: PoolingMode::Cls,
                normalize: false
            }
        );
        write(
            &dir,
            "modules.json",
            &modules(
                r#", {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}"#,
            ),
        )?;
        assert!(Pooling::from_dir(&dir)?.normalize);
        write(
            &dir,
            "modules.json",
            &modules(
                r#", {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}"#,
            ),
        )?;
        let err = Pooling::from_dir(&dir).expect_err("dense").to_string();
        assert!(err.contains("Dense"), "{err}");
        write(&dir, "modules.json", &modules(""))?;
        write(
            &dir,
            "1_Pooling/config.json",
            r#"{"pooling_mode_cls_token": true, "pooling_mode_max_tokens": true}"#,
        )?;
        let err = Pooling::from_dir(&dir).expect_err("two modes").to_string();
        assert!(err.contains("pooling_mode_max_tokens"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
