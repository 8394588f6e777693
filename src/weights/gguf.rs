//! GGUF files (llama.cpp's container): the metadata and the tensors, read from the file's
//! bytes in memory (on 2 MB pages where Linux has them, else mapped) without trusting a
//! single count, length, offset or size in the file. Every one is checked against the bytes
//! that are there before it is used, so a truncated or hostile file is an
//! [`Error::InvalidGguf`] that says what and where, never a panic or an allocation the file
//! merely asked for (candle's parser trusts the header's counts and offsets).
//!
//! Layout (little-endian, versions 2 and 3): magic `GGUF`, version `u32`, tensor count
//! `u64`, metadata count `u64`; the metadata as `(key, type, value)`; per tensor its name,
//! `n_dims`, the dims (`ne[0]` is the contiguous one), its ggml type and its offset; then,
//! aligned to `general.alignment` (default 32), the data.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::kernels::quant::blocks::{self, QuantType};
use crate::weights::huge_pages::{self, HugeBytes};

/// The default alignment of the data section and of each tensor.
const DEFAULT_ALIGNMENT: usize = 32;
/// ggml's most dimensions.
const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays in the metadata.
const MAX_DEPTH: usize = 4;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `uint8`
    U8(u8),
    /// `int8`
    I8(i8),
    /// `uint16`
    U16(u16),
    /// `int16`
    I16(i16),
    /// `uint32`
    U32(u32),
    /// `int32`
    I32(i32),
    /// `uint64`
    U64(u64),
    /// `int64`
    I64(i64),
    /// `float32`
    F32(f32),
    /// `float64`
    F64(f64),
    /// `bool`
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of values of one type.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as a non-negative integer, whatever its integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, whatever its integer type.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float (either float type, or an integer).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The string, for a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, for an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The value of a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The GGUF name of the value's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "uint8",
            Self::I8(_) => "int8",
            Self::U16(_) => "uint16",
            Self::I16(_) => "int16",
            Self::U32(_) => "uint32",
            Self::I32(_) => "int32",
            Self::U64(_) => "uint64",
            Self::I64(_) => "int64",
            Self::F32(_) => "float32",
            Self::F64(_) => "float64",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
        }
    }
}

/// Where a tensor lies in the file and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`, ...).
    pub name: String,
    /// ggml's dims, `ne[0]` first (the contiguous one): a `(rows, cols)` matrix is
    /// `[cols, rows]`.
    pub ggml_dims: Vec<usize>,
    /// The type ggml stores it in; `Err(id)` for a type this crate cannot read.
    pub dtype: std::result::Result<QuantType, u32>,
    /// Byte range of the data in the file (empty for an unreadable type).
    range: std::ops::Range<usize>,
}

impl GgufTensorInfo {
    /// The shape in candle's order (the contiguous dimension last): `ggml_dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.ggml_dims.iter().rev().copied().collect()
    }

    /// Number of values.
    pub fn elem_count(&self) -> usize {
        self.ggml_dims.iter().product()
    }
}

/// The file's bytes: read onto huge pages, mapped, or already in memory.
enum Bytes {
    Huge(HugeBytes),
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Huge(h) => h.as_slice(),
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

struct Inner {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
}

/// A GGUF file, opened and checked (cheap to clone: its bytes are shared).
#[derive(Clone)]
pub struct GgufFile {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.inner.path)
            .field("version", &self.inner.version)
            .field("metadata", &self.inner.metadata.len())
            .field("tensors", &self.inner.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Reads (or maps) and checks the file at `path`: on Linux with transparent huge pages,
    /// its bytes are read once into memory on 2 MB pages, which a decode streams 5-18%
    /// faster than the 4 KB pages of a map (see docs/performance-archive.md); elsewhere, or when the
    /// file would take more than half the available memory, the file is mapped
    /// ([`GgufFile::open_mapped`], also the choice for a model on a GPU or metadata alone).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path.as_ref(), true)
    }

    /// Maps and checks the file at `path` (its pages read as they are touched, and dropped
    /// by the kernel under memory pressure).
    pub fn open_mapped(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path.as_ref(), false)
    }

    /// The file at `path` opened for a model on `device`: [`GgufFile::open`] for the CPU,
    /// which streams the bytes on every token, [`GgufFile::open_mapped`] for a GPU, which
    /// copies them once.
    pub fn open_for(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        Self::open_with(path.as_ref(), device.is_cpu())
    }

    fn open_with(path: &Path, read: bool) -> Result<Self> {
        let path = path.to_path_buf();
        let io = |cause| Error::Io {
            path: path.clone(),
            cause,
        };
        let mut file = std::fs::File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if meta.is_dir() {
            return Err(invalid(&path, "it is a directory, not a file"));
        }
        if meta.len() == 0 {
            return Err(invalid(&path, "the file is empty"));
        }
        let len = usize::try_from(meta.len())
            .map_err(|_| invalid(&path, "it is larger than this machine's address space"))?;
        if read {
            if let Some(bytes) = huge_pages::read(&mut file, len).map_err(io)? {
                return Self::parse(Bytes::Huge(bytes), path);
            }
        }
        // SAFETY: mapped read-only; like every mmap-based loader (llama.cpp's and candle's
        // included), this assumes no other process truncates the file while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Bytes::Mapped(map), path)
    }

    /// A GGUF file from bytes already in memory (`source` names them in errors).
    pub fn from_bytes(bytes: Vec<u8>, source: impl Into<PathBuf>) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes), source.into())
    }

    fn parse(bytes: Bytes, path: PathBuf) -> Result<Self> {
        let data = bytes.as_slice();
        let mut r = Reader { data, pos: 0 };
        let err = |reason: String| invalid(&path, reason);
        let magic = r.take(4).map_err(&err)?;
        if magic != b"GGUF" {
            return Err(err(format!(
                "the magic is {magic:?}, not \"GGUF\" (is it a GGUF file?)"
            )));
        }
        let version = r.u32().map_err(&err)?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(err(
                    "GGUF version 1 is not supported (versions 2 and 3 are)".into(),
                ))
            }
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(err("big-endian GGUF files are not supported".into()))
            }
            v => return Err(err(format!("unknown GGUF version {v} (2 and 3 are known)"))),
        }
        let tensor_count = r.u64().map_err(&err)?;
        let kv_count = r.u64().map_err(&err)?;
        // Each metadata entry takes at least 8 + 4 + 1 bytes, each tensor info 8 + 4 + 8 + 4 + 8.
        r.check_count(kv_count, 13, "metadata entries")
            .map_err(&err)?;
        r.check_count(tensor_count, 32, "tensor infos")
            .map_err(&err)?;
        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut meta_index = HashMap::new();
        for i in 0..kv_count {
            let at = r.pos;
            let key = r
                .string()
                .map_err(|e| err(format!("metadata entry {i} at byte {at}: key: {e}")))?;
            let ty = r
                .u32()
                .map_err(|e| err(format!("metadata `{key}`: type: {e}")))?;
            let value = r
                .value(ty, 0)
                .map_err(|e| err(format!("metadata `{key}`: {e}")))?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(err(format!("metadata key `{key}` appears twice")));
            }
            metadata.push((key, value));
        }
        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(GgufValue::U32(a)) if a.is_power_of_two() => *a as usize,
            Some(v) => {
                return Err(err(format!(
                    "general.alignment must be a power of two as uint32, found {v:?}"
                )))
            }
        };
        let mut infos = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let at = r.pos;
            let name = r
                .string()
                .map_err(|e| err(format!("tensor info {i} at byte {at}: name: {e}")))?;
            let info = r
                .tensor_info()
                .map_err(|e| err(format!("tensor `{name}`: {e}")))?;
            infos.push((name, info));
        }
        let data_start = r
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| err("the data section's offset overflows".into()))?;
        let mut tensors = Vec::with_capacity(infos.len());
        let mut tensor_index = HashMap::new();
        for (name, (dims, type_id, offset)) in infos {
            let tensor_err = |what: String| err(format!("tensor `{name}`: {what}"));
            let count = dims
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .ok_or_else(|| tensor_err(format!("dims {dims:?} overflow")))?;
            let dtype = QuantType::from_ggml_id(type_id).ok_or(type_id);
            let range = match dtype {
                Ok(ty) => {
                    if dims[0] % ty.block_values() != 0 {
                        return Err(tensor_err(format!(
                            "its rows of {} values are not whole {ty} blocks of {}",
                            dims[0],
                            ty.block_values()
                        )));
                    }
                    let size = ty
                        .bytes_of(count)
                        .ok_or_else(|| tensor_err("its size overflows".into()))?;
                    if offset % alignment as u64 != 0 {
                        return Err(tensor_err(format!(
                            "offset {offset} is not a multiple of the alignment {alignment}"
                        )));
                    }
                    let start = usize::try_from(offset)
                        .ok()
                        .and_then(|o| o.checked_add(data_start));
                    let end = start.and_then(|s| s.checked_add(size));
                    match (start, end) {
                        (Some(s), Some(e)) if e <= data.len() => s..e,
                        _ => {
                            return Err(tensor_err(format!(
                                "its {size} bytes at offset {offset} (byte {data_start} + \
                                 {offset}) run past the end of the {}-byte file (truncated?)",
                                data.len()
                            )))
                        }
                    }
                }
                Err(_) => 0..0,
            };
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(err(format!("tensor `{name}` appears twice")));
            }
            tensors.push(GgufTensorInfo {
                name,
                ggml_dims: dims,
                dtype,
                range,
            });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                path,
                bytes,
                version,
                metadata,
                meta_index,
                tensors,
                tensor_index,
                alignment,
            }),
        })
    }

    /// The file (or the name given to [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.inner.version
    }

    /// The data section's alignment.
    pub fn alignment(&self) -> usize {
        self.inner.alignment
    }

    /// The metadata in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.inner.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.inner
            .meta_index
            .get(key)
            .map(|&i| &self.inner.metadata[i].1)
    }

    /// A required metadata value; a missing key is an error naming it and the file.
    pub fn require(&self, key: &str) -> Result<&GgufValue> {
        self.get(key)
            .ok_or_else(|| invalid(self.path(), format!("the metadata has no `{key}`")))
    }

    /// A required non-negative integer.
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong_type(key, v, "a non-negative integer"))
    }

    /// A required float (or integer).
    pub fn require_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64()
            .ok_or_else(|| self.wrong_type(key, v, "a number"))
    }

    /// A required string.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str()
            .ok_or_else(|| self.wrong_type(key, v, "a string"))
    }

    fn wrong_type(&self, key: &str, v: &GgufValue, expected: &str) -> Error {
        invalid(
            self.path(),
            format!("`{key}` should be {expected}, found a {}", v.type_name()),
        )
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.inner.tensors
    }

    /// The tensor called `name`; a missing one is an error that lists what is there.
    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo> {
        match self.inner.tensor_index.get(name) {
            Some(&i) => Ok(&self.inner.tensors[i]),
            None => {
                let all: Vec<String> = self.inner.tensors.iter().map(|t| t.name.clone()).collect();
                Err(Error::MissingTensor {
                    name: name.to_string(),
                    total: all.len(),
                    available: all.into_iter().take(12).collect(),
                    prefix: String::new(),
                    listed: true,
                })
            }
        }
    }

    /// The file's bytes (a tensor's are at its `range` in them).
    pub(crate) fn file_bytes(&self) -> &[u8] {
        self.inner.bytes.as_slice()
    }

    /// The byte range of a readable tensor's data in [`GgufFile::file_bytes`].
    pub(crate) fn tensor_range(&self, name: &str) -> Result<std::ops::Range<usize>> {
        self.tensor_data(name)?;
        Ok(self.tensor_info(name)?.range.clone())
    }

    /// The stored bytes of a tensor and its type; a type this crate cannot read is an
    /// [`Error::UnsupportedGguf`] naming the tensor and the type.
    pub fn tensor_data(&self, name: &str) -> Result<(QuantType, &[u8])> {
        let info = self.tensor_info(name)?;
        match info.dtype {
            Ok(ty) => Ok((ty, &self.inner.bytes.as_slice()[info.range.clone()])),
            Err(id) => Err(Error::UnsupportedGguf {
                path: self.path().to_path_buf(),
                what: format!("tensor `{name}` of ggml type {}", ggml_type_name(id)),
                supported: QuantType::ALL.map(QuantType::name).join(", "),
            }),
        }
    }

    /// The tensor dequantized to f32 in candle's shape (`ggml_dims` reversed), exactly as
    /// gguf-py dequantizes it.
    pub fn dequantize(&self, name: &str, device: &Device) -> Result<Tensor> {
        let info = self.tensor_info(name)?;
        let shape = info.shape();
        let (ty, bytes) = self.tensor_data(name)?;
        let mut values = vec![0f32; info.elem_count()];
        if !blocks::dequantize(ty, bytes, &mut values) {
            return Err(invalid(
                self.path(),
                format!("tensor `{name}`: its bytes do not hold {shape:?} {ty} values"),
            ));
        }
        Ok(Tensor::from_vec(values, shape, device)?)
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> Error {
    Error::InvalidGguf {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// ggml's name of a type id this crate does not read.
fn ggml_type_name(id: u32) -> String {
    let name = match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("id {id} (unknown)"),
    };
    format!("{name} (id {id})")
}

/// A bounds-checked cursor; errors are plain strings that the caller puts in context.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

type ReadResult<T> = std::result::Result<T, String>;

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    fn take(&mut self, n: usize) -> ReadResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "needs {n} bytes at byte {} but the file ends at {} (truncated?)",
                self.pos,
                self.data.len()
            ));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> ReadResult<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> ReadResult<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> ReadResult<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Refuses a count of items of at least `min_bytes` each that the rest cannot hold.
    fn check_count(&self, count: u64, min_bytes: usize, what: &str) -> ReadResult<()> {
        if count > (self.remaining() / min_bytes) as u64 {
            return Err(format!(
                "{count} {what} cannot fit in the {} bytes left after byte {}",
                self.remaining(),
                self.pos
            ));
        }
        Ok(())
    }

    fn string(&mut self) -> ReadResult<String> {
        let len = self.u64()?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.remaining())
            .ok_or_else(|| {
                format!(
                    "a string of {len} bytes at byte {} runs past the end of the file",
                    self.pos
                )
            })?;
        let at = self.pos;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| format!("the string at byte {at} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: usize) -> ReadResult<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>()?[0]),
            1 => GgufValue::I8(self.array::<1>()?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("bool byte {b} at byte {}", self.pos - 1)),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(format!("arrays nested deeper than {MAX_DEPTH}"));
                }
                let elem = self.u32()?;
                let count = self.u64()?;
                self.check_count(count, min_value_bytes(elem)?, "array elements")?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            t => return Err(format!("unknown value type {t} at byte {}", self.pos - 4)),
        })
    }

    /// `(dims, type id, offset)` after the name.
    fn tensor_info(&mut self) -> ReadResult<(Vec<usize>, u32, u64)> {
        let n_dims = self.u32()? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("{n_dims} dimensions (1 to {MAX_DIMS} are valid)"));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = self.u64()?;
            match usize::try_from(d) {
                Ok(d) if d > 0 => dims.push(d),
                _ => return Err(format!("dimension {d}")),
            }
        }
        let type_id = self.u32()?;
        let offset = self.u64()?;
        Ok((dims, type_id, offset))
    }
}

/// The fewest bytes one array element of type `ty` takes.
fn min_value_bytes(ty: u32) -> ReadResult<usize> {
    Ok(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        t => return Err(format!("unknown array element type {t}")),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small GGUF file: a few metadata values and tensors of the given types.
    pub(crate) fn build(tensors: &[(&str, &[usize], QuantType, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        };
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&3u64.to_le_bytes());
        string(&mut out, "general.architecture");
        out.extend_from_slice(&8u32.to_le_bytes());
        string(&mut out, "llama");
        string(&mut out, "llama.block_count");
        out.extend_from_slice(&4u32.to_le_bytes());
        out.extend_from_slice(&2u32.to_le_bytes());
        string(&mut out, "tokenizer.ggml.tokens");
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&8u32.to_le_bytes());
        out.extend_from_slice(&2u64.to_le_bytes());
        string(&mut out, "a");
        string(&mut out, "b");
        let mut offset = 0u64;
        for (name, dims, ty, data) in tensors {
            string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            out.extend_from_slice(&ty.ggml_id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + data.len() as u64).next_multiple_of(32);
        }
        while out.len() % 32 != 0 {
            out.push(0);
        }
        for (_, _, _, data) in tensors {
            out.extend_from_slice(data);
            while out.len() % 32 != 0 {
                out.push(0);
            }
        }
        out
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_metadata_and_tensors() -> Result<()> {
        let w: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
        let bytes = build(&[("w", &[3, 2], QuantType::F32, f32_bytes(&w))]);
        let f = GgufFile::from_bytes(bytes, "test.gguf")?;
        assert_eq!(f.version(), 3);
        assert_eq!(f.require_str("general.architecture")?, "llama");
        assert_eq!(f.require_u64("llama.block_count")?, 2);
        let tokens = f
            .require("tokenizer.ggml.tokens")?
            .as_array()
            .map(|a| a.len());
        assert_eq!(tokens, Some(2));
        let t = f.dequantize("w", &Device::Cpu)?;
        assert_eq!(t.dims(), &[2, 3]);
        assert_eq!(t.flatten_all()?.to_vec1::<f32>()?, w);
        Ok(())
    }

    fn expect_invalid(bytes: Vec<u8>, words: &[&str]) {
        match GgufFile::from_bytes(bytes, "bad.gguf") {
            Err(e) => {
                let msg = e.to_string();
                for w in words {
                    assert!(msg.contains(w), "`{msg}` should mention `{w}`");
                }
            }
            Ok(_) => panic!("accepted a bad file; expected an error with {words:?}"),
        }
    }

    #[test]
    fn bad_files_are_errors_that_say_where() {
        let good = build(&[("w", &[32, 2], QuantType::Q8_0, vec![0u8; 68])]);
        expect_invalid(b"GGML".to_vec(), &["bad.gguf", "magic"]);
        expect_invalid(Vec::new(), &["truncated"]);
        let mut v1 = good.clone();
        v1[4] = 1;
        expect_invalid(v1, &["version 1"]);
        let mut be = good.clone();
        be[4..8].copy_from_slice(&3u32.to_be_bytes());
        expect_invalid(be, &["big-endian"]);
        // Truncated anywhere before the end of the data: never a panic, always an error (the
        // padding after the last tensor may go).
        let end = GgufFile::from_bytes(good.clone(), "good.gguf")
            .map(|f| f.tensors()[0].range.end)
            .unwrap_or(good.len());
        for cut in 0..end {
            assert!(
                GgufFile::from_bytes(good[..cut].to_vec(), "cut.gguf").is_err(),
                "{cut}"
            );
        }
        // A tensor count the file cannot hold.
        let mut many = good.clone();
        many[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        expect_invalid(many, &["tensor infos", "cannot fit"]);
        // Rows that are not whole blocks.
        expect_invalid(
            build(&[("w", &[16, 2], QuantType::Q8_0, vec![0u8; 68])]),
            &["`w`", "blocks"],
        );
        // Data past the end.
        let mut short = build(&[("w", &[32, 2], QuantType::Q8_0, vec![0u8; 68])]);
        short.truncate(short.len() - 40);
        expect_invalid(short, &["`w`", "past the end"]);
    }

    #[test]
    fn unknown_tensor_types_are_named_when_read() -> Result<()> {
        let mut bytes = build(&[("w", &[32], QuantType::Q8_0, vec![0u8; 34])]);
        // The type id sits 12 bytes before the end of the tensor info (type u32, offset u64).
        let info_end = bytes.len() - bytes.len() % 32;
        let at = (0..info_end.saturating_sub(12))
            .rev()
            .find(|&i| bytes[i..i + 4] == 8u32.to_le_bytes() && bytes[i + 4..i + 12] == [0; 8])
            .unwrap_or(0);
        bytes[at..at + 4].copy_from_slice(&16u32.to_le_bytes());
        let f = GgufFile::from_bytes(bytes, "iq.gguf")?;
        let e = f
            .tensor_data("w")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("IQ2_XXS") && e.contains("`w`"), "{e}");
        let e = f
            .tensor_data("nope")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("nope") && e.contains("w"), "{e}");
        Ok(())
    }
}
