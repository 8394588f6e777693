//! The crate's error type.
//!
//! Every failure a user can cause (a bad checkpoint, a wrong shape, an invalid mask, a
//! backend that was not compiled in) is a variant of [`Error`] whose message names the
//! problem: the file, the tensor, the expected and the found value.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in `candle-attention`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error raised inside Candle that has no more specific variant here.
    #[error(transparent)]
    Candle(candle_core::Error),

    /// A file could not be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said (part of the message, so not repeated as a source).
        cause: std::io::Error,
    },

    /// A file exists but is not a valid safetensors checkpoint (empty, truncated, bad header, ...).
    #[error("{path} is not a valid safetensors file: {reason}")]
    InvalidCheckpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor a layout needs is not in the checkpoint.
    #[error("missing tensor `{name}` in the checkpoint; {}", available_hint(.name, .prefix, .available, *.total, *.listed))]
    MissingTensor {
        /// Full dotted name that was requested.
        name: String,
        /// Longest dotted prefix of `name` that some tensor in the checkpoint starts with
        /// (empty when nothing matches).
        prefix: String,
        /// Tensors that exist under `prefix` (at most 32 listed).
        available: Vec<String>,
        /// Number of tensors under `prefix` (or in the whole checkpoint when `prefix` is empty).
        total: usize,
        /// Whether the weights source could list its tensors at all.
        listed: bool,
    },

    /// A prefix under which the checkpoint holds no tensor at all.
    #[error("no tensor in the checkpoint starts with `{prefix}.`; its names start with: {}", .roots.join(", "))]
    PrefixNotFound {
        /// The prefix asked for (without the trailing dot).
        prefix: String,
        /// Distinct first components of the names in the checkpoint (at most 32).
        roots: Vec<String>,
    },

    /// A tensor exists but has the wrong shape.
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected}")]
    ShapeMismatch {
        /// Full dotted name of the tensor.
        tensor: String,
        /// The shape it should have, in words or as dims.
        expected: String,
        /// The dims it has.
        found: Vec<usize>,
    },

    /// A tensor exists but has a dtype that cannot be used (e.g. integers for a weight).
    #[error("tensor `{tensor}` has dtype {found}, expected {expected}")]
    WrongDtype {
        /// Full dotted name of the tensor.
        tensor: String,
        /// The dtypes it could have.
        expected: String,
        /// The dtype it has.
        found: String,
    },

    /// Head counts that do not fit the model dimensions.
    #[error("invalid head configuration: {0}")]
    Heads(String),

    /// A file that is not a GGUF file this crate can read: bad magic or version, counts,
    /// offsets or sizes that do not fit the file, unknown value types.
    #[error("{path} is not a valid GGUF file: {reason}")]
    InvalidGguf {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        reason: String,
    },

    /// A valid GGUF file holding something this crate does not support (an architecture, a
    /// tensor type).
    #[error("{path}: {what} is not supported{}", if .supported.is_empty() { String::new() } else { format!(" (supported: {})", .supported) })]
    UnsupportedGguf {
        /// The file.
        path: PathBuf,
        /// What is unsupported, named as in the file.
        what: String,
        /// What would be.
        supported: String,
    },

    /// A configuration (config.json or builder values) that makes no sense.
    #[error("invalid configuration{}: {message}", .path.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Config {
        /// The config file, when the values came from one.
        path: Option<PathBuf>,
        /// What is wrong.
        message: String,
    },

    /// A mask that does not fit the attention it is applied to, or holds invalid values.
    #[error("invalid attention mask: {0}")]
    Mask(String),

    /// An input tensor with the wrong rank, size or dtype.
    #[error("invalid input `{name}`: expected {expected}, found {found}")]
    Input {
        /// The argument (`x`, `input_ids`, ...).
        name: String,
        /// What it should be.
        expected: String,
        /// What it is.
        found: String,
    },

    /// A sequence longer than the model's position table.
    #[error("sequence of {len} tokens is longer than the model's {max} positions (ask for truncation to cut it)")]
    SequenceTooLong {
        /// Tokens in the sequence.
        len: usize,
        /// Positions the model has.
        max: usize,
    },

    /// Text that cannot be encoded (empty input, tokenizer failure, ...).
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A chat template that does not parse, or does not render a conversation (its own
    /// `raise_exception`, or an expression it cannot evaluate).
    #[error("{0}")]
    ChatTemplate(String),

    /// A compute device that this build or this machine cannot provide.
    #[error("device `{requested}` is not available: {reason}")]
    Device {
        /// The device as asked for (`cuda:1`, `metal`, ...).
        requested: String,
        /// Why it cannot be had.
        reason: String,
    },

    /// A model could not be located (local directory or Hugging Face hub).
    #[error("cannot resolve model `{model}`: {reason}")]
    Model {
        /// The model as named (directory or hub id).
        model: String,
        /// Why it cannot be found, and what to do.
        reason: String,
    },

    /// An allocation the machine cannot provide, reported before it is attempted (e.g. the
    /// attention weights of a long sequence).
    #[error("{what} need {} but {}; ask for no weights (memory linear in the sequence) or stream them per block (`scaled_dot_product_attention_streamed`, `MultiHeadSelfAttention::forward_streamed`)", human_bytes(*.needed), .available.map(|a| format!("only {} are available", human_bytes(a))).unwrap_or_else(|| "that is more than this machine can address".to_string()))]
    Memory {
        /// What was about to be allocated.
        what: String,
        /// Bytes it needs.
        needed: u64,
        /// Bytes the OS reports as available, when known.
        available: Option<u64>,
    },

    /// A CPU kernel was handed views that do not fit together (a bug in this crate, reported
    /// instead of a panic).
    #[error("attention kernel: {0}")]
    Kernel(String),
}

fn human_bytes(b: u64) -> String {
    if b == u64::MAX {
        return "more than 2^64 bytes".to_string();
    }
    let gib = b as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.1} GiB ({b} bytes)")
    } else {
        format!("{:.1} MiB ({b} bytes)", b as f64 / (1u64 << 20) as f64)
    }
}

fn available_hint(
    name: &str,
    prefix: &str,
    available: &[String],
    total: usize,
    listed: bool,
) -> String {
    if !listed {
        return "this weights source cannot list its tensors (open the file with `Checkpoint` for a listing)".to_string();
    }
    let first = name.split('.').next().unwrap_or(name);
    let list = available.join(", ");
    let more = if total > available.len() {
        format!(", ... ({} more)", total - available.len())
    } else {
        String::new()
    };
    if total == 0 {
        "the checkpoint holds no tensors".to_string()
    } else if prefix.is_empty() {
        format!("no tensor name starts with `{first}`; the checkpoint holds {total} tensors: {list}{more}")
    } else {
        format!("tensors under `{prefix}`: {list}{more}")
    }
}

impl Error {
    /// Shorthand for a [`Error::Config`] without a file.
    pub fn config(message: impl Into<String>) -> Self {
        Error::Config {
            path: None,
            message: message.into(),
        }
    }

    /// Shorthand for an [`Error::Input`].
    pub fn input(
        name: impl Into<String>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        Error::Input {
            name: name.into(),
            expected: expected.into(),
            found: found.into(),
        }
    }

    /// Wraps this error so it can travel through Candle's error type (used by the
    /// checkpoint backend behind `VarBuilder`); `From<candle_core::Error>` unwraps it again.
    pub(crate) fn into_candle(self) -> candle_core::Error {
        candle_core::Error::WrappedContext {
            wrapped: Box::new(self),
            context: "candle-attention".to_string(),
        }
    }
}

impl From<candle_core::Error> for Error {
    fn from(err: candle_core::Error) -> Self {
        match err {
            candle_core::Error::WrappedContext { wrapped, context } => {
                match wrapped.downcast::<Error>() {
                    Ok(ours) => *ours,
                    Err(wrapped) => {
                        Error::Candle(candle_core::Error::WrappedContext { wrapped, context })
                    }
                }
            }
            candle_core::Error::WithBacktrace { inner, .. } => Error::from(*inner),
            candle_core::Error::CannotFindTensor { path } => Error::MissingTensor {
                name: path,
                prefix: String::new(),
                available: Vec::new(),
                total: 0,
                listed: false,
            },
            other => Error::Candle(other),
        }
    }
}
