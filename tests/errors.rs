//! Every failure a user can cause is an `Err` of the right [`Error`] variant whose message
//! names the problem (the file, the tensor, the expected and the found value), never a
//! panic. Each test returns `Result`, so a panic anywhere in the library fails it.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_attention::{
    scaled_dot_product_attention, AttentionConfig, AttentionMask, Checkpoint, Error, HfConfig,
    LinearWeights, MultiHeadSelfAttention, Projections, SdpaOptions, SingleHeadSelfAttention,
    WeightLayout,
};
use candle_core::{DType, Device, Tensor};
use common::TempDir;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn randn(shape: &[usize]) -> anyhow::Result<Tensor> {
    Ok(Tensor::randn(0f32, 1f32, shape, &Device::Cpu)?)
}

/// Asserts that `err`'s message contains every one of `needles`.
fn assert_mentions(err: &Error, needles: &[&str]) {
    let message = err.to_string();
    for needle in needles {
        assert!(
            message.contains(needle),
            "error message does not mention `{needle}`: {message}"
        );
    }
}

fn expect_err<T: std::fmt::Debug>(r: candle_attention::Result<T>, what: &str) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error, got Ok({v:?})"),
        Err(e) => e,
    }
}

const PREFIX: &str = "encoder.layer.0.attention";

/// The tensors of a small BERT-like attention layer (hidden 8) plus a few neighbours.
fn bert_tensors() -> anyhow::Result<HashMap<String, Tensor>> {
    let mut t = HashMap::new();
    for name in ["self.query", "self.key", "self.value", "output.dense"] {
        t.insert(format!("{PREFIX}.{name}.weight"), randn(&[8, 8])?);
        t.insert(format!("{PREFIX}.{name}.bias"), randn(&[8])?);
    }
    t.insert(
        format!("{PREFIX}.output.LayerNorm.weight"),
        Tensor::ones(8, DType::F32, &Device::Cpu)?,
    );
    t.insert(
        "embeddings.word_embeddings.weight".to_string(),
        randn(&[10, 8])?,
    );
    Ok(t)
}

fn save(dir: &TempDir, name: &str, tensors: &HashMap<String, Tensor>) -> anyhow::Result<PathBuf> {
    let path = dir.file(name);
    candle_core::safetensors::save(tensors, &path)?;
    Ok(path)
}

/// Loads the BERT layout at `PREFIX` from a checkpoint file with `heads` heads.
fn load_bert(path: &Path, heads: usize) -> candle_attention::Result<MultiHeadSelfAttention> {
    let ckpt = Checkpoint::open(path)?;
    let vb = ckpt.var_builder(DType::F32, &Device::Cpu);
    MultiHeadSelfAttention::load(
        vb.pp(PREFIX),
        &AttentionConfig::new(WeightLayout::Bert, heads),
    )
}

fn linear(out: usize, inp: usize, name: &str) -> anyhow::Result<LinearWeights> {
    Ok(LinearWeights::new(randn(&[out, inp])?, None, name))
}

/// Projections with `q_rows`, `k_rows`, `v_rows` outputs over hidden 8, W_O `(8, v_rows * ..)`.
fn projections(q_rows: usize, k_rows: usize, v_rows: usize) -> anyhow::Result<Projections> {
    Ok(Projections {
        q: linear(q_rows, 8, "q_proj.weight")?,
        k: linear(k_rows, 8, "k_proj.weight")?,
        v: linear(v_rows, 8, "v_proj.weight")?,
        o: None,
    })
}

/// A valid layer: hidden 8, 2 heads of 4.
fn layer() -> anyhow::Result<MultiHeadSelfAttention> {
    Ok(MultiHeadSelfAttention::new(
        projections(8, 8, 8)?,
        &AttentionConfig::new(WeightLayout::Llama, 2),
    )?)
}

// ---------------------------------------------------------------------------------------
// Checkpoint files
// ---------------------------------------------------------------------------------------

#[test]
fn missing_file_is_io_error_with_path() -> anyhow::Result<()> {
    let dir = TempDir::new("missing")?;
    let path = dir.file("does-not-exist.safetensors");
    let err = expect_err(Checkpoint::open(&path), "missing file");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_mentions(&err, &[&path.display().to_string()]);
    Ok(())
}

/// Opens `bytes` written to a file and checks for `InvalidCheckpoint` naming the path.
fn assert_invalid(name: &str, bytes: &[u8], needles: &[&str]) -> anyhow::Result<()> {
    let dir = TempDir::new(name)?;
    let path = dir.write(&format!("{name}.safetensors"), bytes)?;
    let err = expect_err(Checkpoint::open(&path), name);
    assert!(
        matches!(err, Error::InvalidCheckpoint { .. }),
        "{name}: {err:?}"
    );
    let path_s = path.display().to_string();
    let mut all = vec![path_s.as_str(), "not a valid safetensors file"];
    all.extend_from_slice(needles);
    assert_mentions(&err, &all);
    Ok(())
}

#[test]
fn empty_file_is_invalid_checkpoint() -> anyhow::Result<()> {
    assert_invalid("empty", b"", &["empty"])
}

#[test]
fn five_byte_file_is_invalid_checkpoint() -> anyhow::Result<()> {
    assert_invalid("five-bytes", b"abcde", &["5 bytes"])
}

#[test]
fn header_length_past_end_is_invalid_checkpoint() -> anyhow::Result<()> {
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"a\":1}");
    assert_invalid("long-header", &bytes, &["1000"])
}

#[test]
fn garbage_json_header_is_invalid_checkpoint() -> anyhow::Result<()> {
    let header = b"this is not json at all!";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    assert_invalid("garbage-json", &bytes, &["JSON"])
}

#[test]
fn truncated_safetensors_is_invalid_checkpoint() -> anyhow::Result<()> {
    let dir = TempDir::new("truncated")?;
    let mut tensors = HashMap::new();
    tensors.insert("w".to_string(), randn(&[32, 32])?);
    tensors.insert("b".to_string(), randn(&[32])?);
    let full = save(&dir, "full.safetensors", &tensors)?;
    // The full file opens; its first half does not.
    let ckpt = Checkpoint::open(&full)?;
    assert!(ckpt.contains("w") && ckpt.contains("b"));
    let bytes = std::fs::read(&full)?;
    assert_invalid("truncated", &bytes[..bytes.len() / 2], &["truncated"])?;
    // Cut inside the header: still an error, not a panic.
    let header_len = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    assert_invalid("cut-header", &bytes[..8 + header_len / 2], &["header"])
}

#[test]
fn directory_is_invalid_checkpoint() -> anyhow::Result<()> {
    let dir = TempDir::new("directory")?;
    let err = expect_err(Checkpoint::open(&dir.0), "directory");
    assert!(matches!(err, Error::InvalidCheckpoint { .. }), "{err:?}");
    assert_mentions(&err, &[&dir.0.display().to_string(), "directory"]);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Tensors in a checkpoint
// ---------------------------------------------------------------------------------------

#[test]
fn valid_small_bert_checkpoint_loads() -> anyhow::Result<()> {
    let dir = TempDir::new("valid")?;
    let path = save(&dir, "bert.safetensors", &bert_tensors()?)?;
    let attn = load_bert(&path, 2)?;
    assert_eq!(
        (attn.hidden_size(), attn.num_heads(), attn.head_dim()),
        (8, 2, 4)
    );
    Ok(())
}

#[test]
fn missing_tensor_lists_what_exists() -> anyhow::Result<()> {
    let dir = TempDir::new("missing-tensor")?;
    let missing = format!("{PREFIX}.self.key.weight");

    // Only the key weight removed: the nearest prefix is `self.key`, whose bias is listed.
    let mut tensors = bert_tensors()?;
    tensors.remove(&missing);
    let path = save(&dir, "no-key-weight.safetensors", &tensors)?;
    let err = expect_err(load_bert(&path, 2), "missing key weight");
    assert!(matches!(err, Error::MissingTensor { .. }), "{err:?}");
    assert_mentions(&err, &[&missing, "self.key.bias"]);

    // The whole key projection removed: the siblings under `self` are listed.
    tensors.remove(&format!("{PREFIX}.self.key.bias"));
    let path = save(&dir, "no-key.safetensors", &tensors)?;
    let err = expect_err(load_bert(&path, 2), "missing key");
    match &err {
        Error::MissingTensor {
            name,
            prefix,
            available,
            ..
        } => {
            assert_eq!(name, &missing);
            assert_eq!(prefix, &format!("{PREFIX}.self"));
            assert!(available.contains(&format!("{PREFIX}.self.query.weight")));
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    assert_mentions(&err, &[&missing, "self.query.weight", "self.value.bias"]);

    // A prefix that matches nothing at all: the message says what the checkpoint holds.
    let ckpt = Checkpoint::open(&path)?;
    let err = Error::from(
        ckpt.var_builder(DType::F32, &Device::Cpu)
            .get(8, "decoder.bias")
            .expect_err("no decoder"),
    );
    assert!(matches!(err, Error::MissingTensor { .. }), "{err:?}");
    assert_mentions(&err, &["decoder.bias", "embeddings.word_embeddings.weight"]);
    Ok(())
}

#[test]
fn unknown_prefix_lists_roots() -> anyhow::Result<()> {
    let dir = TempDir::new("prefix")?;
    let path = save(&dir, "bert.safetensors", &bert_tensors()?)?;
    let ckpt = Checkpoint::open(&path)?;
    ckpt.check_prefix(PREFIX)?;
    ckpt.check_prefix("")?;
    let err = expect_err(ckpt.check_prefix("nothing.here"), "unknown prefix");
    match &err {
        Error::PrefixNotFound { prefix, roots } => {
            assert_eq!(prefix, "nothing.here");
            assert_eq!(roots, &["embeddings".to_string(), "encoder".to_string()]);
        }
        other => panic!("expected PrefixNotFound, got {other:?}"),
    }
    assert_mentions(&err, &["nothing.here", "embeddings", "encoder"]);
    // A prefix is matched per dotted component: `encoder.lay` is not `encoder.layer`.
    let err = expect_err(ckpt.check_prefix("encoder.lay"), "partial component");
    assert!(matches!(err, Error::PrefixNotFound { .. }), "{err:?}");
    Ok(())
}

#[test]
fn bias_of_wrong_length_is_shape_mismatch() -> anyhow::Result<()> {
    let dir = TempDir::new("shape")?;
    let mut tensors = bert_tensors()?;
    let name = format!("{PREFIX}.self.query.bias");
    tensors.insert(name.clone(), randn(&[7])?);
    let path = save(&dir, "bert.safetensors", &tensors)?;
    let err = expect_err(load_bert(&path, 2), "short bias");
    match &err {
        Error::ShapeMismatch { tensor, found, .. } => {
            assert_eq!(tensor, &name);
            assert_eq!(found, &[7]);
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    assert_mentions(&err, &[&name, "[7]", "expected [8]"]);

    // A weight that is not a matrix.
    let mut tensors = bert_tensors()?;
    let name = format!("{PREFIX}.self.value.weight");
    tensors.insert(name.clone(), randn(&[64])?);
    let path = save(&dir, "bert-vector.safetensors", &tensors)?;
    let err = expect_err(load_bert(&path, 2), "vector weight");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert_mentions(&err, &[&name, "[64]", "rank-2"]);
    Ok(())
}

#[test]
fn integer_weight_is_wrong_dtype() -> anyhow::Result<()> {
    let dir = TempDir::new("dtype")?;
    let mut tensors = bert_tensors()?;
    let name = format!("{PREFIX}.self.value.weight");
    tensors.insert(
        name.clone(),
        Tensor::zeros((8, 8), DType::I64, &Device::Cpu)?,
    );
    let path = save(&dir, "bert.safetensors", &tensors)?;
    let err = expect_err(load_bert(&path, 2), "integer weight");
    assert!(matches!(err, Error::WrongDtype { .. }), "{err:?}");
    assert_mentions(&err, &[&name, "I64", "floating point"]);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Head counts
// ---------------------------------------------------------------------------------------

#[test]
fn heads_not_dividing_hidden_is_heads_error() -> anyhow::Result<()> {
    let dir = TempDir::new("heads")?;
    let path = save(&dir, "bert.safetensors", &bert_tensors()?)?;
    let err = expect_err(load_bert(&path, 3), "3 heads over 8");
    assert!(matches!(err, Error::Heads(_)), "{err:?}");
    assert_mentions(&err, &["3 heads", "8", "self.query.weight"]);

    let err = expect_err(load_bert(&path, 0), "0 heads");
    assert!(matches!(err, Error::Heads(_)), "{err:?}");
    assert_mentions(&err, &["at least 1", "found 0"]);
    Ok(())
}

#[test]
fn kv_heads_that_do_not_fit_are_errors() -> anyhow::Result<()> {
    // 4 heads of 2 over hidden 8.
    let cfg = AttentionConfig::new(WeightLayout::Llama, 4);

    // kv heads not dividing the heads.
    let err = expect_err(
        MultiHeadSelfAttention::new(projections(8, 6, 6)?, &cfg.clone().with_kv_heads(3)),
        "kv 3 of 4",
    );
    assert!(matches!(err, Error::Heads(_)), "{err:?}");
    assert_mentions(&err, &["3 key/value heads", "4 query heads"]);

    // kv heads 0.
    let err = expect_err(
        MultiHeadSelfAttention::new(projections(8, 8, 8)?, &cfg.clone().with_kv_heads(0)),
        "kv 0",
    );
    assert!(matches!(err, Error::Heads(_)), "{err:?}");
    assert_mentions(&err, &["key/value heads", "found 0"]);

    // kv heads 2 stated, but the key projection has 8 rows (4 heads of 2).
    let err = expect_err(
        MultiHeadSelfAttention::new(projections(8, 8, 8)?, &cfg.clone().with_kv_heads(2)),
        "kv 2 vs 8 key rows",
    );
    match &err {
        Error::ShapeMismatch { tensor, found, .. } => {
            assert_eq!(tensor, "k_proj.weight");
            assert_eq!(found, &[8, 8]);
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    assert_mentions(&err, &["k_proj.weight", "4 rows", "kv_heads 2"]);

    // kv heads read from the key rows: 6 rows are 3 heads of 2, which do not divide 4.
    let err = expect_err(
        MultiHeadSelfAttention::new(projections(8, 6, 6)?, &cfg),
        "6 key rows",
    );
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert_mentions(&err, &["k_proj.weight", "[6, 8]"]);

    // Key rows that are not a multiple of the head dim.
    let err = expect_err(
        MultiHeadSelfAttention::new(projections(8, 5, 8)?, &cfg),
        "5 key rows",
    );
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert_mentions(&err, &["k_proj.weight", "head_dim 2"]);

    // An output projection that does not read heads * v_head_dim.
    let p = Projections {
        o: Some(linear(8, 6, "o_proj.weight")?),
        ..projections(8, 8, 8)?
    };
    let err = expect_err(MultiHeadSelfAttention::new(p, &cfg), "o_proj width");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert_mentions(&err, &["o_proj.weight", "[8, 6]"]);

    // Single head: key of a different width than the query.
    let err = expect_err(
        SingleHeadSelfAttention::new(
            linear(4, 8, "query.weight")?,
            linear(4, 6, "key.weight")?,
            linear(3, 8, "value.weight")?,
        ),
        "single head key width",
    );
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert_mentions(&err, &["key.weight", "[4, 6]"]);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Activations
// ---------------------------------------------------------------------------------------

#[test]
fn bad_activations_are_input_errors() -> anyhow::Result<()> {
    let attn = layer()?;
    let cases: [(&str, Tensor, &[&str]); 4] = [
        (
            "wrong hidden size",
            randn(&[1, 3, 9])?,
            &["`x`", "hidden size 8", "[1, 3, 9]"],
        ),
        ("wrong rank", randn(&[3, 8])?, &["`x`", "rank 3", "[3, 8]"]),
        (
            "f16 x on an f32 layer",
            randn(&[1, 3, 8])?.to_dtype(DType::F16)?,
            &["`x`", "F32", "F16"],
        ),
        ("no tokens", randn(&[1, 0, 8])?, &["`x`", "at least one"]),
    ];
    for (what, x, needles) in cases {
        for need_weights in [false, true] {
            let err = expect_err(attn.attend(&x, None, None, need_weights), what);
            assert!(matches!(err, Error::Input { .. }), "{what}: {err:?}");
            assert_mentions(&err, needles);
        }
    }
    // The single head checks its input too.
    let head = SingleHeadSelfAttention::new(
        linear(4, 8, "query.weight")?,
        linear(4, 8, "key.weight")?,
        linear(3, 8, "value.weight")?,
    )?;
    for (what, x) in [
        ("single wrong hidden", randn(&[1, 3, 9])?),
        ("single wrong rank", randn(&[1, 1, 3, 8])?),
        ("single f16", randn(&[1, 3, 8])?.to_dtype(DType::F16)?),
    ] {
        let err = expect_err(head.forward(&x, None), what);
        assert!(matches!(err, Error::Input { .. }), "{what}: {err:?}");
        assert_mentions(&err, &["`x`"]);
    }
    Ok(())
}

#[test]
fn cross_attention_batch_mismatch_is_input_error() -> anyhow::Result<()> {
    let attn = layer()?;
    let err = expect_err(
        attn.cross_attention(&randn(&[2, 3, 8])?, &randn(&[1, 4, 8])?, None, true),
        "batch 2 vs 1",
    );
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert_mentions(&err, &["`kv`", "batch 2", "batch 1"]);
    let err = expect_err(
        attn.cross_attention(&randn(&[2, 3, 8])?, &randn(&[2, 4, 5])?, None, false),
        "kv width",
    );
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert_mentions(&err, &["`kv`", "hidden size 8"]);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Masks
// ---------------------------------------------------------------------------------------

#[test]
fn bad_masks_are_mask_errors() -> anyhow::Result<()> {
    let attn = layer()?;
    let x = randn(&[1, 5, 8])?;

    // A padding mask for two sequences on a batch of one.
    let mask = AttentionMask::padding(&Tensor::ones((2, 5), DType::U8, &Device::Cpu)?)?;
    for need_weights in [false, true] {
        let err = expect_err(
            attn.attend(&x, None, Some(&mask), need_weights),
            "batch 2 mask",
        );
        assert!(matches!(err, Error::Mask(_)), "{err:?}");
        assert_mentions(&err, &["padding mask", "[2, 5]", "[1, 5]"]);
    }
    // A padding mask of the wrong length.
    let mask = AttentionMask::padding(&Tensor::ones((1, 4), DType::F32, &Device::Cpu)?)?;
    let err = expect_err(attn.forward(&x, Some(&mask)), "seq 4 mask");
    assert!(matches!(err, Error::Mask(_)), "{err:?}");

    // Values other than 0 and 1.
    let bad = Tensor::new(&[[1i64, 1, 2, 0, 0]], &Device::Cpu)?;
    let err = expect_err(AttentionMask::padding(&bad), "value 2");
    assert!(matches!(err, Error::Mask(_)), "{err:?}");
    assert_mentions(&err, &["only 0", "2"]);
    let bad = Tensor::new(&[[1f32, 0.5, 1.0, 1.0, 0.0]], &Device::Cpu)?;
    let err = expect_err(AttentionMask::padding(&bad), "value 0.5");
    assert!(matches!(err, Error::Mask(_)), "{err:?}");
    assert_mentions(&err, &["0.5"]);

    // A padding mask that is not (batch, seq_k).
    let err = expect_err(
        AttentionMask::padding(&Tensor::ones(5, DType::U8, &Device::Cpu)?),
        "rank 1 padding",
    );
    assert!(matches!(err, Error::Mask(_)), "{err:?}");
    assert_mentions(&err, &["(batch, seq_k)", "[5]"]);

    // Keep / block / bias masks of rank 1 or 5.
    let rank1 = Tensor::ones(5, DType::U8, &Device::Cpu)?;
    let rank5 = Tensor::ones((1, 1, 1, 5, 5), DType::F32, &Device::Cpu)?;
    let results = [
        ("keep rank 1", AttentionMask::keep(&rank1)),
        ("block rank 1", AttentionMask::block(&rank1)),
        ("bias rank 1", AttentionMask::bias(&rank1)),
        ("keep rank 5", AttentionMask::keep(&rank5)),
    ];
    for (what, r) in results {
        let err = expect_err(r, what);
        assert!(matches!(err, Error::Mask(_)), "{what}: {err:?}");
        assert_mentions(&err, &["rank 2", "found shape"]);
    }

    // A keep mask that does not broadcast to (batch, heads, seq_q, seq_k).
    let mask = AttentionMask::keep(&Tensor::ones((4, 5), DType::U8, &Device::Cpu)?)?;
    let err = expect_err(attn.forward(&x, Some(&mask)), "keep (4, 5) on seq 5");
    assert!(matches!(err, Error::Mask(_)), "{err:?}");
    assert_mentions(&err, &["keep mask", "[4, 5]", "[1, 2, 5, 5]"]);
    let mask = AttentionMask::bias(&randn(&[1, 3, 5, 5])?)?;
    let err = expect_err(attn.forward(&x, Some(&mask)), "bias over 3 heads");
    assert!(matches!(err, Error::Mask(_)), "{err:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// scaled_dot_product_attention
// ---------------------------------------------------------------------------------------

#[test]
fn bad_sdpa_inputs_are_errors() -> anyhow::Result<()> {
    let opts = SdpaOptions::with_weights();
    let sdpa = |q: &[usize], k: &[usize], v: &[usize]| -> anyhow::Result<Error> {
        Ok(expect_err(
            scaled_dot_product_attention(&randn(q)?, &randn(k)?, &randn(v)?, None, opts),
            &format!("q {q:?}, k {k:?}, v {v:?}"),
        ))
    };
    // d_k mismatch between q and k.
    let err = sdpa(&[1, 2, 3, 4], &[1, 2, 3, 5], &[1, 2, 3, 5])?;
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert_mentions(&err, &["`k`", "d_k = 4", "d_k = 5"]);
    // Heads not a multiple of kv heads.
    let err = sdpa(&[1, 3, 3, 4], &[1, 2, 3, 4], &[1, 2, 3, 4])?;
    assert!(matches!(err, Error::Heads(_)), "{err:?}");
    assert_mentions(&err, &["3 heads", "2 key/value heads"]);
    // Batch mismatch.
    let err = sdpa(&[2, 2, 3, 4], &[1, 2, 3, 4], &[1, 2, 3, 4])?;
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert_mentions(&err, &["batch 2", "k batch 1"]);
    // v of a different length than k.
    let err = sdpa(&[1, 2, 3, 4], &[1, 2, 3, 4], &[1, 2, 6, 4])?;
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert_mentions(&err, &["`v`", "[1, 2, 6, 4]"]);
    // Rank 3 q.
    let err = sdpa(&[2, 3, 4], &[1, 2, 3, 4], &[1, 2, 3, 4])?;
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert_mentions(&err, &["`q`", "rank 4", "[2, 3, 4]"]);
    // Mixed dtypes.
    let q = randn(&[1, 2, 3, 4])?;
    let k = randn(&[1, 2, 3, 4])?.to_dtype(DType::F16)?;
    let err = expect_err(
        scaled_dot_product_attention(&q, &k, &k, None, opts),
        "mixed dtypes",
    );
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert_mentions(&err, &["F32", "F16"]);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------------------

/// Writes `json` as a config file and checks for a `Config` error naming `needles` and the path.
fn assert_bad_config(name: &str, json: &str, needles: &[&str]) -> anyhow::Result<()> {
    let dir = TempDir::new(name)?;
    let path = dir.write("config.json", json.as_bytes())?;
    let err = expect_err(HfConfig::from_file(&path), name);
    assert!(
        matches!(&err, Error::Config { path: Some(p), .. } if p == &path),
        "{name}: {err:?}"
    );
    let path_s = path.display().to_string();
    let mut all = vec![path_s.as_str()];
    all.extend_from_slice(needles);
    assert_mentions(&err, &all);
    Ok(())
}

#[test]
fn bad_config_files_are_config_errors() -> anyhow::Result<()> {
    assert_bad_config(
        "zero-layers",
        r#"{"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 0}"#,
        &["num_hidden_layers", "at least 1"],
    )?;
    assert_bad_config(
        "negative-hidden",
        "{\n  \"model_type\": \"bert\",\n  \"hidden_size\": -384,\n  \"num_attention_heads\": 12,\n  \"num_hidden_layers\": 6\n}\n",
        &["hidden_size", "-384"],
    )?;
    assert_bad_config(
        "string-heads",
        r#"{"hidden_size": 8, "num_attention_heads": "two", "num_hidden_layers": 1}"#,
        &["num_attention_heads", "two"],
    )?;
    assert_bad_config(
        "missing-heads",
        r#"{"model_type": "bert", "hidden_size": 8, "num_hidden_layers": 1}"#,
        &["num_attention_heads", "missing"],
    )?;
    assert_bad_config(
        "heads-not-dividing",
        r#"{"hidden_size": 8, "num_attention_heads": 3, "num_hidden_layers": 1}"#,
        &["num_attention_heads", "hidden_size", "does not divide"],
    )?;
    assert_bad_config(
        "kv-not-dividing",
        r#"{"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 3, "num_hidden_layers": 1}"#,
        &["num_key_value_heads", "does not divide"],
    )?;
    assert_bad_config("not-json", "hidden_size = 384\n", &["line 1"])?;
    assert_bad_config("empty", "", &["EOF"])?;
    Ok(())
}

#[test]
fn missing_config_file_is_io_error() -> anyhow::Result<()> {
    let dir = TempDir::new("no-config")?;
    let path = dir.file("config.json");
    let err = expect_err(HfConfig::from_file(&path), "missing config");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_mentions(&err, &[&path.display().to_string()]);
    Ok(())
}

#[test]
fn unknown_layout_name_is_config_error() {
    let err = expect_err("t5".parse::<WeightLayout>(), "layout t5");
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert_mentions(
        &err,
        &[
            "t5",
            "bert, distilbert, torch-mha, gpt2, llama, phi3, modernbert, gpt-neox, single",
        ],
    );
}
