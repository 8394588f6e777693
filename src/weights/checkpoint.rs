//! Safetensors checkpoints that explain themselves when something is wrong.
//!
//! [`Checkpoint`] opens one or more `.safetensors` files, checks them before any tensor is
//! read, and hands out a [`VarBuilder`] whose errors are this crate's: a missing tensor
//! lists what does exist under the nearest prefix, a wrong shape names the tensor with the
//! expected and found shapes, an integer tensor where a weight is expected names its dtype.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::{BufferedSafetensors, MmapedSafetensors};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use crate::error::{Error, Result};
use crate::kernels::gemm::matrix::{HalfRows, HalfSource};
use crate::kernels::widen::widen_half_bytes;

/// The error for a checkpoint's tensors that `model` (`a BERT encoder of 6 layers`) would
/// not read, so that its outputs would not be the checkpoint's; `Ok` when there are none.
pub(crate) fn refuse_unread<S: AsRef<str>>(model: &str, unread: Vec<S>) -> Result<()> {
    let mut unread: Vec<&str> = unread.iter().map(AsRef::as_ref).collect();
    if unread.is_empty() {
        return Ok(());
    }
    unread.sort_unstable();
    let shown = unread.len().min(12);
    Err(Error::config(format!(
        "the checkpoint has {} tensor(s) {model} does not read, so its outputs would not be \
         the checkpoint's: {}{}",
        unread.len(),
        unread[..shown].join(", "),
        if unread.len() > shown { ", ..." } else { "" }
    )))
}

/// Most tensor names listed in a [`Error::MissingTensor`] message.
const MAX_LISTED: usize = 32;

/// One or more safetensors files opened for reading, with their tensor names indexed.
#[derive(Clone)]
pub struct Checkpoint {
    inner: Arc<Inner>,
}

/// Memory-mapped files, or bytes already in memory.
enum Storage {
    Mapped(MmapedSafetensors),
    Buffered(BufferedSafetensors),
}

impl Storage {
    fn names(&self) -> BTreeSet<String> {
        match self {
            Storage::Mapped(s) => s.tensors().into_iter().map(|(n, _)| n).collect(),
            Storage::Buffered(s) => s.tensors().into_iter().map(|(n, _)| n).collect(),
        }
    }

    fn get(&self, name: &str) -> candle_core::Result<safetensors::tensor::TensorView<'_>> {
        match self {
            Storage::Mapped(s) => s.get(name),
            Storage::Buffered(s) => s.get(name),
        }
    }

    fn load(&self, name: &str, device: &Device) -> candle_core::Result<Tensor> {
        match self {
            Storage::Mapped(s) => s.load(name, device),
            Storage::Buffered(s) => s.load(name, device),
        }
    }
}

struct Inner {
    paths: Vec<PathBuf>,
    tensors: Storage,
    names: BTreeSet<String>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("paths", &self.inner.paths)
            .field("tensors", &self.inner.names.len())
            .finish()
    }
}

/// Half-precision matrices of a checkpoint, looked up by name on each use (no copy is held).
#[derive(Debug)]
struct MappedHalf {
    ckpt: Checkpoint,
    names: Vec<String>,
}

impl HalfSource for MappedHalf {
    fn parts(&self) -> Result<Vec<HalfRows<'_>>> {
        self.names
            .iter()
            .map(|n| {
                self.ckpt.half_matrix(n)?.ok_or_else(|| {
                    Error::Kernel(format!("{n} is no longer stored in half precision"))
                })
            })
            .collect()
    }
}

impl Checkpoint {
    /// Opens one safetensors file.
    ///
    /// Fails with [`Error::Io`] when the file cannot be read and with
    /// [`Error::InvalidCheckpoint`] when it is empty, truncated or not safetensors.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_many(&[path.as_ref()])
    }

    /// Opens several safetensors files (a sharded checkpoint) as one.
    pub fn open_many<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        if paths.is_empty() {
            return Err(Error::config("no checkpoint file given"));
        }
        let paths: Vec<PathBuf> = paths.iter().map(|p| p.as_ref().to_path_buf()).collect();
        for path in &paths {
            validate_file(path)?;
        }
        // SAFETY: the files are memory mapped read-only; like every mmap-based loader
        // (candle's included), this assumes no other process truncates them while mapped.
        let tensors =
            unsafe { MmapedSafetensors::multi(&paths) }.map_err(|e| Error::InvalidCheckpoint {
                path: paths[0].clone(),
                reason: describe_candle_error(&e),
            })?;
        let tensors = Storage::Mapped(tensors);
        let names = tensors.names();
        Ok(Self {
            inner: Arc::new(Inner {
                paths,
                tensors,
                names,
            }),
        })
    }

    /// A checkpoint from safetensors bytes already in memory (`source` names them in
    /// error messages). Checked like a file: empty, truncated or malformed bytes are an
    /// [`Error::InvalidCheckpoint`].
    pub fn from_bytes(bytes: Vec<u8>, source: impl Into<PathBuf>) -> Result<Self> {
        let source = source.into();
        validate_header(&bytes[..bytes.len().min(8)], bytes.len() as u64, &source)?;
        let tensors = BufferedSafetensors::new(bytes).map_err(|e| Error::InvalidCheckpoint {
            path: source.clone(),
            reason: describe_candle_error(&e),
        })?;
        let tensors = Storage::Buffered(tensors);
        let names = tensors.names();
        Ok(Self {
            inner: Arc::new(Inner {
                paths: vec![source],
                tensors,
                names,
            }),
        })
    }

    /// The files this checkpoint reads.
    pub fn paths(&self) -> &[PathBuf] {
        &self.inner.paths
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.inner.names.iter().map(String::as_str)
    }

    /// Whether a tensor of that exact name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.inner.names.contains(name)
    }

    /// The dtype a tensor is stored in, if it exists and candle knows the dtype.
    pub fn stored_dtype(&self, name: &str) -> Option<DType> {
        use safetensors::Dtype as S;
        let view = self.inner.tensors.get(name).ok()?;
        Some(match view.dtype() {
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::F32 => DType::F32,
            S::F64 => DType::F64,
            S::U8 => DType::U8,
            S::U32 => DType::U32,
            S::I64 => DType::I64,
            _ => return None,
        })
    }

    /// The matrix `name` as its f16 or bf16 bytes where the checkpoint holds them (the
    /// file's map, no copy); `Ok(None)` when it is stored in another dtype. A missing tensor,
    /// or one that is not a matrix, is an error naming it.
    pub(crate) fn half_matrix(&self, name: &str) -> Result<Option<HalfRows<'_>>> {
        use safetensors::Dtype as S;
        if !self.contains(name) {
            return Err(self.missing(name));
        }
        let view = self.inner.tensors.get(name)?;
        let bf16 = match view.dtype() {
            S::F16 => false,
            S::BF16 => true,
            _ => return Ok(None),
        };
        let &[rows, cols] = view.shape() else {
            return Err(Error::ShapeMismatch {
                tensor: name.to_string(),
                expected: "a matrix (rows, cols)".to_string(),
                found: view.shape().to_vec(),
            });
        };
        Ok(Some(HalfRows {
            bytes: view.data(),
            rows,
            cols,
            bf16,
        }))
    }

    /// The matrices `names` (each as [`Checkpoint::half_matrix`] found it in f16 or bf16),
    /// stacked along their outputs, for kernels that read them where the file is mapped.
    pub(crate) fn half_source(&self, names: Vec<String>) -> Arc<dyn HalfSource> {
        Arc::new(MappedHalf {
            ckpt: self.clone(),
            names,
        })
    }

    /// Names of the tensors under a dotted prefix (`"encoder.layer.0"` matches
    /// `encoder.layer.0.attention...` but not `encoder.layer.01...`). An empty prefix
    /// matches everything.
    pub fn names_under(&self, prefix: &str) -> Vec<&str> {
        self.names().filter(|n| under(n, prefix)).collect()
    }

    /// Whether any tensor lives under the dotted prefix.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.names().any(|n| under(n, prefix))
    }

    /// Fails with [`Error::PrefixNotFound`] (naming the roots that do exist) unless some
    /// tensor lives under `prefix`. An empty prefix always passes.
    pub fn check_prefix(&self, prefix: &str) -> Result<()> {
        if self.has_prefix(prefix) {
            return Ok(());
        }
        let roots: BTreeSet<&str> = self
            .names()
            .map(|n| n.split('.').next().unwrap_or(n))
            .collect();
        Err(Error::PrefixNotFound {
            prefix: prefix.to_string(),
            roots: roots
                .into_iter()
                .take(MAX_LISTED)
                .map(str::to_string)
                .collect(),
        })
    }

    /// A `VarBuilder` over this checkpoint; tensors are converted to `dtype` on `device`.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// Loads one tensor as stored (no dtype conversion).
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        if !self.contains(name) {
            return Err(self.missing(name));
        }
        Ok(self.inner.tensors.load(name, device)?)
    }

    /// The [`Error::MissingTensor`] for `name`, listing what exists under the longest
    /// prefix of `name` that the checkpoint knows.
    pub fn missing(&self, name: &str) -> Error {
        let parts: Vec<&str> = name.split('.').collect();
        let mut prefix = String::new();
        for k in (1..parts.len()).rev() {
            let candidate = parts[..k].join(".");
            if self.has_prefix(&candidate) {
                prefix = candidate;
                break;
            }
        }
        let all = self.names_under(&prefix);
        Error::MissingTensor {
            name: name.to_string(),
            total: all.len(),
            available: all
                .into_iter()
                .take(MAX_LISTED)
                .map(str::to_string)
                .collect(),
            prefix,
            listed: true,
        }
    }

    fn load_checked(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        if !self.contains(name) {
            return Err(self.missing(name));
        }
        let view = self.inner.tensors.get(name)?;
        let stored = view.dtype();
        use safetensors::Dtype as S;
        let stored_is_float = matches!(stored, S::F16 | S::BF16 | S::F32 | S::F64);
        if dtype.is_float() && !stored_is_float {
            return Err(Error::WrongDtype {
                tensor: name.to_string(),
                expected: "a floating point dtype (f16, bf16, f32 or f64)".to_string(),
                found: format!("{stored:?}"),
            });
        }
        if dtype == DType::F32 && matches!(stored, S::F16 | S::BF16) {
            // Half to f32 in parallel with the CPU's conversion instructions: candle's
            // element-wise cast takes ~7 ns per value, which dominates start-up time.
            let values = widen_to_f32(view.data(), stored == S::F16);
            return Ok(Tensor::from_vec(values, view.shape(), &Device::Cpu)?.to_device(device)?);
        }
        Ok(self.inner.tensors.load(name, device)?.to_dtype(dtype)?)
    }
}

/// Little-endian f16 or bf16 bytes to f32 values (exact), in parallel.
fn widen_to_f32(bytes: &[u8], is_f16: bool) -> Vec<f32> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0f32; bytes.len() / 2];
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(2 * CHUNK))
        .for_each(|(dst, src)| widen_half_bytes(src, !is_f16, dst));
    out
}

fn under(name: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || (name.len() > prefix.len()
            && name.starts_with(prefix)
            && name.as_bytes()[prefix.len()] == b'.')
}

impl SimpleBackend for Checkpoint {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let tensor = self
            .load_checked(name, dtype, dev)
            .map_err(Error::into_candle)?;
        of_shape(tensor, &s, || name.to_string())
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.load_checked(name, dtype, dev)
            .map_err(Error::into_candle)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.contains(name)
    }
}

/// `t` when it has shape `s`; otherwise a shape error naming the tensor (`what()`), for a
/// `VarBuilder` backend's `get`.
pub(crate) fn of_shape(
    t: Tensor,
    s: &Shape,
    what: impl FnOnce() -> String,
) -> candle_core::Result<Tensor> {
    if t.shape() != s {
        return Err(Error::ShapeMismatch {
            tensor: what(),
            expected: format!("{:?}", s.dims()),
            found: t.dims().to_vec(),
        }
        .into_candle());
    }
    Ok(t)
}

/// Checks what can be checked before mapping: the file exists, is a file, is not empty
/// and its 8-byte header length fits in the file.
fn validate_file(path: &Path) -> Result<()> {
    let io = |cause| Error::Io {
        path: path.to_path_buf(),
        cause,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if meta.is_dir() {
        return Err(Error::InvalidCheckpoint {
            path: path.to_path_buf(),
            reason: "it is a directory, not a file".to_string(),
        });
    }
    let mut head = Vec::with_capacity(8);
    {
        use std::io::Read;
        let f = std::fs::File::open(path).map_err(io)?;
        f.take(8).read_to_end(&mut head).map_err(io)?;
    }
    validate_header(&head, meta.len(), path)
}

/// Checks the first (up to) 8 bytes of a safetensors buffer of `len` bytes: not empty,
/// long enough for the header length field, and a header that fits.
fn validate_header(head: &[u8], len: u64, path: &Path) -> Result<()> {
    let invalid = |reason: String| Error::InvalidCheckpoint {
        path: path.to_path_buf(),
        reason,
    };
    if len == 0 {
        return Err(invalid("the file is empty (0 bytes)".to_string()));
    }
    let Ok(head) = <[u8; 8]>::try_from(head) else {
        return Err(invalid(format!(
            "the file has {len} bytes, too short for the 8-byte safetensors header length"
        )));
    };
    let header_len = u64::from_le_bytes(head);
    if header_len > len - 8 {
        return Err(invalid(format!(
            "the header claims {header_len} bytes of metadata but the file has only {} bytes after the length field (truncated, or not safetensors)",
            len - 8
        )));
    }
    Ok(())
}

/// Finds the safetensors error inside a candle error and says what it means.
fn describe_candle_error(err: &candle_core::Error) -> String {
    match err {
        candle_core::Error::WithPath { inner, .. }
        | candle_core::Error::WithBacktrace { inner, .. } => describe_candle_error(inner),
        candle_core::Error::SafeTensor(e) => describe_safetensors_error(e),
        other => other.to_string(),
    }
}

fn describe_safetensors_error(err: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match err {
        E::InvalidHeader(_) => "the header is not valid UTF-8".to_string(),
        E::InvalidHeaderDeserialization(e) => {
            format!("the header is not valid safetensors JSON ({e})")
        }
        E::HeaderTooLarge => {
            "the header length field is larger than safetensors allows".to_string()
        }
        E::HeaderTooSmall => "the file is too small to hold a safetensors header".to_string(),
        E::InvalidHeaderLength => {
            "the header length field points past the end of the file".to_string()
        }
        E::MetadataIncompleteBuffer => {
            "the tensor data is shorter or longer than the header says (truncated file?)"
                .to_string()
        }
        E::InvalidOffset(name) => format!("tensor `{name}` has invalid data offsets"),
        E::TensorInvalidInfo => "a tensor's dtype and shape do not match its byte size".to_string(),
        E::ValidationOverflow => "tensor sizes in the header overflow".to_string(),
        other => other.to_string(),
    }
}
