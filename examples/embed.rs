//! Sentence embeddings, the job all-MiniLM-L6-v2 was trained for: mean pooling over the
//! real tokens and L2 normalisation (sentence-transformers' pipeline), then the cosine
//! similarity of every pair of sentences.
//!
//! ```text
//! cargo run --release --example embed -- "A man is eating food." "A man is eating pasta." "The sky is blue."
//! cargo run --release --example embed -- --format json "one sentence"
//! cargo run --release --example embed -- --format json --file corpus.txt > embeddings.jsonl
//! ```
//!
//! Sentences are sorted by length into batches of `--batch-size` within windows of
//! [`WINDOW_BATCHES`] batches; JSON lines are written window by window in input order, so
//! memory does not grow with the corpus.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use candle_attention::{parse_dtype, select_device, Embedder, Model, ModelResolver};
use clap::{Parser, ValueEnum};
use common::Sentences;
use serde::Serialize;

/// Batches per window of sentences sorted together: enough for batches of like lengths.
const WINDOW_BATCHES: usize = 128;

/// Text mode prints the full similarity table up to this many sentences, and each
/// sentence's nearest neighbour beyond.
const TABLE_MAX: usize = 12;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// A similarity table for a person.
    Text,
    /// One `{"text": ..., "embedding": [...]}` object per line.
    Json,
}

#[derive(Parser, Debug)]
#[command(about = "Mean-pooled, L2-normalised sentence embeddings and their cosine similarities")]
struct Args {
    /// Sentences to embed.
    sentences: Vec<String>,
    /// Read sentences from a UTF-8 file, one per line (blank lines are skipped).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Model directory or Hugging Face model id (default: the shipped all-MiniLM-L6-v2).
    #[arg(long)]
    model: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// cpu, cuda[:N], metal[:N] or auto.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Cut sentences longer than the model's positions instead of failing.
    #[arg(long)]
    truncate: bool,
    /// Sentences per forward pass (sorted by length into batches).
    #[arg(long, default_value_t = Embedder::DEFAULT_BATCH_SIZE)]
    batch_size: usize,
    /// Print the run's times as one JSON object on stderr at the end (`sentences`,
    /// `load_s`, `embed_s`: tokenizing + encoding + pooling, no output, `total_s`,
    /// `sentences_per_s` over `embed_s`).
    #[arg(long)]
    stats: bool,
}

#[derive(Serialize)]
struct Embedding<'a> {
    text: &'a str,
    embedding: Vec<f32>,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut sentences = Sentences::open(args.sentences.clone(), args.file.as_deref())?;
    let (device, _) = select_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let files = ModelResolver::new().resolve(args.model.as_deref())?;
    let model = Model::load(files, dtype, &device, args.truncate)?;
    let embedder = model.embedder(&device).with_batch_size(args.batch_size)?;
    let loaded = t0.elapsed();

    let t1 = Instant::now();
    let mut stdout = std::io::BufWriter::new(std::io::stdout().lock());
    // Text mode compares every pair, so it keeps every row; JSON writes them as they come.
    let mut kept: Vec<(String, Vec<f32>)> = Vec::new();
    let mut embed_time = std::time::Duration::ZERO;
    loop {
        let window = sentences.next_window(args.batch_size * WINDOW_BATCHES)?;
        if window.is_empty() {
            break;
        }
        let texts: Vec<&str> = window.iter().map(String::as_str).collect();
        let te = Instant::now();
        let rows = embedder.embed(&texts)?;
        embed_time += te.elapsed();
        match args.format {
            Format::Json => {
                for (text, embedding) in texts.iter().zip(rows) {
                    serde_json::to_writer(&mut stdout, &Embedding { text, embedding })?;
                    stdout.write_all(b"\n")?;
                }
            }
            Format::Text => kept.extend(window.into_iter().zip(rows)),
        }
        sentences.advance_progress();
    }
    sentences.finish();
    let ran = t1.elapsed();
    if args.format == Format::Text {
        print_similarities(&mut stdout, &kept, &model.files.name)?;
    }
    stdout.flush()?;
    if args.stats {
        let (n, embed_s) = (sentences.produced(), embed_time.as_secs_f64());
        let stats = serde_json::json!({
            "sentences": n,
            "load_s": loaded.as_secs_f64(),
            "embed_s": embed_s,
            "total_s": t0.elapsed().as_secs_f64(),
            "sentences_per_s": if embed_s > 0.0 { n as f64 / embed_s } else { 0.0 },
        });
        eprintln!("{stats}");
    } else if args.format == Format::Text {
        eprintln!(
            "loaded in {:.0} ms, embedded {} sentences in {:.0} ms",
            loaded.as_secs_f64() * 1e3,
            sentences.produced(),
            ran.as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// The sentences, then their cosine similarity table (or each one's nearest neighbour
/// when there are more than [`TABLE_MAX`]).
fn print_similarities(
    out: &mut impl Write,
    rows: &[(String, Vec<f32>)],
    model: &str,
) -> anyhow::Result<()> {
    let dim = rows.first().map_or(0, |r| r.1.len());
    writeln!(
        out,
        "{} sentences, {dim}-dimensional embeddings ({model})",
        rows.len()
    )?;
    for (i, (t, _)) in rows.iter().enumerate() {
        writeln!(out, "[{i}] {t}")?;
    }
    let cos = |a: &[f32], b: &[f32]| -> f32 { a.iter().zip(b).map(|(x, y)| x * y).sum() };
    if rows.len() > TABLE_MAX {
        writeln!(out, "\nnearest neighbour (cosine similarity):")?;
        for (i, (_, a)) in rows.iter().enumerate() {
            let best = rows
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(j, (_, b))| (j, cos(a, b)))
                .max_by(|x, y| x.1.total_cmp(&y.1));
            if let Some((j, c)) = best {
                writeln!(
                    out,
                    "{:>5} -> {:>5} {c:>7.3}",
                    format!("[{i}]"),
                    format!("[{j}]")
                )?;
            }
        }
    } else if rows.len() > 1 {
        writeln!(out, "\ncosine similarity:")?;
        write!(out, "     ")?;
        for j in 0..rows.len() {
            write!(out, "{:>7}", format!("[{j}]"))?;
        }
        writeln!(out)?;
        for (i, (_, a)) in rows.iter().enumerate() {
            write!(out, "{:>5}", format!("[{i}]"))?;
            for (_, b) in rows {
                write!(out, "{:>7.3}", cos(a, b))?;
            }
            writeln!(out)?;
        }
    }
    Ok(())
}
