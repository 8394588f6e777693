//! Sentence embeddings, the job all-MiniLM-L6-v2 was trained for: mean pooling over the
//! real tokens and L2 normalisation (sentence-transformers' pipeline), then the cosine
//! similarity of every pair of sentences.
//!
//! ```text
//! cargo run --release --example embed -- "A man is eating food." "A man is eating pasta." "The sky is blue."
//! cargo run --release --example embed -- --format json "one sentence"
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_attention::{l2_normalize, mean_pool, parse_dtype, select_device, Model, ModelResolver};
use clap::{Parser, ValueEnum};
use serde::Serialize;

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
    let mut sentences = args.sentences.clone();
    if let Some(path) = &args.file {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            anyhow::anyhow!(
                "{} is not valid UTF-8 (first bad byte at offset {})",
                path.display(),
                e.utf8_error().valid_up_to()
            )
        })?;
        sentences.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string),
        );
    }
    if sentences.is_empty() {
        bail!("no sentence given: pass one or more sentences, or --file FILE");
    }
    let (device, _) = select_device(&args.device)?;
    let files = ModelResolver::new().resolve(args.model.as_deref())?;
    let model = Model::load(files, parse_dtype(&args.dtype)?, &device, args.truncate)?;
    let loaded = t0.elapsed();
    let t1 = Instant::now();
    let texts: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let batch = model.text.encode_batch(&texts, &device)?;
    let out = model.encoder.forward(
        &batch.input_ids,
        Some(&batch.token_type_ids),
        Some(&batch.attention_mask),
        false,
    )?;
    let emb = l2_normalize(&mean_pool(&out.hidden_states, &batch.attention_mask)?)?; // (b, hidden)
    let rows: Vec<Vec<f32>> = emb.to_vec2()?;
    let ran = t1.elapsed();

    let mut stdout = std::io::stdout().lock();
    match args.format {
        Format::Json => {
            for (text, embedding) in texts.iter().zip(rows) {
                serde_json::to_writer(&mut stdout, &Embedding { text, embedding })?;
                stdout.write_all(b"\n")?;
            }
        }
        Format::Text => {
            writeln!(
                stdout,
                "{} sentences, {}-dimensional embeddings ({})",
                rows.len(),
                rows[0].len(),
                model.files.name
            )?;
            for (i, t) in texts.iter().enumerate() {
                writeln!(stdout, "[{i}] {t}")?;
            }
            if rows.len() > 1 {
                writeln!(stdout, "\ncosine similarity:")?;
                write!(stdout, "     ")?;
                for j in 0..rows.len() {
                    write!(stdout, "{:>7}", format!("[{j}]"))?;
                }
                writeln!(stdout)?;
                for (i, a) in rows.iter().enumerate() {
                    write!(stdout, "{:>5}", format!("[{i}]"))?;
                    for b in &rows {
                        let cos: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
                        write!(stdout, "{cos:>7.3}")?;
                    }
                    writeln!(stdout)?;
                }
            }
            eprintln!(
                "loaded in {:.0} ms, embedded in {:.0} ms",
                loaded.as_secs_f64() * 1e3,
                ran.as_secs_f64() * 1e3
            );
        }
    }
    Ok(())
}
