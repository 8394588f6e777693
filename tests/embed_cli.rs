//! The contract of `examples/embed.rs`:
//!
//! ```text
//! embed "s1" "s2" ... [--file F] [--model M] [--format text|json] [--device D] [--dtype T]
//!       [--batch-size N] [--stats]
//! ```
//!
//! `--format json` prints one `{"text": ..., "embedding": [...]}` object per sentence: 384
//! floats of unit norm, equal to sentence-transformers' embedding of the golden fixture's
//! sentences (cosine >= 0.99999). Text mode prints a cosine similarity table. Bad inputs
//! exit non-zero with one `error: ...` line on stderr. `--stats` adds one JSON object of
//! times as the last line of stderr; stdout stays the same.

mod common;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use anyhow::{ensure, Context};
use common::{repo_path, Fixture, KeyOrder};
use serde::Deserialize;

const DIM: usize = 384;
const NORM_TOL: f32 = 1e-5;
const MIN_COSINE: f32 = 0.99999;

/// The example binary, built once for all tests of this file.
fn embed_bin() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| common::example_bin("embed").map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn run(args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(embed_bin()?)
        .args(args.iter().map(OsStr::new))
        .env("RUST_BACKTRACE", "1")
        .current_dir(repo_path(""))
        .output()?)
}

fn run_ok(args: &[&str]) -> anyhow::Result<String> {
    let out = run(args)?;
    ensure!(
        out.status.success(),
        "embed {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).context("stdout is not UTF-8")
}

/// Non-zero exit, nothing on stdout, one `error: ...` line naming `needles`, no panic.
fn expect_error(args: &[&str], needles: &[&str]) -> anyhow::Result<()> {
    let out = run(args)?;
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let lower = stderr.to_lowercase();
    ensure!(
        !out.status.success() && out.status.code().is_some(),
        "embed {args:?}: expected an error exit, got {}; stderr: {stderr}",
        out.status
    );
    ensure!(
        !lower.contains("panicked") && !lower.contains("backtrace"),
        "embed {args:?}: panic or backtrace: {stderr}"
    );
    let trimmed = stderr.trim_end_matches('\n');
    ensure!(
        trimmed.lines().count() == 1 && trimmed.starts_with("error: "),
        "embed {args:?}: expected one `error: ...` line, got {stderr:?}"
    );
    for needle in needles {
        ensure!(
            lower.contains(&needle.to_lowercase()),
            "embed {args:?}: error does not mention `{needle}`: {stderr:?}"
        );
    }
    ensure!(
        out.stdout.is_empty(),
        "embed {args:?}: stdout should be empty on error, got {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Embedding {
    text: String,
    embedding: Vec<f32>,
}

/// Runs `embed --format json` on `texts` and checks every line: keys, dimension, unit
/// norm, finite values, text echoed in order.
fn embed_json(texts: &[&str]) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut args = vec!["--format", "json"];
    args.extend_from_slice(texts);
    let stdout = run_ok(&args)?;
    let lines: Vec<&str> = stdout.lines().collect();
    ensure!(
        lines.len() == texts.len(),
        "{} JSON lines for {} sentences:\n{stdout}",
        lines.len(),
        texts.len()
    );
    let mut out = Vec::new();
    for (line, text) in lines.iter().zip(texts) {
        let keys: KeyOrder = serde_json::from_str(line).context("not a JSON object")?;
        ensure!(
            keys.0 == ["text", "embedding"],
            "keys {:?}, expected text, embedding",
            keys.0
        );
        let e: Embedding = serde_json::from_str(line)?;
        ensure!(e.text == *text, "text {:?}, expected {text:?}", e.text);
        ensure!(
            e.embedding.len() == DIM,
            "{} dimensions, expected {DIM}",
            e.embedding.len()
        );
        ensure!(
            e.embedding.iter().all(|x| x.is_finite()),
            "non-finite value in {text:?}"
        );
        let norm = e.embedding.iter().map(|x| x * x).sum::<f32>().sqrt();
        ensure!(
            (norm - 1.0).abs() <= NORM_TOL,
            "norm {norm} of {text:?} is not 1"
        );
        out.push(e.embedding);
    }
    Ok(out)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb)
}

/// `(key, text)` of the golden fixture's sentences.
fn golden_sentences(fx: &Fixture) -> anyhow::Result<Vec<(String, String)>> {
    fx.meta["sentences"]
        .as_array()
        .context("encoder_golden.json has no `sentences`")?
        .iter()
        .map(|s| {
            Ok((
                s["key"].as_str().context("no key")?.to_string(),
                s["text"].as_str().context("no text")?.to_string(),
            ))
        })
        .collect()
}

#[test]
fn json_embeddings_match_sentence_transformers() -> anyhow::Result<()> {
    let fx = Fixture::open("encoder_golden")?;
    let sentences = golden_sentences(&fx)?;
    ensure!(sentences.len() >= 3);
    let texts: Vec<&str> = sentences.iter().map(|(_, t)| t.as_str()).collect();
    let together = embed_json(&texts)?;
    for ((key, text), got) in sentences.iter().zip(&together) {
        let want: Vec<f32> = fx.tensor(&format!("{key}.embedding"))?.to_vec1()?;
        ensure!(want.len() == DIM);
        let cos = cosine(got, &want);
        ensure!(
            cos >= MIN_COSINE,
            "{key} ({text:?}): cosine {cos} with sentence-transformers"
        );
        // Batched with padding equals alone.
        let alone = embed_json(&[text])?;
        let d = got
            .iter()
            .zip(&alone[0])
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        ensure!(d <= 1e-5, "{key}: batched vs alone differ by {d}");
    }
    Ok(())
}

#[test]
fn half_precision_embeddings_stay_close() -> anyhow::Result<()> {
    let texts = ["A man is eating food.", "The sky is blue."];
    let f32_emb = embed_json(&texts)?;
    for dtype in ["f16", "bf16"] {
        let mut args = vec!["--format", "json", "--dtype", dtype];
        args.extend_from_slice(&texts);
        let stdout = run_ok(&args)?;
        for (line, want) in stdout.lines().zip(&f32_emb) {
            let e: Embedding = serde_json::from_str(line)?;
            ensure!(e.embedding.iter().all(|x| x.is_finite()), "{dtype}: NaN");
            let cos = cosine(&e.embedding, want);
            ensure!(cos >= 0.99, "{dtype}: cosine {cos} with f32");
        }
    }
    Ok(())
}

#[test]
fn text_mode_prints_a_cosine_table() -> anyhow::Result<()> {
    let texts = [
        "A man is eating food.",
        "A man is eating pasta.",
        "The sky is blue.",
    ];
    let emb = embed_json(&texts)?;
    let mut args = vec![];
    args.extend_from_slice(&texts);
    let out = run_ok(&args)?;
    ensure!(
        out.to_lowercase().contains("cosine"),
        "no cosine table:\n{out}"
    );
    for t in texts {
        ensure!(out.contains(t), "the sentence {t:?} is not listed:\n{out}");
    }
    // The table rows: "[i]" followed by one number per sentence.
    let rows: Vec<Vec<f32>> = out
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix('[')?;
            let (_, rest) = rest.split_once(']')?;
            let nums: Vec<f32> = rest
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            (nums.len() == texts.len()).then_some(nums)
        })
        .collect();
    ensure!(
        rows.len() == texts.len(),
        "expected a {n}x{n} table, found {} rows:\n{out}",
        rows.len(),
        n = texts.len()
    );
    for (i, row) in rows.iter().enumerate() {
        for (j, &shown) in row.iter().enumerate() {
            let want = cosine(&emb[i], &emb[j]);
            ensure!(
                (shown - want).abs() <= 1.5e-3,
                "table [{i}][{j}] = {shown}, the embeddings' cosine is {want}"
            );
        }
    }
    ensure!(
        rows[0][1] > rows[0][2],
        "food/pasta should be closer than food/sky"
    );
    Ok(())
}

#[test]
fn missing_or_empty_sentences_are_errors() -> anyhow::Result<()> {
    expect_error(&[], &["sentence"])?;
    expect_error(&["--format", "json"], &["sentence"])?;
    expect_error(&[""], &["empty"])?;
    expect_error(&["--format", "json", "fine", ""], &["empty"])?;
    expect_error(&["--dtype", "f8", "hi"], &["f8"])?;
    expect_error(
        &["--model", "/nonexistent/dir", "hi"],
        &["/nonexistent/dir"],
    )?;
    Ok(())
}

/// Runs `embed` (expecting success) and parses every stdout line as an embedding object
/// (only JSON lines on stdout: any progress or timing goes to stderr); returns them and stderr.
fn json_rows(args: &[&str]) -> anyhow::Result<(Vec<Embedding>, String)> {
    let out = run(args)?;
    ensure!(
        out.status.success(),
        "embed {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = String::from_utf8(out.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("a stdout line is not an embedding object")?;
    Ok((rows, String::from_utf8(out.stderr)?))
}

#[test]
fn a_file_streams_in_input_order_whatever_the_batch_size() -> anyhow::Result<()> {
    let dir = common::TempDir::new("embed-file")?;
    // Mixed lengths, out of length order, a blank line and a CRLF ending.
    let lines: Vec<String> = (0..40)
        .map(|i| {
            let n = 1 + (i * 13) % 37;
            format!("sentence {i} {}", vec!["word"; n].join(" "))
        })
        .collect();
    let mut body = lines.join("\n");
    body.push_str("\n\nlast one\r\n");
    let path = dir.write("corpus.txt", body.as_bytes())?;
    let path = path.to_str().context("temp path is not UTF-8")?;
    let mut want: Vec<String> = lines.clone();
    want.push("last one".to_string());
    let mut first: Option<Vec<Vec<f32>>> = None;
    for batch in ["1", "4", "32"] {
        let (rows, _) = json_rows(&["--format", "json", "--batch-size", batch, "--file", path])?;
        let texts: Vec<&str> = rows.iter().map(|r| r.text.as_str()).collect();
        ensure!(texts == want, "batch {batch}: order {texts:?}");
        let emb: Vec<Vec<f32>> = rows.into_iter().map(|r| r.embedding).collect();
        match &first {
            None => first = Some(emb),
            Some(f) => {
                for (i, (a, b)) in emb.iter().zip(f).enumerate() {
                    let d = a
                        .iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0f32, f32::max);
                    ensure!(d <= 1e-6, "batch {batch}, sentence {i}: differs by {d}");
                }
            }
        }
    }
    expect_error(&["--batch-size", "0", "hi"], &["batch size"])?;
    Ok(())
}

#[test]
fn text_mode_on_a_corpus_lists_nearest_neighbours() -> anyhow::Result<()> {
    let mut texts: Vec<String> = (0..14)
        .map(|i| format!("The sky is {i} shades of blue."))
        .collect();
    texts.push("A man is eating food.".to_string());
    texts.push("A man is eating pasta.".to_string());
    let args: Vec<&str> = texts.iter().map(String::as_str).collect();
    let out = run_ok(&args)?;
    ensure!(out.contains("nearest neighbour"), "{out}");
    ensure!(
        out.contains("[14] ->  [15]"),
        "food's neighbour should be pasta:\n{out}"
    );
    Ok(())
}

#[test]
fn stats_go_to_stderr_as_one_json_object() -> anyhow::Result<()> {
    let (rows, stderr) =
        json_rows(&["--format", "json", "--stats", "one sentence", "and another"])?;
    ensure!(rows.len() == 2, "{} rows", rows.len());
    let last = stderr.lines().last().context("nothing on stderr")?;
    let stats: serde_json::Value = serde_json::from_str(last).context("stats line")?;
    ensure!(stats["sentences"] == 2, "{stats}");
    let secs = |k: &str| stats[k].as_f64().with_context(|| format!("{k} in {stats}"));
    let (load, embed, total) = (secs("load_s")?, secs("embed_s")?, secs("total_s")?);
    ensure!(
        load >= 0.0 && embed > 0.0 && load + embed <= total,
        "times disagree: {stats}"
    );
    let rate = secs("sentences_per_s")?;
    ensure!((rate - 2.0 / embed).abs() <= 1e-6 * rate, "{stats}");
    Ok(())
}
