//! Who attends to whom: every layer and head of a pretrained encoder, or of a LLaMA-family
//! decoder (`--model DIR` with `model_type` llama, mistral or qwen2: causal weights), on your
//! sentences.
//!
//! ```text
//! cargo run --release --example attention_dump -- "The animal didn't cross the street because it was too tired."
//! cargo run --release --example attention_dump -- --format json "one" "two"   # JSON Lines
//! cargo run --release --example attention_dump -- --html view.html "a sentence"
//! cargo run --release --example attention_dump -- --explain rollout "a sentence"
//! cargo run --release --example attention_dump -- --explain grad --against "another" "a sentence"
//! ```
//!
//! `--chat` puts each sentence in a decoder's chat template as the user's message (after
//! `--system TEXT`'s), as `generate --chat` does: the attention over the prompt the model
//! was trained to read.
//!
//! `--explain` adds an explanation beside the raw weights: `rollout` (attention rollout),
//! `grad` (gradient-weighted relevance of the cosine similarity with `--against TEXT` for an
//! encoder, of the next token's logit, or `--target-token ID`'s, for a decoder) or `norm`
//! (`‖α f(x)‖` per layer and head). The terminal shows its matrix and the input tokens
//! ranked for the row that matters (`[CLS]`, or a decoder's last position); JSON gains
//! `"explain"`.

mod common;

use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_attention::viz::{
    ranking, render_heatmap, render_html_grouped, render_svg, render_top_keys, AttentionDump,
    DumpSelection, ExplainMethod, Explanation, HeatmapStyle, HEATMAP_MAX_TOKENS,
};
use candle_attention::{
    into_length_sorted_batches, parse_dtype, select_device, Architecture, ChatTemplate, Checkpoint,
    EncodedText, GgufFile, LlamaConfig, LlamaModel, Model, ModelFiles, ModelResolver, TextEncoder,
};
use candle_core::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};
use common::Sentences;

/// Keys listed per query for inputs too long for a heatmap.
const TOP_KEYS: usize = 5;

/// Batches per window of sentences sorted by length together (each window's dumps are
/// held until it is written in input order).
const WINDOW_BATCHES: usize = 4;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Tokens and a colored heatmap of one head, for a person.
    Text,
    /// One compact JSON object per sentence (JSON Lines):
    /// {"model", "text", "tokens", "token_text", "shape": [layers, heads, seq, seq],
    /// "attentions"}.
    Json,
}

#[derive(Parser, Debug)]
#[command(
    about = "Show which token attends to which, in every layer and head of a pretrained encoder or decoder",
    after_help = "attentions[l][h][i][j] is the weight query token i gives key token j in layer l, head h.\n\
                  With --words, word pieces are merged into words: a word's weight as a key is the SUM over its \
                  pieces, as a query the MEAN over its pieces (rows still sum to 1)."
)]
struct Args {
    /// Sentences to analyse (batched by length; each result equals running it alone).
    sentences: Vec<String>,
    /// Read sentences from a UTF-8 file, one per line (blank lines are skipped).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Model: a local directory (config.json, tokenizer.json, model.safetensors), a
    /// LLaMA-family `.gguf` file, or a Hugging Face model id (hub cache first, download only
    /// when online). Default: the shipped all-MiniLM-L6-v2 in weights/.
    #[arg(long)]
    model: Option<String>,
    /// Output format on stdout.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Write the JSON Lines to this file instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write a self-contained interactive HTML page (head view + model view).
    #[arg(long)]
    html: Option<PathBuf>,
    /// Only this layer (0-based) in the JSON; the layer shown in the heatmap.
    #[arg(long)]
    layer: Option<usize>,
    /// Only this head (0-based) in the JSON; the head shown in the heatmap.
    #[arg(long)]
    head: Option<usize>,
    /// Merge word pieces into words (key weights summed, query weights averaged).
    #[arg(long)]
    words: bool,
    /// cpu, cuda[:N], metal[:N] or auto.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights and compute dtype: f32, f16 or bf16 (the softmax is always f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Cut sentences longer than the model's positions instead of failing.
    #[arg(long)]
    truncate: bool,
    /// Sentences per forward pass (sorted by length into batches).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Plain characters instead of colors (also when NO_COLOR is set or stdout is not a terminal).
    #[arg(long)]
    no_color: bool,
    /// Write the heatmap that is shown (the head, or the explanation with --explain) as a
    /// standalone SVG picture; several sentences: FILE, FILE-2, ... (stem-N.svg).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Explain each sentence beside the raw weights: rollout, grad or norm.
    #[arg(long, value_parser = ["rollout", "grad", "norm"])]
    explain: Option<String>,
    /// With --explain grad on an encoder: the text whose embedding the sentence's cosine
    /// similarity is taken with (the gradient runs through the sentence's forward only).
    #[arg(long)]
    against: Option<String>,
    /// With --explain grad on a decoder: the token whose logit after the last position is
    /// explained (default: the greedy next token).
    #[arg(long)]
    target_token: Option<u32>,
    /// Each sentence as the user's message in a decoder's chat template (after --system's),
    /// the assistant's turn opened, tokenized with no special tokens added.
    #[arg(long)]
    chat: bool,
    /// With --chat: the system message before each sentence.
    #[arg(long, requires = "chat")]
    system: Option<String>,
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
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let (device, device_name) = select_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let gguf = args
        .model
        .as_deref()
        .filter(|m| m.to_ascii_lowercase().ends_with(".gguf"));
    // With --chat: the system message (if any) each sentence follows.
    let chat = args.chat.then(|| args.system.clone());
    let net = match gguf {
        Some(path) => Network::load_gguf(path.as_ref(), dtype, &device, args.truncate, chat)?,
        None => {
            let files = ModelResolver::new().resolve(args.model.as_deref())?;
            Network::load(files, dtype, &device, args.truncate, chat)?
        }
    };
    let (name, layers, heads) = net.shape();
    let explain = args
        .explain
        .as_deref()
        .map(ExplainMethod::parse)
        .transpose()?;
    let is_decoder = matches!(net, Network::Decoder { .. });
    if args.against.is_some() && (explain != Some(ExplainMethod::Grad) || is_decoder) {
        bail!("--against takes the text an encoder's --explain grad compares with");
    }
    if args.target_token.is_some() && (explain != Some(ExplainMethod::Grad) || !is_decoder) {
        bail!("--target-token takes the token whose logit a decoder's --explain grad explains");
    }
    if explain == Some(ExplainMethod::Grad) && !is_decoder && args.against.is_none() {
        bail!(
            "--explain grad on an encoder explains the cosine similarity with another text: \
             give it with --against \"TEXT\""
        );
    }
    if let Some(l) = args.layer.filter(|&l| l >= layers) {
        bail!("--layer {l} is out of range: the model has layers 0..{layers}");
    }
    if let Some(h) = args.head.filter(|&h| h >= heads) {
        bail!("--head {h} is out of range: the model has heads 0..{heads}");
    }
    let loaded = t0.elapsed();

    // JSON restricts to --layer/--head; the heatmap needs every head to pick the sharpest.
    let json_select = DumpSelection {
        layer: args.layer,
        head: args.head,
    };
    let view_select = DumpSelection {
        layer: args.layer,
        head: None,
    };
    let mut json_out: Option<Box<dyn Write>> = match (&args.out, args.format) {
        (Some(path), _) => Some(Box::new(BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        ))),
        (None, Format::Json) => Some(Box::new(BufWriter::new(std::io::stdout().lock()))),
        (None, Format::Text) => None,
    };
    let text = (args.format == Format::Text).then(|| {
        let color = !args.no_color
            && std::env::var_os("NO_COLOR").is_none()
            && std::io::stdout().is_terminal();
        if color {
            HeatmapStyle::Color
        } else {
            HeatmapStyle::Plain
        }
    });
    // The HTML page holds every sentence; JSON and text are written window by window.
    let mut html_dumps = Vec::new();
    let mut stdout = std::io::stdout().lock();
    let t1 = Instant::now();
    let mut shown = 0;
    let mut pictures = 0;
    loop {
        let window = sentences.next_window(args.batch_size * WINDOW_BATCHES)?;
        if window.is_empty() {
            break;
        }
        let texts: Vec<&str> = window.iter().map(String::as_str).collect();
        let numbered = shown > 0 || window.len() > 1;
        for (item, (json, view)) in net.dumps(
            &texts,
            args.batch_size,
            &device,
            |item, index, attentions| {
                let mut json =
                    AttentionDump::from_batch(&name, item, index, attentions, json_select)?;
                let mut view = match text.is_some() || args.svg.is_some() {
                    true => Some(AttentionDump::from_batch(
                        &name,
                        item,
                        index,
                        attentions,
                        view_select,
                    )?),
                    false => None,
                };
                if let Some(method) = explain {
                    let e = net.explain(
                        item,
                        method,
                        args.against.as_deref(),
                        args.target_token,
                        &device,
                    )?;
                    if let Some(v) = view.as_mut() {
                        v.explain = Some(e.clone());
                    }
                    json.explain = Some(e);
                }
                if args.words {
                    json = json.into_words(item);
                    view = view.map(|v| v.into_words(item));
                }
                Ok((json, view))
            },
        )? {
            if let Some(w) = json_out.as_mut() {
                serde_json::to_writer(&mut *w, &json)?;
                w.write_all(b"\n")?;
            }
            let picture = view.as_ref().map(|v| (Shown::of(&args, v, &item), v));
            if let (Some(path), Some((what, v))) = (&args.svg, &picture) {
                let path = svg_path(path, pictures + 1);
                std::fs::write(&path, what.picture(v))
                    .with_context(|| format!("cannot write {}", path.display()))?;
                pictures += 1;
            }
            if let (Some(style), Some((what, view))) = (text, picture) {
                if shown == 0 {
                    // After the first window is read and run: an error there leaves stdout empty.
                    writeln!(
                        stdout,
                        "model: {name} ({layers} layers x {heads} heads, {device_name}, {})",
                        args.dtype
                    )?;
                }
                shown += 1;
                print_view(
                    &mut stdout,
                    &args,
                    view,
                    &what,
                    numbered.then_some(shown),
                    style,
                    is_decoder,
                )?;
            }
            if args.html.is_some() {
                html_dumps.push(json);
            }
        }
        sentences.advance_progress();
    }
    sentences.finish();
    let ran = t1.elapsed();
    if let Some(mut w) = json_out {
        w.flush()?;
    }
    if let Some(path) = &args.html {
        let title = format!("Attention, {name}");
        // The page gets every layer and head unless --layer/--head restrict it.
        let page = render_html_grouped(&html_dumps, &title, args.words, net.kv_group())?;
        std::fs::write(path, page).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if text.is_some() {
        writeln!(
            stdout,
            "\nrows = query tokens (who attends), columns = key tokens (attended to); cells = weight x 100"
        )?;
        writeln!(
            stdout,
            "more: --layer L --head H picks a head, --format json dumps every layer and head, --html FILE writes an interactive page, --words merges word pieces"
        )?;
        eprintln!(
            "loaded in {:.0} ms, {} sentence(s) through {layers} layers in {:.0} ms",
            loaded.as_secs_f64() * 1e3,
            sentences.produced(),
            ran.as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// What a person is shown of one sentence: a head's weights, and the explanation when asked.
struct Shown {
    /// `layer L, head H (why)`.
    head_title: String,
    head: Vec<Vec<f32>>,
    /// The explanation's title and matrix as shown (grad: without the identity).
    explanation: Option<(String, Vec<Vec<f32>>)>,
}

impl Shown {
    fn of(args: &Args, view: &AttentionDump, item: &EncodedText) -> Self {
        let special: Vec<bool> = if args.words {
            view.tokens
                .iter()
                .map(|t| t.starts_with('[') && t.ends_with(']'))
                .collect()
        } else {
            item.special.clone()
        };
        let (lp, hp) = view.sharpest_among(&special, args.head);
        let why = match (args.layer, args.head) {
            (Some(_), Some(_)) => "chosen with --layer and --head",
            (None, Some(_)) => "chosen with --head; the layer where it is sharpest",
            (Some(_), None) => {
                "the sharpest head of this layer that relates words to other words, not to themselves, their neighbours or [CLS]/[SEP]"
            }
            (None, None) => {
                "the sharpest head that relates words to other words, not to themselves, their neighbours or [CLS]/[SEP]"
            }
        };
        let explanation = view.explain.as_ref().map(|e| {
            let mut matrix = e.view(args.layer, args.head);
            if e.method() == ExplainMethod::Grad {
                // The identity (each token's own share) dwarfs the rest: shown without it.
                for (i, row) in matrix.iter_mut().enumerate() {
                    if let Some(d) = row.get_mut(i) {
                        *d -= 1.0;
                    }
                }
            }
            (e.title(args.layer, args.head), matrix)
        });
        Self {
            head_title: format!(
                "layer {}, head {} ({why})",
                view.layer_ids[lp], view.head_ids[hp]
            ),
            head: view.attentions[lp][hp].clone(),
            explanation,
        }
    }

    /// The picture `--svg` writes: the explanation when there is one, else the head.
    fn picture(&self, view: &AttentionDump) -> String {
        match &self.explanation {
            Some((title, m)) => render_svg(&trimmed(&view.display_tokens()), m, title),
            None => render_svg(
                &trimmed(&view.display_tokens()),
                &self.head,
                &self.head_title,
            ),
        }
    }
}

/// One sentence's tokens and heatmap; `number` heads it when there are several.
fn print_view(
    out: &mut impl Write,
    args: &Args,
    view: &AttentionDump,
    shown: &Shown,
    number: Option<usize>,
    style: HeatmapStyle,
    decoder: bool,
) -> anyhow::Result<()> {
    writeln!(out)?;
    if let Some(n) = number {
        writeln!(out, "sentence {n}: {}", view.text)?;
    }
    // Each token's decoded text (` capital`, not `Ġcapital`), quoted so a leading space shows.
    let labels = view.display_tokens();
    let tokens: Vec<String> = labels
        .iter()
        .enumerate()
        .map(|(i, t)| format!("{i}:{t:?}"))
        .collect();
    writeln!(
        out,
        "{} {}: {}",
        view.tokens.len(),
        if args.words { "words" } else { "tokens" },
        tokens.join(" ")
    )?;
    writeln!(out, "{}", shown.head_title)?;
    write!(out, "{}", draw(&trimmed(&labels), &shown.head, style))?;
    if let Some((title, matrix)) = &shown.explanation {
        let grad = view
            .explain
            .as_ref()
            .is_some_and(|e| e.method() == ExplainMethod::Grad);
        print_explanation(out, view, title, matrix, grad, decoder, style)?;
    }
    Ok(())
}

/// A heatmap, or for inputs too long for one each query's top keys.
fn draw(tokens: &[String], matrix: &[Vec<f32>], style: HeatmapStyle) -> String {
    if tokens.len() > HEATMAP_MAX_TOKENS {
        format!(
            "{} tokens: each query's top keys (values x 100) instead of a heatmap\n{}",
            tokens.len(),
            render_top_keys(tokens, matrix, TOP_KEYS)
        )
    } else {
        render_heatmap(tokens, matrix, style)
    }
}

/// The explanation's matrix (scaled by its largest entry) and the input tokens ranked for
/// the row that matters: `[CLS]` for an encoder, the last position for a decoder.
fn print_explanation(
    out: &mut impl Write,
    view: &AttentionDump,
    title: &str,
    matrix: &[Vec<f32>],
    grad: bool,
    decoder: bool,
    style: HeatmapStyle,
) -> anyhow::Result<()> {
    let max = matrix.iter().flatten().fold(0f32, |m, &v| m.max(v.abs()));
    let scaled: Vec<Vec<f32>> = matrix
        .iter()
        .map(|r| r.iter().map(|v| v / max.max(f32::MIN_POSITIVE)).collect())
        .collect();
    writeln!(out, "\nexplanation: {title}")?;
    let what = if grad {
        "(relevance - identity)"
    } else {
        "value"
    };
    writeln!(out, "cells = {what} / {max:.4e} x 100")?;
    let labels = view.display_tokens();
    write!(out, "{}", draw(&trimmed(&labels), &scaled, style))?;
    let row = if decoder {
        matrix.len().saturating_sub(1)
    } else {
        0
    };
    let who = labels.get(row).cloned().unwrap_or_default();
    let ranked: Vec<String> = ranking(&labels, matrix, row)
        .into_iter()
        .take(10)
        .map(|(t, v)| format!("{t:?} {v:.3e}"))
        .collect();
    writeln!(out, "ranked for {who:?} (row {row}): {}", ranked.join(", "))?;
    Ok(())
}

/// Labels without their leading spaces, for the heatmap's columns and rows.
fn trimmed(labels: &[String]) -> Vec<String> {
    labels.iter().map(|l| l.trim_start().to_string()).collect()
}

/// `--svg`'s path for sentence `number` (1-based) of several: `out.svg`, `out-2.svg`, ...
fn svg_path(path: &Path, number: usize) -> PathBuf {
    if number <= 1 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let ext = path
        .extension()
        .map_or_else(String::new, |e| format!(".{}", e.to_string_lossy()));
    path.with_file_name(format!("{stem}-{number}{ext}"))
}

/// The model behind the dump: a BERT-family encoder (sentences batched with padding) or a
/// LLaMA-family decoder (each sentence alone, causal weights).
// One value per run: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Network {
    Encoder(Model),
    Decoder {
        name: String,
        model: LlamaModel,
        text: TextEncoder,
        /// With `--chat`: the template, and the system message.
        chat: Option<(ChatTemplate, Option<String>)>,
    },
}

/// The chat template `--chat` asked for (`chat`: the system message, if any), or why there
/// is none (`place`: where it was looked for).
fn chat_template(
    found: Option<ChatTemplate>,
    chat: Option<Option<String>>,
    place: impl FnOnce() -> String,
) -> anyhow::Result<Option<(ChatTemplate, Option<String>)>> {
    let Some(system) = chat else {
        return Ok(None);
    };
    let template = found.with_context(|| format!("--chat needs a chat template: {}", place()))?;
    Ok(Some((template, system)))
}

impl Network {
    fn load(
        files: ModelFiles,
        dtype: DType,
        device: &Device,
        truncate: bool,
        chat: Option<Option<String>>,
    ) -> anyhow::Result<Self> {
        if Architecture::of_config_file(&files.config)?.is_encoder() {
            if chat.is_some() {
                bail!("--chat takes a decoder (a LLaMA-family model) with a chat template");
            }
            let mut model = Model::load(files, dtype, device, truncate)?;
            model.text.set_token_text(true);
            return Ok(Self::Encoder(model));
        }
        let cfg = LlamaConfig::from_file(&files.config)?;
        let ckpt = Checkpoint::open_many(&files.weights)?;
        let model = LlamaModel::from_checkpoint(&ckpt, &cfg, dtype, device)?;
        let mut text = TextEncoder::from_file(&files.tokenizer)?.with_token_text(true);
        if let Some(p) = cfg.max_position_embeddings {
            text = text.with_max_positions(p)?.with_truncation(truncate)?;
        }
        let dir = files.tokenizer.parent().unwrap_or(Path::new("."));
        let found = match chat {
            Some(_) => ChatTemplate::from_dir(dir)?,
            None => None,
        };
        let chat = chat_template(found, chat, || {
            format!(
                "{} has no chat_template.jinja and no `chat_template` in tokenizer_config.json",
                dir.display()
            )
        })?;
        Ok(Self::Decoder {
            name: files.name.clone(),
            model,
            text,
            chat,
        })
    }

    /// A LLaMA-family decoder from one GGUF file (configuration, weights and tokenizer).
    fn load_gguf(
        path: &Path,
        dtype: DType,
        device: &Device,
        truncate: bool,
        chat: Option<Option<String>>,
    ) -> anyhow::Result<Self> {
        let file = GgufFile::open_for(path, device)?;
        let model = LlamaModel::from_gguf_file(&file, dtype, device)?;
        let mut text = TextEncoder::from_gguf(&file)?.with_token_text(true);
        if let Some(p) = model.config().max_position_embeddings {
            text = text.with_max_positions(p)?.with_truncation(truncate)?;
        }
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let found = match chat {
            Some(_) => ChatTemplate::from_gguf(&file)?,
            None => None,
        };
        let chat = chat_template(found, chat, || {
            format!("{} has no `tokenizer.chat_template`", path.display())
        })?;
        Ok(Self::Decoder {
            name,
            model,
            text,
            chat,
        })
    }

    /// One sentence's explanation (see [`Explanation`]).
    fn explain(
        &self,
        item: &EncodedText,
        method: ExplainMethod,
        against: Option<&str>,
        target_token: Option<u32>,
        device: &Device,
    ) -> anyhow::Result<Explanation> {
        Ok(match self {
            Self::Encoder(m) => {
                Explanation::encoder(&m.encoder, &m.text, item, method, against, device)?
            }
            Self::Decoder { model, .. } => {
                Explanation::decoder(model, &item.ids, method, target_token, device)?
            }
        })
    }

    /// Query heads per key/value head (1 for an encoder).
    fn kv_group(&self) -> usize {
        match self {
            Self::Encoder(_) => 1,
            Self::Decoder { model, .. } => {
                let c = model.config();
                c.num_attention_heads
                    / c.num_key_value_heads
                        .unwrap_or(c.num_attention_heads)
                        .max(1)
            }
        }
    }

    /// (name, layers, heads)
    fn shape(&self) -> (String, usize, usize) {
        match self {
            Self::Encoder(m) => (
                m.files.name.clone(),
                m.config.num_hidden_layers,
                m.config.num_attention_heads,
            ),
            Self::Decoder { name, model, .. } => (
                name.clone(),
                model.num_layers(),
                model.config().num_attention_heads,
            ),
        }
    }

    /// `make(item, index, attentions)` for every sentence, with its tokens, its row in
    /// the per-layer attentions `(batch, heads, seq, seq)`; results in input order.
    /// Encoder sentences are sorted by length into batches of `batch_size`.
    fn dumps<R>(
        &self,
        texts: &[&str],
        batch_size: usize,
        device: &Device,
        mut make: impl FnMut(&EncodedText, usize, &[Tensor]) -> anyhow::Result<R>,
    ) -> anyhow::Result<Vec<(EncodedText, R)>> {
        match self {
            Self::Encoder(m) => {
                let items = texts
                    .iter()
                    .map(|t| m.text.encode(t))
                    .collect::<candle_attention::Result<Vec<_>>>()?;
                let mut done: Vec<Option<(EncodedText, R)>> = texts.iter().map(|_| None).collect();
                for (plan, members) in
                    into_length_sorted_batches(items, EncodedText::len, batch_size)?
                {
                    let batch = m.text.pad(members, device)?;
                    let out = m.encoder.forward(
                        &batch.input_ids,
                        Some(&batch.token_type_ids),
                        Some(&batch.attention_mask),
                        true,
                    )?;
                    let attentions = out
                        .attentions
                        .context("the encoder returned no attentions")?;
                    for (row, (item, &i)) in batch.items.into_iter().zip(&plan).enumerate() {
                        let r = make(&item, row, &attentions)?;
                        done[i] = Some((item, r));
                    }
                }
                done.into_iter()
                    .map(|d| d.context("a sentence was left out of every batch"))
                    .collect()
            }
            Self::Decoder {
                model, text, chat, ..
            } => texts
                .iter()
                .map(|t| {
                    let mut item = match chat {
                        Some((template, system)) => {
                            text.encode_as_is(&template.render_turn(system.as_deref(), t)?)?
                        }
                        None => text.encode(t)?,
                    };
                    // (1, seq)
                    let ids = Tensor::new(item.ids.as_slice(), device)?.unsqueeze(0)?;
                    // Decoders park spare weight on the first token (an attention sink):
                    // like [CLS] in an encoder, it does not count when picking a head.
                    if let Some(first) = item.special.first_mut() {
                        *first = true;
                    }
                    let attentions = model.attentions(&ids)?;
                    let r = make(&item, 0, &attentions)?;
                    Ok((item, r))
                })
                .collect(),
        }
    }
}
