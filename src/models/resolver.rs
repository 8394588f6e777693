//! Model resolution: a local directory, or a Hugging Face model id looked up in the local
//! hub cache first and downloaded (blocking, through `hf-hub`) only when online; the
//! default is the all-MiniLM-L6-v2 copy shipped in `weights/`.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};

use crate::error::{Error, Result};
use crate::models::architecture::Architecture;
use crate::models::bert::BertEncoder;
use crate::models::embedder::Embedder;
use crate::models::encoder_family::supported_model_types;
use crate::models::pooling::Pooling;
use crate::text::TextEncoder;
use crate::weights::checkpoint::Checkpoint;
use crate::weights::config::HfConfig;

/// The files of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFiles {
    /// How the user named the model (directory or model id).
    pub name: String,
    /// `config.json`.
    pub config: PathBuf,
    /// `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// One file, or the shards of a sharded checkpoint.
    pub weights: Vec<PathBuf>,
}

/// Name reported for the shipped default model.
pub const DEFAULT_MODEL_NAME: &str = "sentence-transformers/all-MiniLM-L6-v2";

/// The directory of the shipped default model (sentence-transformers/all-MiniLM-L6-v2,
/// f16), `weights/` in this crate.
pub fn default_model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("weights")
}

/// Finds a model's files.
#[derive(Debug, Clone, Default)]
pub struct ModelResolver {
    /// Hub cache directory; `None` uses `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`.
    pub cache_dir: Option<PathBuf>,
    /// Never download (also implied by `HF_HUB_OFFLINE=1`).
    pub offline: bool,
}

impl ModelResolver {
    /// A resolver with the default cache and network policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Resolves `spec`: `None` = the default model (the copy in this repository's
    /// `weights/`, or, where the crate is a dependency and ships without it, the hub id
    /// [`DEFAULT_MODEL_NAME`], cache first); an existing directory; or a Hugging Face model
    /// id `org/name`, optionally `org/name@revision`.
    pub fn resolve(&self, spec: Option<&str>) -> Result<ModelFiles> {
        let Some(spec) = spec else {
            return self.resolve_default_from(&default_model_dir());
        };
        let path = Path::new(spec);
        if path.is_dir() {
            return from_dir(path, spec);
        }
        let looks_like_path = spec.starts_with('.')
            || spec.starts_with('/')
            || spec.starts_with('~')
            || spec.contains('\\')
            // Only the id counts: a revision may hold slashes (`org/name@refs/pr/1`).
            || spec.split('@').next().unwrap_or(spec).matches('/').count() > 1;
        if looks_like_path || path.exists() {
            return Err(Error::Model {
                model: spec.to_string(),
                reason: if path.exists() {
                    "it is a file; give the directory that holds config.json, tokenizer.json and model.safetensors".to_string()
                } else {
                    "no such directory".to_string()
                },
            });
        }
        self.resolve_hub(spec)
    }

    /// The default model: from `dir` when it holds `model.safetensors` (this repository's
    /// `weights/`), else the hub id [`DEFAULT_MODEL_NAME`] (cache first; downloaded only
    /// when online), with an error that says what to do when neither has it.
    pub fn resolve_default_from(&self, dir: &Path) -> Result<ModelFiles> {
        if dir.join("model.safetensors").is_file() {
            return from_dir(dir, DEFAULT_MODEL_NAME);
        }
        self.resolve_hub(DEFAULT_MODEL_NAME).map_err(|e| match e {
            Error::Model { model, reason } => Error::Model {
                model,
                reason: format!(
                    "{reason}. The crate as a dependency ships without the default model \
                     ({} is absent): run once with network access so that the hub cache \
                     gets it, or pass a directory holding config.json, tokenizer.json and \
                     model.safetensors",
                    dir.display()
                ),
            },
            other => other,
        })
    }

    #[cfg(feature = "hub")]
    fn resolve_hub(&self, spec: &str) -> Result<ModelFiles> {
        use hf_hub::{Cache, Repo, RepoType};
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (spec, "main"),
        };
        let model_err = |reason: String| Error::Model {
            model: spec.to_string(),
            reason,
        };
        let cache = match (&self.cache_dir, std::env::var_os("HF_HUB_CACHE")) {
            (Some(dir), _) => Cache::new(dir.clone()),
            (None, Some(dir)) => Cache::new(PathBuf::from(dir)),
            (None, None) => {
                let has_home = ["HF_HOME", "HOME", "USERPROFILE"]
                    .iter()
                    .any(|v| std::env::var_os(v).is_some());
                if !has_home {
                    return Err(model_err(
                        "no hub cache directory: set HF_HUB_CACHE or HF_HOME".to_string(),
                    ));
                }
                Cache::from_env()
            }
        };
        let repo = Repo::with_revision(id.to_string(), RepoType::Model, revision.to_string());
        let cached = cache.repo(repo.clone());
        // huggingface_hub's truth values: 1, ON, YES, TRUE (any case).
        let offline = self.offline
            || std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "1" | "on" | "yes" | "true"
                )
            });

        // Local cache first. A revision that is a commit hash has no `refs/` entry when it
        // was downloaded by hash (huggingface_hub writes `snapshots/<hash>/` only).
        let commit_snapshot =
            (revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())).then(|| {
                cache
                    .path()
                    .join(repo.folder_name())
                    .join("snapshots")
                    .join(revision)
            });
        let from_cache = |file: &str| {
            cached.get(file).or_else(|| {
                commit_snapshot
                    .as_ref()
                    .map(|dir| dir.join(file))
                    .filter(|p| p.exists())
            })
        };
        let mut missing: Vec<String> = Vec::new();
        let config = from_cache("config.json");
        let tokenizer = from_cache("tokenizer.json");
        if config.is_none() {
            missing.push("config.json".to_string());
        }
        if tokenizer.is_none() {
            missing.push("tokenizer.json".to_string());
        }
        let weights = match from_cache("model.safetensors") {
            Some(p) => Some(vec![p]),
            None => match from_cache("model.safetensors.index.json") {
                Some(index) => {
                    let shards = shard_names(&index)?;
                    let absent: Vec<&String> =
                        shards.iter().filter(|s| from_cache(s).is_none()).collect();
                    if absent.is_empty() {
                        shards.iter().map(|s| from_cache(s)).collect()
                    } else {
                        missing.extend(absent.iter().map(|s| {
                            format!("{s} (a shard listed in model.safetensors.index.json)")
                        }));
                        None
                    }
                }
                None => {
                    missing.push("model.safetensors".to_string());
                    None
                }
            },
        };
        if let (Some(config), Some(tokenizer), Some(weights)) = (config, tokenizer, weights) {
            return Ok(ModelFiles {
                name: spec.to_string(),
                config,
                tokenizer,
                weights,
            });
        }
        if offline {
            return Err(model_err(format!(
                "offline and not in the hub cache {} (missing {})",
                cache.path().display(),
                missing.join(", ")
            )));
        }

        // Download what is missing (blocking).
        let api = hf_hub::api::sync::ApiBuilder::from_cache(cache.clone())
            .with_progress(false)
            .build()
            .map_err(|e| model_err(format!("cannot start the hub client: {e}")))?;
        let remote = api.repo(repo);
        let get = |file: &str| {
            remote.get(file).map_err(|e| {
                model_err(format!(
                    "{file} is not in the hub cache {} and downloading it failed: {e}",
                    cache.path().display()
                ))
            })
        };
        let config = get("config.json")?;
        let tokenizer = get("tokenizer.json")?;
        // The sentence-transformers pipeline where the model has one (its pooling and
        // normalization, read beside config.json): best effort, a model may have none.
        if let Ok(modules) = remote.get("modules.json") {
            let pooling_dirs = std::fs::read_to_string(&modules)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v.as_array().cloned())
                .unwrap_or_default()
                .into_iter()
                .filter(|m| m["type"].as_str().is_some_and(|t| t.ends_with(".Pooling")))
                .filter_map(|m| m["path"].as_str().map(str::to_string));
            for dir in pooling_dirs {
                let _ = remote.get(&format!("{dir}/config.json"));
            }
        }
        let weights = match get("model.safetensors") {
            Ok(p) => vec![p],
            Err(single_err) => match get("model.safetensors.index.json") {
                Ok(index) => shard_names(&index)?
                    .iter()
                    .map(|s| get(s))
                    .collect::<Result<Vec<_>>>()?,
                Err(_) => return Err(single_err),
            },
        };
        Ok(ModelFiles {
            name: spec.to_string(),
            config,
            tokenizer,
            weights,
        })
    }

    #[cfg(not(feature = "hub"))]
    fn resolve_hub(&self, spec: &str) -> Result<ModelFiles> {
        Err(Error::Model {
            model: spec.to_string(),
            reason: "not a local directory, and this build has no Hugging Face hub support (enable the `hub` feature)".to_string(),
        })
    }
}

/// The model files in a local directory.
fn from_dir(dir: &Path, name: &str) -> Result<ModelFiles> {
    let need = |file: &str| -> Result<PathBuf> {
        let p = dir.join(file);
        if p.is_file() {
            Ok(p)
        } else {
            Err(Error::Model {
                model: name.to_string(),
                reason: format!("{} has no {file}", dir.display()),
            })
        }
    };
    let config = need("config.json")?;
    let tokenizer = need("tokenizer.json")?;
    let single = dir.join("model.safetensors");
    let weights = if single.is_file() {
        vec![single]
    } else {
        let index = need("model.safetensors.index.json").map_err(|_| Error::Model {
            model: name.to_string(),
            reason: format!(
                "{} has no model.safetensors (nor a sharded model.safetensors.index.json)",
                dir.display()
            ),
        })?;
        shard_names(&index)?
            .iter()
            .map(|s| need(s))
            .collect::<Result<Vec<_>>>()?
    };
    Ok(ModelFiles {
        name: name.to_string(),
        config,
        tokenizer,
        weights,
    })
}

/// Shard file names of a `model.safetensors.index.json`.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|cause| Error::Io {
        path: index.to_path_buf(),
        cause,
    })?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: Some(index.to_path_buf()),
        message: e.to_string(),
    })?;
    let map = value["weight_map"]
        .as_object()
        .ok_or_else(|| Error::Config {
            path: Some(index.to_path_buf()),
            message: "no `weight_map` object".to_string(),
        })?;
    let mut shards: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// A loaded encoder (BERT, RoBERTa, XLM-R, DistilBERT families): config, tokenizer and
/// encoder.
pub struct Model {
    /// Where the model came from.
    pub files: ModelFiles,
    /// Its `config.json`.
    pub config: HfConfig,
    /// Its tokenizer, set to the model's positions.
    pub text: TextEncoder,
    /// The encoder.
    pub encoder: BertEncoder,
    /// How its sentence embeddings are pooled (its `modules.json`).
    pub pooling: Pooling,
}

impl Model {
    /// Loads the model's config, tokenizer and weights (converted to `dtype` on `device`).
    /// `truncate` cuts texts longer than the model's positions instead of failing.
    pub fn load(files: ModelFiles, dtype: DType, device: &Device, truncate: bool) -> Result<Self> {
        if Architecture::of_config_file(&files.config)? == Architecture::Decoder {
            return Err(Error::Model {
                model: files.name.clone(),
                reason: format!(
                    "it is a decoder; this takes an encoder ({})",
                    supported_model_types()
                ),
            });
        }
        let config = HfConfig::from_file(&files.config)?;
        // Parsing tokenizer.json and reading the weights are independent: do both at once, as
        // two tasks of rayon's pool (a thread of their own competed with the pool's threads,
        // which load the layers: measured slower on 2 cores).
        let (text, encoder) = rayon::join(
            || TextEncoder::from_file(&files.tokenizer),
            || {
                Checkpoint::open_many(&files.weights)
                    .and_then(|ckpt| BertEncoder::load_checkpoint(&ckpt, dtype, device, &config))
            },
        );
        let encoder = encoder?;
        let pooling = match files.config.parent() {
            Some(dir) => Pooling::from_dir(dir)?,
            None => Pooling::from_dir(".")?,
        };
        let text = text?
            .with_max_positions(encoder.max_positions())?
            .with_truncation(truncate)?;
        Ok(Self {
            files,
            config,
            text,
            encoder,
            pooling,
        })
    }

    /// Sentence embeddings with this model's encoder and tokenizer (batches of
    /// [`Embedder::DEFAULT_BATCH_SIZE`] unless set otherwise).
    pub fn embedder(&self, device: &Device) -> Embedder<'_> {
        Embedder::new(&self.encoder, &self.text, device).with_pooling(self.pooling)
    }
}
