//! The contract of `examples/attention_dump.rs`:
//!
//! ```text
//! attention_dump "sentence" ["sentence2" ...] [--file F] [--model M] [--format text|json]
//!   [--out FILE] [--html FILE] [--layer L] [--head H] [--words]
//!   [--device cpu|cuda|metal|auto] [--dtype f32|f16|bf16] [--truncate]
//! ```
//!
//! `--format json` prints nothing but JSON Lines, one compact
//! `{"model", "text", "tokens", "token_text", "shape", "attentions"}` object per sentence, whose
//! attentions equal transformers' (golden fixture, 1e-4) and whose batched results equal
//! each sentence run alone (1e-5). `--layer`/`--head` slice the dump, `--words` merges word
//! pieces (key weights summed, query weights averaged), `--html` writes a self-contained
//! page. Every bad input exits non-zero with one `error: ...` line on stderr that names the
//! problem, and never a panic or a backtrace.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use anyhow::{ensure, Context};
use candle_core::Tensor;
use common::{repo_path, Fixture, KeyOrder, TempDir};
use serde::Deserialize;

const MODEL_NAME: &str = "sentence-transformers/all-MiniLM-L6-v2";
const LAYERS: usize = 6;
const HEADS: usize = 12;
const KEYS: [&str; 6] = [
    "model",
    "text",
    "tokens",
    "token_text",
    "shape",
    "attentions",
];
/// Rows of a softmax sum to 1 up to f32 rounding.
const ROW_TOL: f32 = 1e-4;
/// Against transformers' attentions.
const GOLDEN_TOL: f32 = 1e-4;
/// A sentence in a padded batch against the same sentence alone.
const BATCH_TOL: f32 = 1e-5;
/// f16 / bf16 storage against f32.
const HALF_TOL: f32 = 0.05;

const ANIMAL: &str = "The animal didn't cross the street because it was too tired.";
/// "croissants" and "unbelievably" split into several word pieces.
const SPLIT_WORDS: &str = "The croissants were unbelievably good.";

// ---------------------------------------------------------------------------------------
// Running the binary
// ---------------------------------------------------------------------------------------

/// The example binary, built once for all tests of this file.
fn dump_bin() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| common::example_bin("attention_dump").map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Runs `attention_dump` with `args` and extra environment variables. A backtrace is
/// asked for so that one leaking into an error message would show.
fn run_with_env(args: &[&OsStr], env: &[(&str, &str)]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(dump_bin()?);
    cmd.args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("NO_COLOR")
        .current_dir(repo_path(""));
    for (k, v) in env {
        cmd.env(k, v);
    }
    Ok(cmd.output()?)
}

/// Pretty command line for messages.
fn show(args: &[&OsStr]) -> String {
    args.iter()
        .map(|a| format!("{:?}", a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Expects success and returns stdout.
fn run_ok_os(args: &[&OsStr], env: &[(&str, &str)]) -> anyhow::Result<String> {
    let out = run_with_env(args, env)?;
    ensure!(
        out.status.success(),
        "attention_dump {} failed ({}): {}",
        show(args),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !stderr.contains("panicked"),
        "attention_dump {} panicked: {stderr}",
        show(args)
    );
    String::from_utf8(out.stdout).context("stdout is not UTF-8")
}

fn run_ok(args: &[&str]) -> anyhow::Result<String> {
    let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    run_ok_os(&args, &[])
}

/// Runs with `--format json` and parses (and checks) every line.
fn run_json(args: &[&str]) -> anyhow::Result<Vec<Dump>> {
    let mut all = vec!["--format", "json"];
    all.extend_from_slice(args);
    let stdout = run_ok(&all)?;
    parse_json_lines(&stdout).with_context(|| format!("attention_dump {all:?}"))
}

/// Expects failure: a non-zero exit, nothing on stdout, and exactly one line on stderr
/// that starts with `error:` and contains every one of `needles` (case-insensitive), with
/// no panic or backtrace.
fn expect_error_os(args: &[&OsStr], needles: &[&str]) -> anyhow::Result<String> {
    let out = run_with_env(args, &[])?;
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let what = format!("attention_dump {}", show(args));
    ensure!(
        !out.status.success(),
        "{what}: expected a failure, got success; stderr: {stderr}"
    );
    ensure!(
        out.status.code().is_some(),
        "{what}: killed by a signal ({}); stderr: {stderr}",
        out.status
    );
    let lower = stderr.to_lowercase();
    ensure!(
        !lower.contains("panicked") && !lower.contains("backtrace"),
        "{what}: panic or backtrace in stderr: {stderr}"
    );
    let trimmed = stderr.trim_end_matches('\n');
    ensure!(
        trimmed.lines().count() == 1,
        "{what}: expected one stderr line, got: {stderr:?}"
    );
    ensure!(
        trimmed.starts_with("error: "),
        "{what}: stderr does not start with `error: `: {stderr:?}"
    );
    for needle in needles {
        ensure!(
            lower.contains(&needle.to_lowercase()),
            "{what}: error message does not mention `{needle}`: {stderr:?}"
        );
    }
    ensure!(
        out.stdout.is_empty(),
        "{what}: stdout should be empty on error, got {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(stderr)
}

fn expect_error(args: &[&str], needles: &[&str]) -> anyhow::Result<String> {
    let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    expect_error_os(&args, needles)
}

/// Links (or, where links are not available, copies) `src` to `dst`.
fn link_or_copy(src: &Path, dst: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(src, dst)?;
    }
    #[cfg(not(unix))]
    {
        std::fs::copy(src, dst)?;
    }
    Ok(())
}

/// A model directory: the shipped weights linked in, config.json and tokenizer.json as
/// given (`None` = the shipped one).
fn model_dir(
    tag: &str,
    config: Option<&[u8]>,
    tokenizer: Option<&[u8]>,
) -> anyhow::Result<TempDir> {
    let dir = TempDir::new(tag)?;
    link_or_copy(
        &repo_path("weights/model.safetensors"),
        &dir.file("model.safetensors"),
    )?;
    match config {
        Some(bytes) => std::fs::write(dir.file("config.json"), bytes)?,
        None => {
            std::fs::copy(repo_path("weights/config.json"), dir.file("config.json"))?;
        }
    }
    match tokenizer {
        Some(bytes) => std::fs::write(dir.file("tokenizer.json"), bytes)?,
        None => {
            std::fs::copy(
                repo_path("weights/tokenizer.json"),
                dir.file("tokenizer.json"),
            )?;
        }
    }
    Ok(dir)
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .with_context(|| format!("non-UTF-8 temp path {}", p.display()))
}

// ---------------------------------------------------------------------------------------
// The JSON Lines
// ---------------------------------------------------------------------------------------

/// One line of `--format json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Dump {
    model: String,
    text: String,
    tokens: Vec<String>,
    token_text: Vec<String>,
    shape: [usize; 4],
    attentions: Vec<Vec<Vec<Vec<f32>>>>,
}

impl Dump {
    fn seq(&self) -> usize {
        self.shape[2]
    }

    /// `(layers, heads, seq, seq)` tensor of the attentions.
    fn tensor(&self) -> anyhow::Result<Tensor> {
        let flat: Vec<f32> = self
            .attentions
            .iter()
            .flatten()
            .flatten()
            .flatten()
            .copied()
            .collect();
        Ok(Tensor::from_vec(
            flat,
            self.shape.to_vec(),
            &candle_core::Device::Cpu,
        )?)
    }
}

/// Parses stdout that must hold nothing but JSON Lines and checks each object: keys in
/// order, compact, `shape` equal to the nested dimensions, finite weights in [0, 1], rows
/// summing to 1, tokens framed by `[CLS]` ... `[SEP]`.
fn parse_json_lines(stdout: &str) -> anyhow::Result<Vec<Dump>> {
    ensure!(!stdout.is_empty(), "no JSON on stdout");
    ensure!(
        stdout.ends_with('\n'),
        "the last JSON line has no trailing newline"
    );
    let mut dumps = Vec::new();
    for (n, line) in stdout.lines().enumerate() {
        ensure!(
            line.starts_with("{\"model\":"),
            "line {n} is not a compact JSON object starting with \"model\": {:?}",
            &line[..line.len().min(120)]
        );
        let keys: KeyOrder =
            serde_json::from_str(line).with_context(|| format!("line {n} is not JSON"))?;
        ensure!(
            keys.0 == KEYS,
            "line {n}: keys {:?}, expected exactly {KEYS:?} in this order",
            keys.0
        );
        let dump: Dump = serde_json::from_str(line).with_context(|| format!("line {n}"))?;
        check_dump(&dump).with_context(|| format!("line {n} ({:?})", dump.text))?;
        dumps.push(dump);
    }
    Ok(dumps)
}

fn check_dump(d: &Dump) -> anyhow::Result<()> {
    let [l, h, s, s2] = d.shape;
    ensure!(l >= 1 && h >= 1 && s >= 2 && s == s2, "shape {:?}", d.shape);
    ensure!(d.tokens.len() == s, "{} tokens for seq {s}", d.tokens.len());
    // Each token's decoded text: the WordPiece `##` gone, the words' spaces kept, and
    // together the pieces' text.
    ensure!(d.token_text.len() == s, "token_text {:?}", d.token_text);
    ensure!(
        d.token_text
            .iter()
            .all(|t| !t.is_empty() && !t.contains("##")),
        "token_text {:?}",
        d.token_text
    );
    let squeeze = |t: &str| t.split_whitespace().collect::<String>().to_lowercase();
    let pieces: String = d
        .tokens
        .iter()
        .map(|t| t.trim_start_matches("##"))
        .collect();
    ensure!(
        squeeze(&d.token_text.concat()) == squeeze(&pieces),
        "token_text {:?} against tokens {:?}",
        d.token_text,
        d.tokens
    );
    ensure!(
        d.tokens.first().map(String::as_str) == Some("[CLS]")
            && d.tokens.last().map(String::as_str) == Some("[SEP]"),
        "tokens are not framed by [CLS] ... [SEP]: {:?}",
        d.tokens
    );
    ensure!(
        d.attentions.len() == l,
        "{} layers for shape {:?}",
        d.attentions.len(),
        d.shape
    );
    for (li, heads) in d.attentions.iter().enumerate() {
        ensure!(
            heads.len() == h,
            "layer {li}: {} heads, shape {:?}",
            heads.len(),
            d.shape
        );
        for (hi, m) in heads.iter().enumerate() {
            ensure!(
                m.len() == s,
                "[{li}][{hi}]: {} rows, shape {:?}",
                m.len(),
                d.shape
            );
            for (i, row) in m.iter().enumerate() {
                ensure!(row.len() == s, "[{li}][{hi}][{i}]: {} columns", row.len());
                ensure!(
                    row.iter()
                        .all(|w| w.is_finite() && (0.0..=1.0 + 1e-6).contains(w)),
                    "[{li}][{hi}][{i}]: weight outside [0, 1] or not finite: {row:?}"
                );
                let sum: f32 = row.iter().sum();
                ensure!(
                    (sum - 1.0).abs() <= ROW_TOL,
                    "[{li}][{hi}][{i}]: row sums to {sum}"
                );
            }
        }
    }
    Ok(())
}

/// Largest absolute difference of two equally shaped dumps.
fn max_diff(a: &[Vec<Vec<Vec<f32>>>], b: &[Vec<Vec<Vec<f32>>>]) -> anyhow::Result<f32> {
    let fa: Vec<f32> = a.iter().flatten().flatten().flatten().copied().collect();
    let fb: Vec<f32> = b.iter().flatten().flatten().flatten().copied().collect();
    ensure!(fa.len() == fb.len(), "{} vs {} weights", fa.len(), fb.len());
    Ok(fa
        .iter()
        .zip(&fb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max))
}

fn assert_same_dump(actual: &Dump, expected: &Dump, tol: f32, what: &str) -> anyhow::Result<()> {
    ensure!(
        actual.text == expected.text,
        "{what}: text {:?} vs {:?}",
        actual.text,
        expected.text
    );
    ensure!(
        actual.model == expected.model,
        "{what}: model {:?} vs {:?}",
        actual.model,
        expected.model
    );
    ensure!(
        actual.tokens == expected.tokens,
        "{what}: tokens {:?} vs {:?}",
        actual.tokens,
        expected.tokens
    );
    ensure!(
        actual.shape == expected.shape,
        "{what}: shape {:?} vs {:?}",
        actual.shape,
        expected.shape
    );
    let d = max_diff(&actual.attentions, &expected.attentions)?;
    ensure!(d <= tol, "{what}: max |diff| = {d:e} > {tol:e}");
    Ok(())
}

/// `(key, text, tokens)` of the golden fixture's sentences.
fn golden_sentences(fx: &Fixture) -> anyhow::Result<Vec<(String, String, Vec<String>)>> {
    let list = fx.meta["sentences"]
        .as_array()
        .context("encoder_golden.json has no `sentences`")?;
    list.iter()
        .map(|s| {
            let key = s["key"].as_str().context("sentence without key")?;
            let text = s["text"].as_str().context("sentence without text")?;
            let tokens = s["tokens"]
                .as_array()
                .context("sentence without tokens")?
                .iter()
                .map(|t| {
                    t.as_str()
                        .map(str::to_string)
                        .context("token is not a string")
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok((key.to_string(), text.to_string(), tokens))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// JSON: golden values, batching, files
// ---------------------------------------------------------------------------------------

#[test]
fn json_attentions_match_transformers() -> anyhow::Result<()> {
    let fx = Fixture::open("encoder_golden")?;
    let sentences = golden_sentences(&fx)?;
    ensure!(sentences.len() >= 3, "the fixture has too few sentences");
    for (key, text, tokens) in &sentences {
        let dumps = run_json(&[text])?;
        ensure!(
            dumps.len() == 1,
            "{key}: {} lines for one sentence",
            dumps.len()
        );
        let d = &dumps[0];
        ensure!(d.model == MODEL_NAME, "{key}: model {:?}", d.model);
        ensure!(&d.text == text, "{key}: text {:?}", d.text);
        ensure!(
            &d.tokens == tokens,
            "{key}: tokens {:?}, expected {tokens:?}",
            d.tokens
        );
        ensure!(
            d.shape == [LAYERS, HEADS, tokens.len(), tokens.len()],
            "{key}: shape {:?}",
            d.shape
        );
        let want = fx.tensor(&format!("{key}.attentions"))?;
        common::assert_close(
            &d.tensor()?,
            &want,
            GOLDEN_TOL,
            &format!("{key} attentions"),
        )?;
    }
    Ok(())
}

#[test]
fn several_sentences_equal_each_alone() -> anyhow::Result<()> {
    let texts = [
        ANIMAL,
        "Hello world!",
        "In 2019, the naïve café owner in Zürich sold 1,250 croissants at 3.50 francs — a record!",
        "Short.",
    ];
    let together = run_json(&texts)?;
    ensure!(
        together.len() == texts.len(),
        "{} lines for {} sentences",
        together.len(),
        texts.len()
    );
    let lens: Vec<usize> = together.iter().map(Dump::seq).collect();
    ensure!(
        lens.iter().collect::<std::collections::BTreeSet<_>>().len() == lens.len(),
        "the test needs sentences of different lengths: {lens:?}"
    );
    for (i, text) in texts.iter().enumerate() {
        ensure!(
            together[i].text == *text,
            "line {i} is {:?}, expected {text:?} (order)",
            together[i].text
        );
        let alone = run_json(&[text])?;
        ensure!(alone.len() == 1, "{} lines for one sentence", alone.len());
        assert_same_dump(
            &together[i],
            &alone[0],
            BATCH_TOL,
            &format!("sentence {i} batched vs alone"),
        )?;
    }
    Ok(())
}

#[test]
fn file_gives_the_same_as_positional_arguments() -> anyhow::Result<()> {
    let texts = [
        ANIMAL,
        "Hello world!",
        "A third, longer sentence about nothing in particular.",
    ];
    let positional = run_json(&texts)?;
    let dir = TempDir::new("file")?;
    let file = dir.file("sentences.txt");
    // A blank line, a whitespace-only line and a Windows line ending are not sentences.
    std::fs::write(
        &file,
        format!("{}\n\n{}\r\n   \n{}\n", texts[0], texts[1], texts[2]),
    )?;
    let from_file = run_json(&["--file", path_str(&file)?])?;
    ensure!(
        from_file.len() == texts.len(),
        "{} lines from a file of {} sentences: {:?}",
        from_file.len(),
        texts.len(),
        from_file.iter().map(|d| &d.text).collect::<Vec<_>>()
    );
    for (i, (a, b)) in from_file.iter().zip(&positional).enumerate() {
        assert_same_dump(a, b, BATCH_TOL, &format!("sentence {i} from --file"))?;
    }
    // Sorted by length into batches of any size, the lines come back in input order.
    for batch in ["1", "2"] {
        let sorted = run_json(&["--batch-size", batch, "--file", path_str(&file)?])?;
        ensure!(sorted.len() == texts.len());
        for (i, (a, b)) in sorted.iter().zip(&positional).enumerate() {
            assert_same_dump(
                a,
                b,
                BATCH_TOL,
                &format!("sentence {i}, batches of {batch}"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn layer_and_head_select_a_slice() -> anyhow::Result<()> {
    let full = run_json(&[ANIMAL])?;
    let full = &full[0];
    let s = full.seq();
    ensure!(
        full.shape == [LAYERS, HEADS, s, s],
        "full shape {:?}",
        full.shape
    );

    let one = run_json(&["--layer", "2", "--head", "5", ANIMAL])?;
    ensure!(one.len() == 1);
    ensure!(
        one[0].shape == [1, 1, s, s],
        "--layer 2 --head 5: shape {:?}",
        one[0].shape
    );
    ensure!(one[0].tokens == full.tokens);
    let d = max_diff(&one[0].attentions, &[vec![full.attentions[2][5].clone()]])?;
    ensure!(
        d <= BATCH_TOL,
        "--layer 2 --head 5 differs from the full dump's [2][5] by {d}"
    );

    let layer = run_json(&["--layer", "2", ANIMAL])?;
    ensure!(
        layer[0].shape == [1, HEADS, s, s],
        "--layer 2: shape {:?}",
        layer[0].shape
    );
    let d = max_diff(&layer[0].attentions, &[full.attentions[2].clone()])?;
    ensure!(
        d <= BATCH_TOL,
        "--layer 2 differs from the full dump's [2] by {d}"
    );

    let head = run_json(&["--head", "5", ANIMAL])?;
    ensure!(
        head[0].shape == [LAYERS, 1, s, s],
        "--head 5: shape {:?}",
        head[0].shape
    );
    let want: Vec<Vec<Vec<Vec<f32>>>> =
        full.attentions.iter().map(|l| vec![l[5].clone()]).collect();
    let d = max_diff(&head[0].attentions, &want)?;
    ensure!(
        d <= BATCH_TOL,
        "--head 5 differs from the full dump's [..][5] by {d}"
    );

    // The last layer and head are valid.
    let last = run_json(&["--layer", "5", "--head", "11", ANIMAL])?;
    let d = max_diff(&last[0].attentions, &[vec![full.attentions[5][11].clone()]])?;
    ensure!(d <= BATCH_TOL, "--layer 5 --head 11 differs by {d}");
    Ok(())
}

#[test]
fn out_writes_the_same_json_lines() -> anyhow::Result<()> {
    let texts = [ANIMAL, "Hello world!"];
    let stdout = run_json(&texts)?;
    let dir = TempDir::new("out")?;

    // Text mode on stdout, JSON into the file.
    let file = dir.file("text-mode.jsonl");
    let text = run_ok(&["--out", path_str(&file)?, texts[0], texts[1]])?;
    ensure!(
        !text.contains("{\"model\""),
        "text mode with --out printed JSON on stdout"
    );
    let written = parse_json_lines(&std::fs::read_to_string(&file)?)?;
    ensure!(written.len() == 2, "{} lines in --out", written.len());
    for (i, (a, b)) in written.iter().zip(&stdout).enumerate() {
        assert_same_dump(a, b, 0.0, &format!("--out line {i}"))?;
    }

    // JSON format with --out: the file instead of stdout.
    let file = dir.file("json-mode.jsonl");
    let out = run_ok(&[
        "--format",
        "json",
        "--out",
        path_str(&file)?,
        texts[0],
        texts[1],
    ])?;
    ensure!(
        out.trim().is_empty(),
        "--format json --out FILE also printed to stdout: {out:?}"
    );
    let written = parse_json_lines(&std::fs::read_to_string(&file)?)?;
    ensure!(written.len() == 2, "{} lines in --out", written.len());
    for (i, (a, b)) in written.iter().zip(&stdout).enumerate() {
        assert_same_dump(a, b, 0.0, &format!("--format json --out line {i}"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// --words
// ---------------------------------------------------------------------------------------

/// Word-piece groups of a piece-level token list: a `##` piece continues the word before
/// it; `[CLS]` and `[SEP]` stand alone.
fn piece_groups(tokens: &[String]) -> Vec<std::ops::Range<usize>> {
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if t.starts_with("##") => g.end = i + 1,
            _ => groups.push(i..i + 1),
        }
    }
    groups
}

#[test]
fn words_merge_pieces_keys_summed_queries_averaged() -> anyhow::Result<()> {
    let pieces = run_json(&[SPLIT_WORDS])?;
    let pieces = &pieces[0];
    let groups = piece_groups(&pieces.tokens);
    ensure!(
        groups.iter().any(|g| g.len() >= 2),
        "the test sentence should have a word split into pieces: {:?}",
        pieces.tokens
    );

    let words = run_json(&["--words", SPLIT_WORDS])?;
    ensure!(words.len() == 1);
    let words = &words[0];
    ensure!(words.text == SPLIT_WORDS && words.model == MODEL_NAME);
    ensure!(
        words.tokens.iter().all(|t| !t.starts_with("##")),
        "--words left word pieces: {:?}",
        words.tokens
    );
    ensure!(
        words.tokens.len() < pieces.tokens.len() && words.tokens.len() == groups.len(),
        "--words gives {} words {:?} for {} pieces {:?} ({} words expected)",
        words.tokens.len(),
        words.tokens,
        pieces.tokens.len(),
        pieces.tokens,
        groups.len()
    );
    for (w, g) in words.tokens.iter().zip(&groups) {
        let joined: String = pieces.tokens[g.clone()]
            .iter()
            .map(|t| t.trim_start_matches("##"))
            .collect();
        ensure!(
            w.to_lowercase() == joined.to_lowercase(),
            "word {w:?} does not match its pieces {:?}",
            &pieces.tokens[g.clone()]
        );
    }
    let n = groups.len();
    ensure!(
        words.shape == [LAYERS, HEADS, n, n],
        "--words shape {:?}",
        words.shape
    );

    // W[I][J] = mean over pieces i of I of (sum over pieces j of J of A[i][j]).
    let mut worst = 0f32;
    for (l, heads) in pieces.attentions.iter().enumerate() {
        for (h, a) in heads.iter().enumerate() {
            for (wi, gi) in groups.iter().enumerate() {
                for (wj, gj) in groups.iter().enumerate() {
                    let sum: f32 = gi
                        .clone()
                        .map(|i| gj.clone().map(|j| a[i][j]).sum::<f32>())
                        .sum();
                    let want = sum / gi.len() as f32;
                    worst = worst.max((words.attentions[l][h][wi][wj] - want).abs());
                }
            }
        }
    }
    ensure!(
        worst <= 1e-5,
        "--words differs from key-sum / query-mean of the pieces by {worst}"
    );

    // With a slice, the words view is the slice of the full words view.
    let one = run_json(&["--words", "--layer", "3", "--head", "7", SPLIT_WORDS])?;
    ensure!(
        one[0].shape == [1, 1, n, n],
        "--words --layer 3 --head 7: shape {:?}",
        one[0].shape
    );
    ensure!(one[0].tokens == words.tokens);
    let d = max_diff(&one[0].attentions, &[vec![words.attentions[3][7].clone()]])?;
    ensure!(d <= BATCH_TOL, "--words --layer 3 --head 7 differs by {d}");

    // A sentence whose words are all single pieces is unchanged (up to the labels' case).
    let plain = run_json(&["Hello world!"])?;
    let plain_words = run_json(&["--words", "Hello world!"])?;
    ensure!(plain_words[0].shape == plain[0].shape);
    let d = max_diff(&plain_words[0].attentions, &plain[0].attentions)?;
    ensure!(
        d <= 1e-6,
        "--words changed a sentence without split words by {d}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// --html
// ---------------------------------------------------------------------------------------

/// The text as JSON inside a `<script>`: `<`, `>`, `&` written as `\u003c`, `\u003e`,
/// `\u0026`.
fn script_json(text: &str) -> anyhow::Result<String> {
    Ok(serde_json::to_string(text)?
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026"))
}

#[test]
fn html_is_one_self_contained_page() -> anyhow::Result<()> {
    let dir = TempDir::new("html")?;
    let tricky = "She said \"</script><b>hi</b>\" & left — naïve café.";
    let file = dir.file("view.html");
    let stdout = run_ok(&[
        "--format",
        "json",
        "--html",
        path_str(&file)?,
        tricky,
        ANIMAL,
    ])?;
    // --html does not disturb the JSON on stdout.
    let dumps = parse_json_lines(&stdout)?;
    ensure!(dumps.len() == 2);

    let page = std::fs::read_to_string(&file)?;
    let lower = page.to_lowercase();
    ensure!(
        lower.contains("<html") && lower.contains("</html>"),
        "not an HTML page"
    );
    ensure!(lower.contains("<script"), "no inline script");
    ensure!(
        !lower.contains("<script src"),
        "the page loads an external script"
    );
    ensure!(
        !lower.contains("<link"),
        "the page links an external resource"
    );
    for attr in [
        "src=\"http",
        "src='http",
        "href=\"http",
        "href='http",
        "@import",
        "url(http",
    ] {
        ensure!(
            !lower.contains(attr),
            "the page fetches from the network: `{attr}`"
        );
    }
    ensure!(
        !page.contains("/*__ATTENTION_DATA__*/null")
            && !page.contains("/*__ATTENTION_META__*/null"),
        "a data placeholder was left in the page"
    );
    for text in [tricky, ANIMAL] {
        let escaped = script_json(text)?;
        ensure!(
            page.contains(&escaped),
            "the page does not hold the sentence as {escaped}"
        );
    }
    ensure!(
        !page.contains("</script><b>"),
        "the sentence's </script> leaked into the page unescaped"
    );
    ensure!(
        !page.contains("<b>hi</b>"),
        "the sentence's markup leaked unescaped"
    );
    ensure!(
        page.contains("\"attentions\""),
        "the page holds no attention data"
    );

    // Text mode with --html also writes the page.
    let file = dir.file("text-mode.html");
    let text = run_ok(&["--html", path_str(&file)?, "--words", SPLIT_WORDS])?;
    ensure!(text.contains("layer"), "text mode output missing: {text}");
    let page = std::fs::read_to_string(&file)?;
    ensure!(page.contains(&script_json(SPLIT_WORDS)?));
    ensure!(!page.contains("/*__ATTENTION_DATA__*/null"));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Text mode
// ---------------------------------------------------------------------------------------

#[test]
fn text_mode_shows_a_head_and_the_hint() -> anyhow::Result<()> {
    let out = run_ok(&[ANIMAL])?;
    for needle in ["layer", "head", "--format json", "animal", "[CLS]", "[SEP]"] {
        ensure!(out.contains(needle), "text output lacks `{needle}`:\n{out}");
    }
    ensure!(!out.contains("{\"model\""), "text mode printed JSON");

    let out = run_ok(&["--layer", "1", "--head", "3", ANIMAL])?;
    ensure!(
        out.contains("layer 1, head 3"),
        "--layer 1 --head 3 not shown:\n{out}"
    );

    let out = run_ok(&["--layer", "4", ANIMAL])?;
    ensure!(
        out.contains("layer 4, head "),
        "--layer 4 not honoured:\n{out}"
    );

    let out = run_ok(&["--words", SPLIT_WORDS])?;
    ensure!(
        out.contains("croissants"),
        "--words text mode lacks the merged word:\n{out}"
    );

    let args = [OsStr::new(ANIMAL), OsStr::new("Hello world!")];
    let out = run_ok_os(&args, &[("NO_COLOR", "1")])?;
    ensure!(
        !out.contains('\x1b'),
        "escape bytes in stdout with NO_COLOR=1"
    );
    ensure!(
        out.contains("layer") && out.contains("Hello world!"),
        "two-sentence output:\n{out}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Dtypes
// ---------------------------------------------------------------------------------------

#[test]
fn half_precision_runs_and_stays_close_to_f32() -> anyhow::Result<()> {
    let texts = [ANIMAL, "Hello world!"];
    let f32_dumps = run_json(&texts)?;
    for dtype in ["f16", "bf16"] {
        // run_json checks rows sum to 1 and every weight is finite.
        let dumps = run_json(&["--dtype", dtype, texts[0], texts[1]])?;
        ensure!(dumps.len() == 2);
        for (a, b) in dumps.iter().zip(&f32_dumps) {
            ensure!(
                a.tokens == b.tokens && a.shape == b.shape,
                "{dtype}: tokens or shape differ"
            );
            let d = max_diff(&a.attentions, &b.attentions)?;
            ensure!(
                d <= HALF_TOL,
                "{dtype} differs from f32 by {d} on {:?}",
                a.text
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Long inputs
// ---------------------------------------------------------------------------------------

#[test]
fn too_long_fails_unless_truncated() -> anyhow::Result<()> {
    let long = vec!["word"; 600].join(" ");
    expect_error(&["--format", "json", &long], &["512"])?;
    expect_error(&[&long], &["512"])?;

    let dumps = run_json(&[
        "--truncate",
        "--layer",
        "0",
        "--head",
        "0",
        &long,
        "Hello world!",
    ])?;
    ensure!(dumps.len() == 2);
    ensure!(
        dumps[0].shape == [1, 1, 512, 512],
        "--truncate: shape {:?}",
        dumps[0].shape
    );
    ensure!(
        dumps[1].shape == [1, 1, 5, 5],
        "short sentence next to a truncated one: {:?}",
        dumps[1].shape
    );

    // Exactly 512 tokens fits ([CLS] + 510 words + [SEP]).
    let fits = vec!["word"; 510].join(" ");
    let dumps = run_json(&["--layer", "5", "--head", "11", &fits])?;
    ensure!(
        dumps[0].shape == [1, 1, 512, 512],
        "512 tokens: shape {:?}",
        dumps[0].shape
    );
    let over = vec!["word"; 511].join(" ");
    expect_error(&[&over], &["512"])?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

#[test]
fn missing_or_empty_sentences_are_errors() -> anyhow::Result<()> {
    expect_error(&[], &["sentence"])?;
    expect_error(&["--format", "json"], &["sentence"])?;
    expect_error(&[""], &["empty"])?;
    expect_error(&["--format", "json", "fine", ""], &["empty"])?;
    let msg = expect_error(&["   "], &[])?;
    ensure!(
        msg.contains("whitespace") || msg.contains("empty"),
        "a whitespace-only sentence should be called empty or whitespace: {msg}"
    );
    Ok(())
}

#[test]
fn file_errors_name_the_file() -> anyhow::Result<()> {
    let dir = TempDir::new("file-errors")?;
    let missing = dir.file("does-not-exist.txt");
    expect_error(&["--file", path_str(&missing)?], &["does-not-exist.txt"])?;

    let bad = dir.file("latin1.txt");
    std::fs::write(&bad, b"caf\xe9 au lait\nsecond line \xff\xfe\n")?;
    expect_error(&["--file", path_str(&bad)?], &["UTF-8", "latin1.txt"])?;

    let blank = dir.file("blank.txt");
    std::fs::write(&blank, "\n   \n\n")?;
    expect_error(&["--file", path_str(&blank)?], &["sentence"])?;
    Ok(())
}

#[test]
fn out_of_range_layer_or_head_is_an_error() -> anyhow::Result<()> {
    expect_error(&["--layer", "99", "hi"], &["layer", "99"])?;
    expect_error(&["--format", "json", "--layer", "6", "hi"], &["layer", "6"])?;
    expect_error(&["--head", "12", "hi"], &["head", "12"])?;
    expect_error(
        &["--format", "json", "--layer", "0", "--head", "99", "hi"],
        &["head", "99"],
    )?;
    Ok(())
}

#[test]
fn unavailable_device_or_dtype_is_an_error() -> anyhow::Result<()> {
    if !cfg!(feature = "cuda") {
        expect_error(&["--device", "cuda", "hi"], &["cuda", "feature"])?;
        expect_error(
            &["--device", "cuda:1", "--format", "json", "hi"],
            &["cuda", "feature"],
        )?;
    }
    if !cfg!(feature = "metal") {
        expect_error(&["--device", "metal", "hi"], &["metal", "feature"])?;
    }
    expect_error(&["--device", "tpu", "hi"], &["tpu"])?;
    expect_error(&["--dtype", "f8", "hi"], &["f8", "dtype"])?;
    // auto falls back to what this build has.
    let dumps = run_json(&["--device", "auto", "Hello world!"])?;
    ensure!(dumps.len() == 1);
    Ok(())
}

#[test]
fn bad_models_are_errors_that_name_the_problem() -> anyhow::Result<()> {
    expect_error(
        &["--model", "/nonexistent/dir", "hi"],
        &["/nonexistent/dir"],
    )?;
    // GGUF files: missing, not GGUF, or without tokenizer metadata.
    expect_error(
        &["--model", "/nonexistent/model.gguf", "hi"],
        &["/nonexistent/model.gguf"],
    )?;
    let not_gguf = repo_path("weights/config.json");
    let renamed = TempDir::new("not-gguf")?;
    let fake = renamed.file("model.gguf");
    std::fs::copy(&not_gguf, &fake)?;
    expect_error(
        &["--model", path_str(&fake)?, "hi"],
        &["model.gguf", "GGUF"],
    )?;
    let untokenized = repo_path("tests/fixtures/gguf/llama_gqa.f32.gguf");
    expect_error(
        &["--model", path_str(&untokenized)?, "hi"],
        &["llama_gqa.f32.gguf", "tokenizer.ggml.model"],
    )?;

    let garbage = model_dir(
        "garbage-tokenizer",
        None,
        Some(b"\x00\x01 this is not json"),
    )?;
    expect_error(&["--model", path_str(&garbage.0)?, "hi"], &["tokenizer"])?;
    let not_a_tokenizer = model_dir("json-tokenizer", None, Some(br#"{"hello": "world"}"#))?;
    expect_error(
        &["--model", path_str(&not_a_tokenizer.0)?, "hi"],
        &["tokenizer"],
    )?;

    let config = std::fs::read_to_string(repo_path("weights/config.json"))?;
    ensure!(config.contains("\"num_hidden_layers\": 6") && config.contains("\"hidden_size\": 384"));
    let zero_layers = config.replace("\"num_hidden_layers\": 6", "\"num_hidden_layers\": 0");
    let dir = model_dir("zero-layers", Some(zero_layers.as_bytes()), None)?;
    expect_error(
        &["--model", path_str(&dir.0)?, "hi"],
        &["num_hidden_layers"],
    )?;

    let negative = config.replace("\"hidden_size\": 384", "\"hidden_size\": -384");
    let dir = model_dir("negative-hidden", Some(negative.as_bytes()), None)?;
    expect_error(
        &["--format", "json", "--model", path_str(&dir.0)?, "hi"],
        &["hidden_size"],
    )?;

    let dir = model_dir("config-not-json", Some(b"{ not json"), None)?;
    expect_error(&["--model", path_str(&dir.0)?, "hi"], &["config.json"])?;

    // A directory without weights names the file it lacks.
    let dir = TempDir::new("no-weights")?;
    std::fs::copy(repo_path("weights/config.json"), dir.file("config.json"))?;
    std::fs::copy(
        repo_path("weights/tokenizer.json"),
        dir.file("tokenizer.json"),
    )?;
    expect_error(
        &["--model", path_str(&dir.0)?, "hi"],
        &["model.safetensors"],
    )?;

    // A good copy of the model works and reports its name.
    let good = model_dir("good", None, None)?;
    let name = path_str(&good.0)?;
    let dumps = run_json(&["--model", name, "Hello world!"])?;
    ensure!(
        dumps[0].model == name,
        "model field {:?}, expected {name:?}",
        dumps[0].model
    );
    let default = run_json(&["Hello world!"])?;
    let d = max_diff(&dumps[0].attentions, &default[0].attentions)?;
    ensure!(
        d == 0.0,
        "a copy of the shipped model gives different attentions ({d})"
    );
    Ok(())
}

/// Sanity check of the helpers on a known grouping.
#[test]
fn piece_groups_follow_double_hash_pieces() {
    let t: Vec<String> = ["[CLS]", "cr", "##ois", "##sant", "##s", "at", "[SEP]"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(piece_groups(&t), vec![0..1, 1..5, 5..6, 6..7]);
}

/// A LLaMA-family decoder (`model_type` llama / mistral): every layer and head, causal
/// weights (and zero outside Mistral's sliding window), rows summing to 1, equal to the
/// library's `LlamaModel::attentions`. The tiny fixtures get a word-level tokenizer.
#[test]
fn decoders_dump_causal_attentions() -> anyhow::Result<()> {
    use candle_attention::LlamaModel;
    let sentence = "the cat sat on the mat because the dog ran to it and it was tired";
    for (case, window) in [("llama_gqa", None), ("mistral_window", Some(5usize))] {
        let dir = common::TempDir::new(&format!("dump-{case}"))?;
        let src = common::repo_path(&format!("tests/fixtures/decoders/{case}"));
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dir.file(f))?;
        }
        std::fs::copy(
            common::repo_path("tests/fixtures/decoders/wordlevel_tokenizer.json"),
            dir.file("tokenizer.json"),
        )?;
        let page = dir.file("view.html");
        let out = std::process::Command::new(common::example_bin("attention_dump")?)
            .args([
                "--model",
                dir.0.to_str().unwrap_or_default(),
                "--format",
                "json",
                "--html",
                page.to_str().unwrap_or_default(),
                sentence,
            ])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let obj: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
        // Both fixtures have 4 query heads over 2 K/V heads: the page groups them by two.
        let html = std::fs::read_to_string(&page)?;
        assert!(
            html.contains("\"kv_group\":2"),
            "{case}: the page's K/V groups"
        );
        let n = sentence.split(' ').count();
        assert_eq!(obj["shape"], serde_json::json!([2, 4, n, n]), "{case}");
        let model =
            LlamaModel::from_dir(&dir.0, candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let ids: Vec<u32> = obj["tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                let t = t.as_str().unwrap_or_default();
                [
                    "the", "cat", "sat", "on", "mat", "and", "a", "dog", "ran", "to", "it", "was",
                    "tired", "because", "street", "cross",
                ]
                .iter()
                .position(|w| *w == t)
                .map_or(0, |p| p as u32 + 1)
            })
            .collect();
        let want = model.attentions(
            &candle_core::Tensor::new(ids.as_slice(), &candle_core::Device::Cpu)?.unsqueeze(0)?,
        )?;
        for l in 0..2 {
            let want: Vec<Vec<Vec<f32>>> = want[l].squeeze(0)?.to_vec3()?;
            for h in 0..4 {
                for i in 0..n {
                    let row: Vec<f64> = obj["attentions"][l][h][i]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_f64())
                        .collect();
                    assert!(
                        (row.iter().sum::<f64>() - 1.0).abs() < 1e-5,
                        "{case} {l} {h} {i}"
                    );
                    for (j, &w) in row.iter().enumerate() {
                        let hidden = j > i || window.is_some_and(|win| j + win <= i);
                        if hidden {
                            assert_eq!(w, 0.0, "{case} layer {l} head {h}: {i} -> {j}");
                        }
                        assert!(
                            (w - want[h][i][j] as f64).abs() < 1e-6,
                            "{case}: equals the library"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// --explain
// ---------------------------------------------------------------------------------------

/// Each JSON line of `args` (with `--format json`), parsed as it is.
fn json_values(args: &[&str]) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut all = vec!["--format", "json"];
    all.extend_from_slice(args);
    run_ok(&all)?
        .lines()
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

fn matrix_of(v: &serde_json::Value) -> anyhow::Result<Vec<Vec<f32>>> {
    Ok(serde_json::from_value(v.clone())?)
}

/// `--explain` adds `"explain"` after the other fields, which stay as they are: rollout's
/// rows sum to 1; grad names its target and text, its value is the cosine similarity, and
/// its matrix equals transformers' (the golden fixture); norm has every layer and head;
/// `--words` gives matrices over words.
#[test]
fn explain_adds_its_object_to_each_sentence() -> anyhow::Result<()> {
    let fx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(repo_path(
        "tests/fixtures/explain/minilm.json",
    ))?)?;
    let case = &fx["cases"][0];
    let (text, against) = (
        case["text"].as_str().context("text")?,
        case["against"].as_str().context("against")?,
    );
    for v in json_values(&["--explain", "rollout", text, ANIMAL])? {
        let keys: Vec<&str> = v
            .as_object()
            .context("object")?
            .keys()
            .map(String::as_str)
            .collect();
        let mut want = KEYS.to_vec();
        want.push("explain");
        let mut sorted_keys = keys.clone();
        sorted_keys.sort_unstable();
        want.sort_unstable();
        ensure!(sorted_keys == want, "keys {keys:?}");
        ensure!(v["explain"]["method"] == "rollout");
        let m = matrix_of(&v["explain"]["matrix"])?;
        let n = v["tokens"].as_array().context("tokens")?.len();
        ensure!(
            m.len() == n && m.iter().all(|r| r.len() == n),
            "rollout is not (seq, seq)"
        );
        for row in &m {
            ensure!(
                (row.iter().sum::<f32>() - 1.0).abs() < 1e-4,
                "a rollout row sums to {}",
                row.iter().sum::<f32>()
            );
        }
    }
    let v = &json_values(&["--explain", "grad", "--against", against, text])?[0];
    let e = &v["explain"];
    ensure!(
        e["method"] == "grad" && e["target"] == "cosine" && e["against"] == against,
        "{e}"
    );
    let value = e["value"].as_f64().context("value")?;
    let want_value = case["grad"]["value"].as_f64().context("fixture value")?;
    ensure!(
        (value - want_value).abs() < 1e-5,
        "cosine {value} vs {want_value}"
    );
    let got: Vec<f32> = matrix_of(&e["matrix"])?.concat();
    let want: Vec<f32> = matrix_of(&case["grad"]["matrix"])?.concat();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    ensure!(
        got.len() == want.len() && worst <= 1e-4 * scale,
        "grad differs by {worst}"
    );
    let v = &json_values(&["--explain", "norm", "--layer", "1", "--head", "2", text])?[0];
    let norms: Vec<Vec<Vec<Vec<f32>>>> = serde_json::from_value(v["explain"]["norms"].clone())?;
    ensure!(
        norms.len() == LAYERS && norms.iter().all(|l| l.len() == HEADS),
        "norms are not [layers][heads]"
    );
    let words = &json_values(&["--words", "--explain", "rollout", SPLIT_WORDS])?[0];
    let n = words["tokens"].as_array().context("tokens")?.len();
    ensure!(
        matrix_of(&words["explain"]["matrix"])?.len() == n,
        "--words: not over words"
    );
    Ok(())
}

/// The terminal names the method and ranks the input tokens for `[CLS]`.
#[test]
fn explain_in_the_terminal_ranks_tokens() -> anyhow::Result<()> {
    let out = run_ok(&["--explain", "norm", "--no-color", ANIMAL])?;
    ensure!(out.contains("explanation: value-weighted norms"), "{out}");
    ensure!(out.contains("ranked for \"[CLS]\" (row 0): "), "{out}");
    Ok(())
}

#[test]
fn explain_errors_name_the_missing_piece() -> anyhow::Result<()> {
    expect_error(&["--explain", "grad", ANIMAL], &["--against"])?;
    expect_error(&["--against", "a text", ANIMAL], &["--against"])?;
    expect_error(
        &[
            "--explain",
            "grad",
            "--against",
            "x",
            "--target-token",
            "3",
            ANIMAL,
        ],
        &["--target-token"],
    )?;
    Ok(())
}

/// `--svg` writes the heatmap that is shown as a standalone picture: the head without
/// `--explain`, the explanation with it; one file per sentence (`stem-N.svg` after the
/// first); JSON output is unchanged by it.
#[test]
fn svg_writes_the_shown_heatmap() -> anyhow::Result<()> {
    let dir = TempDir::new("svg")?;
    let svg = dir.file("map.svg");
    let svg_arg = path_str(&svg)?;
    run_ok(&["--svg", svg_arg, "--no-color", ANIMAL, "A second sentence."])?;
    let first = std::fs::read_to_string(&svg)?;
    ensure!(
        first.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
        "not an SVG"
    );
    ensure!(
        first.contains(">layer ") && first.contains(">street</text>"),
        "no head title or tokens"
    );
    let second = std::fs::read_to_string(dir.file("map-2.svg"))?;
    ensure!(
        second.contains(">second</text>"),
        "the second sentence's picture"
    );
    run_ok(&[
        "--svg",
        svg_arg,
        "--explain",
        "rollout",
        "--format",
        "json",
        ANIMAL,
    ])?;
    let explained = std::fs::read_to_string(&svg)?;
    ensure!(
        explained.contains(">attention rollout"),
        "not the explanation's picture"
    );
    Ok(())
}

/// With `--explain`, the page carries the explanation for its own view (and a tab for it).
#[test]
fn html_carries_the_explanation() -> anyhow::Result<()> {
    let dir = TempDir::new("html-explain")?;
    let file = dir.file("view.html");
    run_ok(&[
        "--html",
        path_str(&file)?,
        "--explain",
        "grad",
        "--against",
        "A tired animal.",
        "--no-color",
        ANIMAL,
    ])?;
    let page = std::fs::read_to_string(&file)?;
    ensure!(
        page.contains("\"explain\":{\"method\":\"grad\""),
        "no explanation in the page data"
    );
    ensure!(page.contains("id=\"tab-explain\""), "no explanation tab");
    Ok(())
}

/// `--chat`: a decoder's sentence put in its chat template (the directory's
/// `tokenizer_config.json`) after `--system`'s message, tokenized with no `<s>` added; the
/// weights still causal rows summing to 1. Without a template, or on an encoder, an error.
#[test]
fn chat_dumps_the_templated_prompt() -> anyhow::Result<()> {
    let dir = common::chat_decoder_dir("dump-chat")?;
    let model = path_str(&dir.0)?;
    let dump = |extra: &[&str]| -> anyhow::Result<serde_json::Value> {
        let mut args = vec!["--model", model, "--format", "json"];
        args.extend_from_slice(extra);
        let out = Command::new(dump_bin()?).args(&args).output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_str(String::from_utf8(out.stdout)?.trim())?)
    };
    let tokens = |v: &serde_json::Value| -> Vec<String> {
        v["tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect()
    };
    assert_eq!(tokens(&dump(&["Hi there"])?), ["<s>", "Hi", "there"]);
    expect_error(
        &["--model", model, "--chat", "Hi there"],
        &["--chat needs a chat template", "tokenizer_config.json"],
    )?;
    expect_error(&["--chat", "Hi there"], &["--chat takes a decoder"])?;

    common::add_chat_template(&dir)?;
    let v = dump(&["--chat", "--system", "Be brief", "Hi there"])?;
    let want = [
        "<|im_start|>",
        "system",
        "Be",
        "brief",
        "<|im_end|>",
        "<|im_start|>",
        "user",
        "Hi",
        "there",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
    ];
    assert_eq!(tokens(&v), want);
    assert_eq!(
        v["text"],
        "<|im_start|>system Be brief<|im_end|><|im_start|>user Hi there<|im_end|><|im_start|>assistant "
    );
    let n = want.len();
    assert_eq!(v["shape"], serde_json::json!([2, 4, n, n]));
    for layer in v["attentions"].as_array().into_iter().flatten() {
        for head in layer.as_array().into_iter().flatten() {
            for (q, row) in head.as_array().into_iter().flatten().enumerate() {
                let row: Vec<f64> = row
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|x| x.as_f64())
                    .collect();
                assert_eq!(row.len(), n);
                assert!(
                    (row.iter().sum::<f64>() - 1.0).abs() < 1e-4,
                    "row {q} sums to 1"
                );
                assert!(row[q + 1..].iter().all(|&x| x == 0.0), "row {q} is causal");
            }
        }
    }
    Ok(())
}
