//! Generates text with a LLaMA-family decoder (LLaMA, Mistral, Qwen2, SmolLM2) running on
//! this crate's attention, with rotary embeddings and a KV cache.
//!
//! ```text
//! cargo run --release --example generate -- --model DIR|FILE.gguf (--prompt TEXT | --prompt-ids 5,17,42) \
//!   [--max-new-tokens N] [--ignore-eos] [--format text|json] [--logits OUT.safetensors] \
//!   [--chat [--system TEXT]] [--temperature T --top-p P --seed S] [--device ...] [--dtype ...] \
//!   [--int8-activations]
//! ```
//!
//! DIR holds `config.json`, `model.safetensors` and (for `--prompt` and text output)
//! `tokenizer.json`; `scripts/fetch_smollm2.sh DIR` writes SmolLM2-135M-Instruct there. A
//! `.gguf` file (llama, mistral, qwen2) is a model on its own: configuration, weights and
//! tokenizer (byte-level BPE vocabularies) from the file, no Python needed.
//! Greedy unless `--temperature` is above 0; stops at an end-of-generation id unless
//! `--ignore-eos`: for DIR `generation_config.json`'s `eos_token_id`, else `config.json`'s;
//! for a `.gguf` file its eos / eot / eom ids and its end-of-turn tokens (`<|im_end|>`,
//! `<|eot_id|>`, `<end_of_turn>`, ...; [`candle_attention::END_OF_TURN_TEXTS`]), as
//! llama.cpp. `--format text` streams the text and ends with one line of timings;
//! `--format json` prints `{"prompt_ids", "generated_ids", "text", "prefill_ms",
//! "decode_tokens_per_s"}`. `--logits FILE` writes F32 `logits` `(prompt_len + N - 1,
//! vocab)`: the prompt's rows, then the row each later token was chosen from.
//! `--chat` puts `--prompt` in the model's chat template as the user's message (after
//! `--system TEXT` as the system's, where given), the assistant's turn opened: the template
//! of the `.gguf` file (`tokenizer.chat_template`) or of DIR (`chat_template.jinja`, else
//! `tokenizer_config.json`'s), rendered and tokenized as transformers' `apply_chat_template`.
//! `--int8-activations` opts a `.gguf` model in to llama.cpp's 8-bit activations: its
//! decode steps on CPUs with AVX-512 VNNI or AVX2 (faster where unpacking bounds the
//! products), its prompts with AVX-512 VNNI (about twice the exact prefill's speed); the
//! ids may leave the exact f32 ones after a few tokens.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_attention::{
    parse_dtype, select_device, ChatTemplate, GgufFile, LlamaModel, TextEncoder,
};
use candle_core::{DType, Device, IndexOp, Tensor};
use clap::{Parser, ValueEnum};
use tokenizers::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(Parser, Debug)]
#[command(about = "Generate text with a LLaMA-family decoder on candle-attention")]
struct Args {
    /// Directory with config.json, model.safetensors and tokenizer.json, or a `.gguf` file.
    #[arg(long)]
    model: PathBuf,
    /// The prompt, tokenized as the model's tokenizer does (special tokens added).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// The prompt as token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Put --prompt in the model's chat template as the user's message, the assistant's turn
    /// to follow (tokenized with no special tokens added: the template writes them).
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: bool,
    /// With --chat: the system message before the user's.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Write the logits each token was chosen from (F32 `logits`) to this safetensors file.
    #[arg(long)]
    logits: Option<PathBuf>,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches this.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// cpu, cuda[:N], metal[:N] or auto.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights and activations: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// GGUF weights: 8-bit activations in the products, as llama.cpp (on the CPU, decode
    /// steps: AVX-512 VNNI or AVX2; prompts: AVX-512 VNNI; on CUDA: candle's quantized
    /// kernels; not exact: see `candle_attention::set_int8_activations`).
    #[arg(long)]
    int8_activations: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    candle_attention::set_int8_activations(args.int8_activations);
    // A long prompt's products allocate megabytes afresh: keep freed memory for reuse
    // (512-token prefill ~10% faster; see docs/performance-archive.md).
    candle_attention::retain_freed_memory();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Picks the next token from `(vocab,)` logits: greedy, or sampled with temperature and
/// top-p.
struct Sampler {
    temperature: f64,
    top_p: f64,
    state: u64,
}

impl Sampler {
    fn next(&mut self, logits: &Tensor) -> anyhow::Result<u32> {
        let v: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
        if self.temperature <= 0.0 {
            let (best, _) =
                v.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
                        if x > bv {
                            (i, x)
                        } else {
                            (bi, bv)
                        }
                    });
            return Ok(best as u32);
        }
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut p: Vec<(usize, f64)> = v
            .iter()
            .enumerate()
            .map(|(i, &x)| (i, ((x as f64 - m) / self.temperature).exp()))
            .collect();
        let total: f64 = p.iter().map(|x| x.1).sum();
        p.sort_by(|a, b| b.1.total_cmp(&a.1));
        let (mut kept, mut acc) = (0, 0.0);
        for (_, w) in &p {
            acc += w / total;
            kept += 1;
            if acc >= self.top_p {
                break;
            }
        }
        let p = &p[..kept];
        let mass: f64 = p.iter().map(|x| x.1).sum();
        // xorshift64*: a uniform draw in [0, mass).
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let u = (self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
        let mut r = u * mass;
        for (i, w) in p {
            r -= w;
            if r <= 0.0 {
                return Ok(*i as u32);
            }
        }
        Ok(p.last().map_or(0, |x| x.0 as u32))
    }
}

/// `user` (after `--system`'s message, where given) in the model's chat template, the
/// assistant's turn opened.
fn chat_prompt(args: &Args, gguf: Option<&GgufFile>, user: &str) -> anyhow::Result<String> {
    let (template, place) = match gguf {
        Some(file) => (
            ChatTemplate::from_gguf(file)?,
            "`tokenizer.chat_template` in the file",
        ),
        None => (
            ChatTemplate::from_dir(&args.model)?,
            "chat_template.jinja or a `chat_template` in tokenizer_config.json",
        ),
    };
    let template = template.with_context(|| {
        format!(
            "--chat needs a chat template, and {} has none (no {place})",
            args.model.display()
        )
    })?;
    Ok(template.render_turn(args.system.as_deref(), user)?)
}

fn run(args: Args) -> anyhow::Result<()> {
    // The calling thread is one of rayon's workers: no hand-over per call (latency).
    rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .build_global()
        .context("building rayon's global pool")?;
    if !(args.temperature >= 0.0 && args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--temperature must be >= 0 and --top-p in (0, 1]");
    }
    let (device, device_name) = select_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let gguf = args
        .model
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if args.int8_activations && !gguf {
        eprintln!(
            "note: --int8-activations applies to .gguf models' blocks; {} runs in {} as without it",
            args.model.display(),
            args.dtype
        );
    }
    // A GGUF file is opened (read) once, for its tokenizer and its model; the time it takes
    // counts in the load's.
    let t_open = Instant::now();
    let gguf_file = if gguf {
        Some(GgufFile::open_for(&args.model, &device)?)
    } else {
        None
    };
    let open = t_open.elapsed();
    // The tokenizer, or why there is none.
    let (tokenizer, no_tokenizer): (Option<Tokenizer>, String) = if let Some(file) = &gguf_file {
        match TextEncoder::from_gguf(file) {
            Ok(t) => (Some(t.tokenizer().clone()), String::new()),
            Err(e) => (None, format!("a tokenizer ({e})")),
        }
    } else {
        let tok_path = args.model.join("tokenizer.json");
        if tok_path.exists() {
            let tok = Tokenizer::from_file(&tok_path)
                .map_err(|e| anyhow::anyhow!("{}: {e}", tok_path.display()))?;
            (Some(tok), String::new())
        } else {
            (None, tok_path.display().to_string())
        }
    };
    let prompt_ids: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = tokenizer
                .as_ref()
                .with_context(|| format!("--prompt needs {no_tokenizer} (or pass --prompt-ids)"))?;
            let (text, special) = if args.chat {
                (chat_prompt(&args, gguf_file.as_ref(), text)?, false)
            } else {
                (text.clone(), true)
            };
            tok.encode(text.as_str(), special)
                .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
                .get_ids()
                .to_vec()
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    if args.format == Format::Text && tokenizer.is_none() {
        bail!("--format text needs {no_tokenizer} (use --format json)");
    }
    let t0 = Instant::now();
    let model = if let Some(file) = &gguf_file {
        LlamaModel::from_gguf_file(file, dtype, &device)?
    } else {
        LlamaModel::from_dir(&args.model, dtype, &device)?
    };
    let vocab = model.config().vocab_size;
    if let Some(&bad) = prompt_ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("prompt id {bad} is outside the vocabulary of {vocab}");
    }
    let load = t0.elapsed() + open;
    let eos = if args.ignore_eos {
        Vec::new()
    } else {
        model.config().end_of_generation_ids()
    };
    let mut caches = model.new_caches(prompt_ids.len() + args.max_new_tokens);
    let mut sampler = Sampler {
        temperature: args.temperature,
        top_p: args.top_p,
        state: args.seed.max(1),
    };
    let mut rows: Vec<Tensor> = Vec::new();
    let mut generated: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let mut stream = |generated: &[u32]| -> anyhow::Result<()> {
        if args.format != Format::Text {
            return Ok(());
        }
        if let Some(tok) = &tokenizer {
            let text = tok
                .decode(generated, true)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            // Wait for a whole character before printing a token's bytes.
            if !text.ends_with('\u{FFFD}') && text.len() > printed && text.is_char_boundary(printed)
            {
                print!("{}", &text[printed..]);
                std::io::stdout().flush()?;
                printed = text.len();
            }
        }
        Ok(())
    };

    // Prefill: the prompt's logits (all rows when they are to be written).
    let t1 = Instant::now();
    let ids = Tensor::new(prompt_ids.as_slice(), &device)?.unsqueeze(0)?; // (1, prompt)
    let mut next_logits = if args.logits.is_some() {
        let all = model.forward(&ids, &mut caches)?.squeeze(0)?; // (prompt, vocab)
        rows.push(all.to_device(&Device::Cpu)?);
        all.i(prompt_ids.len() - 1)?
    } else {
        model.forward_last(&ids, &mut caches)?.squeeze(0)? // (vocab,)
    };
    let mut token = sampler.next(&next_logits)?;
    let prefill = t1.elapsed();
    generated.push(token);
    stream(&generated)?;
    let t2 = Instant::now();
    while generated.len() < args.max_new_tokens && !eos.contains(&token) {
        let ids = Tensor::new(&[token], &device)?.unsqueeze(0)?; // (1, 1)
        next_logits = model.forward_last(&ids, &mut caches)?.squeeze(0)?;
        if args.logits.is_some() {
            rows.push(next_logits.unsqueeze(0)?.to_device(&Device::Cpu)?);
        }
        token = sampler.next(&next_logits)?;
        generated.push(token);
        stream(&generated)?;
    }
    let decode = t2.elapsed();
    let steps = generated.len().saturating_sub(1);
    let tokens_per_s = if steps > 0 {
        steps as f64 / decode.as_secs_f64()
    } else {
        0.0
    };
    if let Some(path) = &args.logits {
        let all = Tensor::cat(&rows, 0)?.to_dtype(DType::F32)?; // (prompt + N - 1, vocab)
        let map = HashMap::from([("logits".to_string(), all)]);
        candle_core::safetensors::save(&map, path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let text = match &tokenizer {
        Some(tok) => Some(
            tok.decode(&generated, true)
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        ),
        None => None,
    };
    match args.format {
        Format::Json => {
            let mut obj = serde_json::json!({
                "prompt_ids": prompt_ids,
                "generated_ids": generated,
                "prefill_ms": prefill.as_secs_f64() * 1e3,
                "decode_tokens_per_s": tokens_per_s,
            });
            if let Some(t) = text {
                obj["text"] = serde_json::Value::String(t);
            }
            println!("{obj}");
        }
        Format::Text => {
            println!();
            println!(
                "{device_name}, {}: {} prompt + {} new tokens; load {:.0} ms, prefill {:.1} ms, decode {:.1} tokens/s",
                args.dtype,
                prompt_ids.len(),
                generated.len(),
                load.as_secs_f64() * 1e3,
                prefill.as_secs_f64() * 1e3,
                tokens_per_s
            );
        }
    }
    Ok(())
}
