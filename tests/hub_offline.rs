//! `ModelResolver` on a Hugging Face hub cache, offline: the real `hf-hub` cache lookup
//! on a temporary directory laid out like `~/.cache/huggingface/hub`:
//!
//! ```text
//! <cache>/models--org--name/
//!   blobs/<content hash>                       the files
//!   refs/main                                  a commit hash, no newline
//!   snapshots/<commit>/config.json -> ../../blobs/<content hash>
//! ```
//!
//! A cached model resolves to its snapshot paths and loads to the same encoder as the
//! shipped weights, revisions go through `refs/<revision>`, a sharded checkpoint
//! (`model.safetensors.index.json` + shards) resolves and loads, a model absent from the
//! cache is an `Error::Model` naming the missing files, and `attention_dump --model
//! org/name` with `HF_HUB_CACHE` and `HF_HUB_OFFLINE=1` reads the cache.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context};
use candle_attention::{Error, Model, ModelFiles, ModelResolver};
use candle_core::{DType, Device, Tensor};
use common::{max_abs_diff, repo_path};

const ID: &str = "org/name";
const MAIN_COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const V1_COMMIT: &str = "fedcba9876543210fedcba9876543210fedcba98";
const SENTENCES: [&str; 2] = [
    "The animal didn't cross the street because it was too tired.",
    "Hello world!",
];
/// The same bytes loaded through different paths give the same numbers.
const SAME_TOL: f32 = 1e-6;

/// A temporary hub cache, removed on drop.
struct HubCache {
    root: PathBuf,
}

impl HubCache {
    fn new(test: &str) -> anyhow::Result<Self> {
        let root = std::env::temp_dir().join(format!(
            "candle-attention-hub-{}-{test}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root)?;
        Ok(Self { root })
    }

    /// `models--org--name`.
    fn repo_dir(&self, id: &str) -> PathBuf {
        self.root.join(format!("models--{}", id.replace('/', "--")))
    }

    /// Stores `files` (`(name in the repo, source file)`) as blobs, links them from
    /// `snapshots/<commit>/` and points `refs/<revision>` at the commit. Returns the
    /// snapshot directory.
    fn add(
        &self,
        id: &str,
        revision: &str,
        commit: &str,
        files: &[(&str, &Path)],
    ) -> anyhow::Result<PathBuf> {
        let repo = self.repo_dir(id);
        let blobs = repo.join("blobs");
        let snapshot = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(&blobs)?;
        std::fs::create_dir_all(&snapshot)?;
        for (name, src) in files {
            let blob_name = content_hash(src)?;
            let blob = blobs.join(&blob_name);
            if !blob.exists() {
                // A hard link is a cheap copy; fall back to copying across file systems.
                if std::fs::hard_link(src, &blob).is_err() {
                    std::fs::copy(src, &blob)?;
                }
            }
            let link = snapshot.join(name);
            let _ = std::fs::remove_file(&link);
            link_blob(&blob_name, &blob, &link)?;
        }
        self.set_ref(id, revision, commit)?;
        Ok(snapshot)
    }

    /// Writes `refs/<revision>` (the commit hash without a newline, as huggingface_hub does).
    fn set_ref(&self, id: &str, revision: &str, commit: &str) -> anyhow::Result<()> {
        // A revision may hold slashes (`refs/pr/1`): they become folders.
        let file = self.repo_dir(id).join("refs").join(revision);
        std::fs::create_dir_all(file.parent().context("ref without a parent")?)?;
        std::fs::write(file, commit)?;
        Ok(())
    }

    /// A resolver that reads only this cache and never downloads.
    fn resolver(&self) -> ModelResolver {
        ModelResolver {
            cache_dir: Some(self.root.clone()),
            offline: true,
        }
    }
}

impl Drop for HubCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// `snapshots/<commit>/<name>` -> `../../blobs/<blob>`, relative like a real cache.
fn link_blob(blob_name: &str, blob: &Path, link: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        let _ = blob;
        std::os::unix::fs::symlink(Path::new("../../blobs").join(blob_name), link)?;
    }
    #[cfg(not(unix))]
    {
        let _ = blob_name;
        std::fs::copy(blob, link)?;
    }
    Ok(())
}

/// A content-derived blob name (64-bit FNV-1a of the bytes, hex, plus the length).
fn content_hash(path: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in &bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    Ok(format!("{h:016x}{:08x}", bytes.len()))
}

/// The shipped model's three files.
fn shipped_files() -> [(&'static str, PathBuf); 3] {
    [
        ("config.json", repo_path("weights/config.json")),
        ("tokenizer.json", repo_path("weights/tokenizer.json")),
        ("model.safetensors", repo_path("weights/model.safetensors")),
    ]
}

fn as_refs<'a>(files: &'a [(&'static str, PathBuf)]) -> Vec<(&'static str, &'a Path)> {
    files.iter().map(|(n, p)| (*n, p.as_path())).collect()
}

/// Hidden states and every layer's attentions of `SENTENCES`, batched.
fn encode(files: ModelFiles) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
    let model = Model::load(files, DType::F32, &Device::Cpu, false)?;
    let batch = model.text.encode_batch(&SENTENCES, &Device::Cpu)?;
    let out = model.encoder.forward(
        &batch.input_ids,
        Some(&batch.token_type_ids),
        Some(&batch.attention_mask),
        true,
    )?;
    let attentions = out.attentions.context("no attentions")?;
    Ok((out.hidden_states, attentions))
}

/// The encoder loaded from `files` computes what the shipped weights compute.
fn assert_same_as_shipped(files: ModelFiles, what: &str) -> anyhow::Result<()> {
    let shipped = encode(ModelResolver::new().resolve(None)?)?;
    let cached = encode(files)?;
    let d = max_abs_diff(&cached.0, &shipped.0)?;
    ensure!(d <= SAME_TOL, "{what}: hidden states differ by {d}");
    ensure!(cached.1.len() == shipped.1.len(), "{what}: layer count");
    for (l, (a, b)) in cached.1.iter().zip(&shipped.1).enumerate() {
        let d = max_abs_diff(a, b)?;
        ensure!(d <= SAME_TOL, "{what}: layer {l} attentions differ by {d}");
    }
    Ok(())
}

/// `(model, reason)` of an `Error::Model`.
fn model_error(result: candle_attention::Result<ModelFiles>) -> anyhow::Result<(String, String)> {
    match result {
        Err(Error::Model { model, reason }) => Ok((model, reason)),
        Err(other) => anyhow::bail!("expected Error::Model, got {other:?}"),
        Ok(files) => anyhow::bail!("expected Error::Model, resolved {files:?}"),
    }
}

#[test]
fn cached_model_resolves_to_its_snapshot_and_loads_like_the_shipped_one() -> anyhow::Result<()> {
    let cache = HubCache::new("cached")?;
    let files = shipped_files();
    let snapshot = cache.add(ID, "main", MAIN_COMMIT, &as_refs(&files))?;

    let resolved = cache.resolver().resolve(Some(ID))?;
    ensure!(resolved.name == ID, "name {:?}", resolved.name);
    ensure!(
        resolved.config == snapshot.join("config.json"),
        "config {}",
        resolved.config.display()
    );
    ensure!(
        resolved.tokenizer == snapshot.join("tokenizer.json"),
        "tokenizer {}",
        resolved.tokenizer.display()
    );
    ensure!(
        resolved.weights == vec![snapshot.join("model.safetensors")],
        "weights {:?}",
        resolved.weights
    );
    // The snapshot entries are links into blobs/, as in a real cache.
    #[cfg(unix)]
    ensure!(
        std::fs::symlink_metadata(&resolved.weights[0])?
            .file_type()
            .is_symlink(),
        "the snapshot file should be a symlink"
    );
    assert_same_as_shipped(resolved, "org/name from the cache")
}

#[test]
fn revision_is_read_from_its_ref() -> anyhow::Result<()> {
    let cache = HubCache::new("revision")?;
    let files = shipped_files();
    let main = cache.add(ID, "main", MAIN_COMMIT, &as_refs(&files))?;
    let v1 = cache.add(ID, "v1", V1_COMMIT, &as_refs(&files))?;
    ensure!(main != v1);

    let spec = format!("{ID}@v1");
    let resolved = cache.resolver().resolve(Some(&spec))?;
    ensure!(resolved.name == spec, "name {:?}", resolved.name);
    ensure!(
        resolved.config == v1.join("config.json")
            && resolved.tokenizer == v1.join("tokenizer.json")
            && resolved.weights == vec![v1.join("model.safetensors")],
        "@v1 resolved to {resolved:?}, expected files under {}",
        v1.display()
    );
    // Without a revision, main.
    let resolved = cache.resolver().resolve(Some(ID))?;
    ensure!(resolved.config == main.join("config.json"), "{resolved:?}");

    // A pull-request revision lives under refs/refs/pr/1, as huggingface_hub writes it.
    let pr = format!("{ID}@refs/pr/1");
    cache.set_ref(ID, "refs/pr/1", V1_COMMIT)?;
    let resolved = cache.resolver().resolve(Some(&pr))?;
    ensure!(
        resolved.config == v1.join("config.json"),
        "{pr}: {resolved:?}"
    );

    // A commit hash needs no ref: huggingface_hub writes only snapshots/<hash>/ when a
    // revision is downloaded by hash.
    let by_hash = format!("{ID}@{MAIN_COMMIT}");
    let resolved = cache.resolver().resolve(Some(&by_hash))?;
    ensure!(
        resolved.config == main.join("config.json"),
        "{by_hash}: {resolved:?}"
    );

    // A revision with no ref is not in the cache.
    let (model, reason) = model_error(cache.resolver().resolve(Some(&format!("{ID}@v2"))))?;
    ensure!(model == format!("{ID}@v2"), "model {model:?}");
    ensure!(reason.contains("offline"), "{reason}");

    assert_same_as_shipped(cache.resolver().resolve(Some(&spec))?, "org/name@v1")
}

#[test]
fn model_absent_from_the_cache_offline_names_the_missing_files() -> anyhow::Result<()> {
    let cache = HubCache::new("absent")?;
    let (model, reason) = model_error(cache.resolver().resolve(Some("org/absent")))?;
    ensure!(model == "org/absent", "model {model:?}");
    let lower = reason.to_lowercase();
    ensure!(
        lower.contains("offline") && lower.contains("cache"),
        "reason should say offline / not in the cache: {reason}"
    );
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        ensure!(
            reason.contains(file),
            "reason does not name {file}: {reason}"
        );
    }
    let display = Error::Model {
        model: model.clone(),
        reason: reason.clone(),
    }
    .to_string();
    ensure!(display.contains("org/absent"), "{display}");

    // Partly cached: only the missing file is named.
    let files = shipped_files();
    cache.add("org/partial", "main", MAIN_COMMIT, &as_refs(&files[..2]))?;
    let (_, reason) = model_error(cache.resolver().resolve(Some("org/partial")))?;
    ensure!(
        reason.contains("model.safetensors")
            && !reason.contains("config.json")
            && !reason.contains("tokenizer.json"),
        "only the weights are missing: {reason}"
    );
    Ok(())
}

/// Splits the shipped checkpoint's tensors into two shard files plus an index.
fn write_shards(dir: &Path) -> anyhow::Result<[(&'static str, PathBuf); 3]> {
    const SHARDS: [&str; 2] = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let tensors =
        candle_core::safetensors::load(repo_path("weights/model.safetensors"), &Device::Cpu)?;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    ensure!(names.len() > 10, "{} tensors", names.len());
    let mut parts: [HashMap<String, Tensor>; 2] = [HashMap::new(), HashMap::new()];
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, name) in names.iter().enumerate() {
        // The first half in one shard, the rest in the other, as transformers splits.
        let shard = usize::from(i >= names.len() / 2);
        let t = &tensors[*name];
        total += t.elem_count() * t.dtype().size_in_bytes();
        parts[shard].insert((*name).clone(), t.clone());
        weight_map.insert((*name).clone(), SHARDS[shard].into());
    }
    for (part, file) in parts.iter().zip(SHARDS) {
        candle_core::safetensors::save(part, dir.join(file))?;
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, serde_json::to_string_pretty(&index)?)?;
    Ok([
        ("model.safetensors.index.json", index_path),
        (SHARDS[0], dir.join(SHARDS[0])),
        (SHARDS[1], dir.join(SHARDS[1])),
    ])
}

#[test]
fn sharded_checkpoint_in_the_cache_resolves_and_loads() -> anyhow::Result<()> {
    let cache = HubCache::new("sharded")?;
    let staging = cache.root.join("staging");
    std::fs::create_dir_all(&staging)?;
    let shards = write_shards(&staging)?;
    let shipped = shipped_files();
    let mut files = as_refs(&shipped[..2]);
    files.extend(as_refs(&shards));
    let snapshot = cache.add(ID, "main", MAIN_COMMIT, &files)?;

    let resolved = cache.resolver().resolve(Some(ID))?;
    ensure!(
        resolved.weights
            == vec![
                snapshot.join("model-00001-of-00002.safetensors"),
                snapshot.join("model-00002-of-00002.safetensors"),
            ],
        "shards {:?}",
        resolved.weights
    );
    assert_same_as_shipped(resolved, "sharded org/name")?;

    // The same files in a plain directory resolve too.
    let resolved = ModelResolver::new().resolve(Some(snapshot.to_str().context("path")?))?;
    ensure!(resolved.weights.len() == 2, "{:?}", resolved.weights);

    // A shard missing from the cache: not resolvable offline, and the error says what is
    // missing.
    std::fs::remove_file(snapshot.join("model-00002-of-00002.safetensors"))?;
    let (_, reason) = model_error(cache.resolver().resolve(Some(ID)))?;
    ensure!(
        reason.contains("offline")
            && reason.contains("model-00002-of-00002.safetensors")
            && !reason.contains("model-00001-of-00002.safetensors")
            && !reason.contains("config.json"),
        "the error should name the missing shard only: {reason}"
    );
    Ok(())
}

#[test]
fn attention_dump_reads_the_cache_offline() -> anyhow::Result<()> {
    let cache = HubCache::new("cli")?;
    let files = shipped_files();
    cache.add(ID, "main", MAIN_COMMIT, &as_refs(&files))?;
    let bin = common::example_bin("attention_dump")?;
    let run = |args: &[&str]| -> anyhow::Result<std::process::Output> {
        Ok(Command::new(&bin)
            .args(args)
            .env("HF_HUB_CACHE", &cache.root)
            .env("HF_HUB_OFFLINE", "1")
            // Nothing may come from the user's own cache.
            .env("HF_HOME", cache.root.join("no-hf-home"))
            .env("RUST_BACKTRACE", "1")
            .current_dir(&cache.root)
            .output()?)
    };
    let json = |args: &[&str]| -> anyhow::Result<serde_json::Value> {
        let out = run(args)?;
        ensure!(
            out.status.success(),
            "attention_dump {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout)?;
        ensure!(stdout.lines().count() == 1, "one line expected: {stdout}");
        Ok(serde_json::from_str(stdout.trim_end())?)
    };
    let cached = json(&["--model", ID, "--format", "json", "Hello world!"])?;
    let default = json(&["--format", "json", "Hello world!"])?;
    ensure!(cached["model"] == ID, "model field {}", cached["model"]);
    ensure!(cached["tokens"] == default["tokens"] && cached["shape"] == default["shape"]);
    ensure!(
        cached["shape"] == serde_json::json!([6, 12, 5, 5]),
        "{}",
        cached["shape"]
    );
    let flat = |v: &serde_json::Value| -> Vec<f64> {
        fn walk(v: &serde_json::Value, out: &mut Vec<f64>) {
            match v {
                serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
                serde_json::Value::Number(n) => out.push(n.as_f64().unwrap_or(f64::NAN)),
                _ => out.push(f64::NAN),
            }
        }
        let mut out = Vec::new();
        walk(v, &mut out);
        out
    };
    let (a, b) = (flat(&cached["attentions"]), flat(&default["attentions"]));
    ensure!(a.len() == 6 * 12 * 5 * 5 && a.len() == b.len());
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max);
    ensure!(
        d <= f64::from(SAME_TOL),
        "cached vs shipped attentions differ by {d}"
    );

    // An id that is not cached fails without touching the network.
    let out = run(&["--model", "org/not-cached", "Hello world!"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "an uncached id succeeded offline");
    ensure!(
        stderr.trim_end().lines().count() == 1
            && stderr.starts_with("error: ")
            && stderr.contains("org/not-cached")
            && stderr.contains("offline")
            && !stderr.contains("panicked"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn default_model_without_weights_dir_comes_from_the_hub_cache() -> anyhow::Result<()> {
    use candle_attention::DEFAULT_MODEL_NAME;
    let cache = HubCache::new("default")?;
    let empty = cache.root.join("no-weights-here");
    std::fs::create_dir_all(&empty)?;
    // Not cached, offline: an error that says how to get the model.
    let (model, reason) = model_error(cache.resolver().resolve_default_from(&empty))?;
    ensure!(model == DEFAULT_MODEL_NAME, "model {model:?}");
    for needle in [
        "offline",
        "network access",
        "ships without the default model",
    ] {
        ensure!(reason.contains(needle), "reason lacks {needle:?}: {reason}");
    }
    // Cached under the hub id: resolved from the cache, same encoder as the shipped copy.
    let files = shipped_files();
    cache.add(DEFAULT_MODEL_NAME, "main", MAIN_COMMIT, &as_refs(&files))?;
    let resolved = cache.resolver().resolve_default_from(&empty)?;
    ensure!(resolved.name == DEFAULT_MODEL_NAME);
    ensure!(resolved.weights[0].starts_with(&cache.root));
    assert_same_as_shipped(resolved, "the default model from the cache")?;
    // A directory with the weights wins over the cache.
    let shipped = cache
        .resolver()
        .resolve_default_from(&repo_path("weights"))?;
    ensure!(shipped.weights[0].starts_with(repo_path("weights")));
    Ok(())
}
