//! A projection or embedding weight kept as a GGUF file stores it (ggml blocks, read from the
//! file's memory map), so that a quantized model stays near its file size in memory. A few
//! input rows (a decode step, a short prompt) are multiplied on the blocks as they are read,
//! each block once for all of them; more rows (a longer prompt) by the weight dequantized
//! once for the call, with the f32 kernels. The weight's values are gguf-py's either way.

use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::Linear;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::activation::silu_times_into;
use crate::kernels::cpu_tensor::CpuF32;
use crate::kernels::decode::gemv::output_like;
use crate::kernels::decode::quant_gemv::{
    self, int8_activations, quant_gemv_gated_rows, quant_gemv_parts_rows,
};
use crate::kernels::gemm::int8_product;
use crate::kernels::gemm::matrix::MatRef;
use crate::kernels::gemm::packed::{self, PackedWeight};
use crate::kernels::quant::blocks::QuantType;
use crate::weights::gguf::GgufFile;
use crate::weights::gguf_layout::unpermuted_order;
use crate::weights::huge_pages::{self, HugeBytes};

/// Rows of one type for a product: a weight's bytes, or a range of a stacked buffer (which
/// the next part may extend).
enum Run<'a> {
    Bytes(&'a [u8]),
    Stacked(&'a Arc<HugeBytes>, std::ops::Range<usize>),
}

/// Where a weight's blocks are.
#[derive(Clone)]
enum Blocks {
    /// In the file's bytes, as stored: their range (found once at load, not
    /// by name on every product).
    File(GgufFile, std::ops::Range<usize>),
    /// Rows reordered at load (llama.cpp's rotary order undone).
    Owned(Arc<Vec<u8>>),
    /// A range of a buffer that several weights share (on 2 MB pages where Linux has
    /// them): [`QuantWeight::stacked`].
    Stacked(Arc<HugeBytes>, std::ops::Range<usize>),
}

/// Up to how many input rows are multiplied on the blocks as they are read (the row kernels,
/// each block once for all rows); more by the weight dequantized once for the call into
/// packed panels (or repacked as integers, 8-bit). Where the two took about the same time
/// in SmolLM2 prompts, 2 threads, AMD Zen 4 (docs/performance-archive.md): ~64 rows with the AVX-512
/// row kernels (4 rows of `x` a pass), ~24-32 with the AVX2 ones (2 a pass), ~24-32 for the
/// 8-bit row kernels (4 a pass) against the 8-bit prompt product.
fn few_rows() -> usize {
    use crate::kernels::decode::quant_gemv_avx512::Avx512;
    use crate::kernels::decode::row_kernels::RowKernels;
    if int8_activations() && int8_product::available() {
        24
    } else if Avx512::supports(QuantType::Q8_0) {
        48
    } else {
        24
    }
}

/// `f` on `x`'s values (borrowed when `x` is contiguous, else copied once) and its number of
/// rows, when `x` is f32 on the CPU and tracks no gradient (what this crate's kernels take);
/// `Ok(None)` otherwise.
fn with_cpu_rows<R>(
    x: &Tensor,
    f: impl FnOnce(&[f32], usize) -> Result<Option<R>>,
) -> Result<Option<R>> {
    if x.track_op() || !x.device().is_cpu() || x.dtype() != DType::F32 {
        return Ok(None);
    }
    let cols = x.dim(D::Minus1)?.max(1);
    if x.is_contiguous() {
        let view = CpuF32::new(x, "x")?;
        let xs = view.contiguous()?;
        return f(xs, xs.len() / cols);
    }
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    f(&xs, xs.len() / cols)
}

/// `x W_p^T` `(rows, sum of the parts' rows)` for `rows` f32 input rows `xs` on the CPU and
/// weights `parts` of one input width stacked along the outputs: up to [`few_rows`] on the
/// row kernels (one pass over the blocks, and over the threads, for all rows), more by the
/// weights dequantized for the call straight into one packed weight's panels (on the pool),
/// then one packed product, or with 8-bit activations opted in, their integers by `x`
/// quantized ([`int8_product`], AVX-512 VNNI); `Ok(None)` when this CPU has no packed
/// kernels.
fn stacked_values(parts: &[&QuantWeight], xs: &[f32], rows: usize) -> Result<Option<Vec<f32>>> {
    let Some(cols) = parts.first().map(|p| p.cols) else {
        return Ok(None);
    };
    let data = parts
        .iter()
        .map(|p| Ok((p.ty, p.data()?)))
        .collect::<Result<Vec<_>>>()?;
    let out: usize = parts.iter().map(|p| p.rows).sum();
    if rows <= few_rows() {
        let mut y = vec![0f32; rows * out];
        quant_gemv_parts_rows(&data, xs, cols, &mut y)?;
        return Ok(Some(y));
    }
    if int8_activations() {
        let stack: Vec<int8_product::Part<'_>> = data
            .iter()
            .zip(parts)
            .map(|(&(ty, bytes), p)| (ty, bytes, p.rows))
            .collect();
        if let Some(y) = int8_product::product(&stack, cols, xs, rows)? {
            return Ok(Some(y));
        }
    }
    // Output rows `first..first + count` of the stacked weight, from whichever parts hold
    // them, dequantized into `out`.
    let fill = |first: usize, count: usize, out: &mut [f32]| {
        let (mut start, mut done) = (0, 0);
        for (p, &(ty, bytes)) in parts.iter().zip(&data) {
            let (lo, hi) = (first.max(start), (first + count).min(start + p.rows));
            if lo < hi {
                let ok = ty.bytes_of(cols).is_some_and(|rb| {
                    bytes
                        .get((lo - start) * rb..(hi - start) * rb)
                        .zip(out.get_mut((lo - first) * cols..(hi - first) * cols))
                        .is_some_and(|(b, o)| quant_gemv::dequantize(ty, b, o))
                });
                if !ok {
                    return false;
                }
                done += hi - lo;
            }
            start += p.rows;
        }
        done == count
    };
    let Some(w) = PackedWeight::pack_rows(cols, out, &fill)? else {
        return Ok(None);
    };
    let m = MatRef::row_major(xs, rows, cols)?;
    Ok(Some(packed::linear(m, &w, 0..1, None)?))
}

/// A `(rows, cols)` weight of a block type, in its file.
#[derive(Clone)]
pub(crate) struct QuantWeight {
    blocks: Blocks,
    name: String,
    ty: QuantType,
    rows: usize,
    cols: usize,
    /// On a CUDA or Metal device: the blocks there ([`QuantWeight::on`]).
    on_device: Option<OnDevice>,
}

/// A weight's blocks on a CUDA or Metal device, for [`QuantWeight::forward_on_device`]:
/// dequantized there for each exact product on CUDA, else multiplied by candle's quantized
/// kernels.
#[derive(Clone)]
pub(crate) struct OnDevice {
    blocks: Arc<QTensor>,
    product: Arc<QMatMul>,
}

impl std::fmt::Debug for QuantWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantWeight({} {} {}x{})",
            self.name, self.ty, self.rows, self.cols
        )
    }
}

impl QuantWeight {
    /// The matrix `name` of `file` when it is stored in a block type (`None` for the float
    /// types, which the dense kernels read as they are), checked to be `(rows, cols)`.
    pub fn from_gguf(
        file: &GgufFile,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Self>> {
        let info = file.tensor_info(name)?;
        let ty = match info.dtype {
            Ok(QuantType::F32 | QuantType::F16 | QuantType::BF16) => return Ok(None),
            Ok(ty) => ty,
            // Reading it reports the type.
            Err(_) => return file.tensor_data(name).map(|_| None),
        };
        if info.ggml_dims != [cols, rows] {
            return Err(Error::ShapeMismatch {
                tensor: name.to_string(),
                expected: format!("ggml dims [{cols}, {rows}] ({rows} rows of {cols})"),
                found: info.ggml_dims.clone(),
            });
        }
        Ok(Some(Self {
            blocks: Blocks::File(file.clone(), file.tensor_range(name)?),
            name: name.to_string(),
            ty,
            rows,
            cols,
            on_device: None,
        }))
    }

    fn data(&self) -> Result<&[u8]> {
        match &self.blocks {
            Blocks::File(f, range) => f.file_bytes().get(range.clone()).ok_or_else(|| {
                Error::Kernel(format!("`{}`: its range is outside its file", self.name))
            }),
            Blocks::Owned(v) => Ok(v),
            Blocks::Stacked(b, range) => b.as_slice().get(range.clone()).ok_or_else(|| {
                Error::Kernel(format!("`{}`: its range is outside its buffer", self.name))
            }),
        }
    }

    /// Groups of weights (each part with `Some(heads)` where llama.cpp's rotary row order
    /// over `heads` heads is to be undone) copied into one buffer, on 2 MB pages where Linux
    /// has them: each group's parts one after another, so that a product of a whole group
    /// reads one stream ([`QuantWeight::row_product`] joins them). The same weights, in the
    /// same order, reading from it.
    pub(crate) fn stacked(groups: &[Vec<(Self, Option<usize>)>]) -> Result<Vec<Vec<Self>>> {
        // Each group starts on a cache line.
        let mut at = 0usize;
        let mut places = Vec::with_capacity(groups.len());
        for group in groups {
            at = at.div_ceil(64) * 64;
            let mut ranges = Vec::with_capacity(group.len());
            for (w, _) in group {
                let len = w.data()?.len();
                ranges.push(at..at + len);
                at += len;
            }
            places.push(ranges);
        }
        let mut buffer = huge_pages::zeroed(at).map_err(|e| {
            Error::Kernel(format!(
                "a buffer of {at} bytes for the stacked weights: {e}"
            ))
        })?;
        for (group, ranges) in groups.iter().zip(&places) {
            for ((w, heads), range) in group.iter().zip(ranges) {
                let out = &mut buffer.as_mut_slice()[range.clone()];
                match heads {
                    Some(heads) => w.unpermuted_into(*heads, out)?,
                    None => out.copy_from_slice(w.data()?),
                }
            }
        }
        let buffer = Arc::new(buffer);
        Ok(groups
            .iter()
            .zip(places)
            .map(|(group, ranges)| {
                group
                    .iter()
                    .zip(ranges)
                    .map(|((w, _), range)| Self {
                        blocks: Blocks::Stacked(buffer.clone(), range),
                        on_device: None,
                        ..w.clone()
                    })
                    .collect()
            })
            .collect())
    }

    /// `(rows, cols)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The weight dequantized, `(rows, cols)` f32.
    pub fn dequantize(&self, device: &Device) -> Result<Tensor> {
        let mut values = vec![0f32; self.rows * self.cols];
        if !quant_gemv::dequantize(self.ty, self.data()?, &mut values) {
            return Err(Error::Kernel(format!(
                "`{}` does not dequantize",
                self.name
            )));
        }
        Ok(Tensor::from_vec(values, (self.rows, self.cols), device)?)
    }

    /// The weight with llama.cpp's query/key row permutation undone
    /// ([`unpermuted_order`]), its blocks copied row by row.
    pub fn unpermuted_rows(&self, heads: usize) -> Result<Self> {
        let mut out = vec![0u8; self.data()?.len()];
        self.unpermuted_into(heads, &mut out)?;
        Ok(Self {
            blocks: Blocks::Owned(Arc::new(out)),
            ..self.clone()
        })
    }

    /// The blocks with llama.cpp's query/key row permutation undone, into `out` (the
    /// weight's size).
    fn unpermuted_into(&self, heads: usize, out: &mut [u8]) -> Result<()> {
        let row = self
            .ty
            .bytes_of(self.cols)
            .filter(|&r| r > 0)
            .ok_or_else(|| Error::Kernel(format!("`{}`: rows are not whole blocks", self.name)))?;
        let data = self.data()?;
        for (dst, src) in out
            .chunks_exact_mut(row)
            .zip(unpermuted_order(self.rows, heads)?)
        {
            dst.copy_from_slice(&data[src * row..(src + 1) * row]);
        }
        Ok(())
    }

    /// The same weight with its blocks also on `device` (CUDA or Metal), for
    /// [`QuantWeight::forward_on_device`]; the CPU keeps reading the file's. On the CPU
    /// itself: unchanged.
    pub fn on(self, device: &Device) -> Result<Self> {
        if device.is_cpu() {
            return Ok(self);
        }
        Ok(Self {
            on_device: Some(self.blocks_on(device)?),
            ..self
        })
    }

    /// The blocks on `device`, ready for both products of [`QuantWeight::forward_on_device`].
    pub(crate) fn blocks_on(&self, device: &Device) -> Result<OnDevice> {
        let blocks = Arc::new(self.candle_qtensor(device)?);
        let product = Arc::new(QMatMul::from_arc(blocks.clone())?);
        Ok(OnDevice { blocks, product })
    }

    /// The blocks as candle's `QTensor` `(rows, cols)` on `device` (the same bytes: candle
    /// reads every type this crate keeps in blocks).
    pub fn candle_qtensor(&self, device: &Device) -> Result<QTensor> {
        Ok(qtensor_from_ggml(
            self.ty.candle_dtype(),
            self.data()?,
            vec![self.rows, self.cols],
            device,
        )?)
    }

    /// `x W^T` on `x`'s device, for a weight placed there by [`QuantWeight::on`].
    ///
    /// On CUDA, exact unless `int8`: one f32 row by candle's f32-activation kernels (the
    /// 32-value block types) or this crate's (the K-quants), each value dequantized in
    /// registers as gguf-py makes it ([`cuda_gemv::ExactGemv`]); otherwise the blocks
    /// dequantized there for the call (a transient f32 copy of this one weight), then the
    /// dense product in `x`'s dtype, as the CPU's fallback. With `int8`,
    /// and always on Metal (whose candle dequantizes on the host, a round trip per call):
    /// candle's quantized kernels, on f32 activations. CUDA's round them to 8 bits (q8_1, as
    /// llama.cpp); Metal's one-row product reads them as they are, its larger ones in half
    /// precision.
    pub(crate) fn forward_on_device(
        &self,
        on: &OnDevice,
        x: &Tensor,
        int8: bool,
    ) -> Result<Tensor> {
        if int8 || !x.device().is_cuda() {
            return Self::kernels_product(on, x);
        }
        #[cfg(feature = "cuda")]
        if let Some(y) = self.exact_row_on_cuda(on, x)? {
            return Ok(y);
        }
        Self::dequantized_product(on, x)
    }

    /// `x W^T` for one f32 row on CUDA by the f32-activation kernels of
    /// [`cuda_gemv::ExactGemv`], each value gguf-py's; `None` for more rows, another dtype,
    /// or a type or width those kernels do not take.
    #[cfg(feature = "cuda")]
    fn exact_row_on_cuda(&self, on: &OnDevice, x: &Tensor) -> Result<Option<Tensor>> {
        use crate::weights::cuda_gemv::ExactGemv;
        let one_row = x.elem_count() == self.cols && x.dtype() == DType::F32;
        if !one_row || ExactGemv::kernel(self.ty, self.cols).is_none() {
            return Ok(None);
        }
        let op = ExactGemv {
            w: on.blocks.clone(),
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
        };
        Ok(Some(x.contiguous()?.apply_op1_no_bwd(&op)?))
    }

    /// `x W^T` by candle's quantized kernels on `x`'s device (f32 activations in).
    fn kernels_product(on: &OnDevice, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        Ok(on
            .product
            .forward(&x.to_dtype(DType::F32)?)?
            .to_dtype(dtype)?)
    }

    /// `x W^T` by the blocks dequantized on `x`'s device, then the dense product in `x`'s
    /// dtype.
    fn dequantized_product(on: &OnDevice, x: &Tensor) -> Result<Tensor> {
        let w = on.blocks.dequantize(x.device())?.to_dtype(x.dtype())?;
        Ok(Linear::new(w, None).forward(x)?)
    }

    /// `x W^T` for `x` `(..., cols)`; returns `(..., rows)`. A few f32 rows on the CPU go
    /// through this crate's row kernels, on a device the weight was placed on
    /// ([`QuantWeight::on`]) through [`QuantWeight::forward_on_device`]; more f32 rows on the CPU (a
    /// prompt) by the weight dequantized for the call straight into the micro-kernels'
    /// panels; anything else (an input that tracks gradients: candle's kernels have no
    /// backward, another dtype or device) by the weight dequantized as a tensor.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let inp = x.dim(D::Minus1)?;
        if inp != self.cols {
            return Err(Error::input(
                "x",
                format!("(..., {}) for `{}`", self.cols, self.name),
                format!("{:?}", x.dims()),
            ));
        }
        if !x.track_op() {
            if let (false, Some(on)) = (x.device().is_cpu(), &self.on_device) {
                return self.forward_on_device(on, x, int8_activations());
            }
        }
        if let Some(y) = with_cpu_rows(x, |xs, rows| stacked_values(&[self], xs, rows))? {
            return output_like(x, y, self.rows);
        }
        // The weight dequantized once for the call, multiplied as a dense layer would.
        let w = self
            .dequantize(&Device::Cpu)?
            .to_device(x.device())?
            .to_dtype(x.dtype())?;
        Ok(Linear::new(w, None).forward(x)?)
    }

    /// `silu(x W_g^T) * (x W_u^T)` (`silu(g) = g / (1 + e^-g)`, by
    /// [`crate::kernels::activation::silu`]) for f32 rows on the CPU, the same values as the
    /// two products and that SiLU: a decode step's rows in one pass over the threads whose
    /// tasks multiply their rows of both and combine them; a prompt's as one packed product
    /// of the two weights stacked, then one pass combining them; `Ok(None)` elsewhere (the
    /// caller composes the ops).
    pub(crate) fn forward_gated(gate: &Self, up: &Self, x: &Tensor) -> Result<Option<Tensor>> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) || x.dim(D::Minus1)? != gate.cols {
            return Ok(None);
        }
        let i = gate.rows;
        let y = with_cpu_rows(x, |xs, rows| {
            if rows <= few_rows() {
                // A decode step or a short prompt: each task multiplies its rows of both, for
                // every row of `x`, and combines them.
                let (gd, ud) = ((gate.ty, gate.data()?), (up.ty, up.data()?));
                let mut y = vec![0f32; rows * i];
                quant_gemv_gated_rows(gd, ud, xs, gate.cols, &mut y)?;
                return Ok(Some(y));
            }
            // A prompt: both weights in one product, `(rows, 2 i)`, then combined.
            let Some(gu) = stacked_values(&[gate, up], xs, rows)? else {
                return Ok(None);
            };
            if gu.len() != rows * 2 * i {
                return Err(Error::Kernel(format!(
                    "gate and up of `{}`: {} values for {rows} rows of 2 x {i}",
                    gate.name,
                    gu.len()
                )));
            }
            let mut y = Vec::with_capacity(rows * i);
            y.spare_capacity_mut()[..rows * i]
                .par_chunks_mut(i)
                .zip(gu.par_chunks(2 * i))
                .try_for_each(|(y, gu)| {
                    let (g, u) = gu.split_at(i);
                    if silu_times_into(g, u, y) {
                        Ok(())
                    } else {
                        Err(Error::Kernel(format!(
                            "gate and up of `{}`: rows of different lengths",
                            gate.name
                        )))
                    }
                })?;
            // SAFETY: `gu` holds `rows` rows of `2 i` (checked above), so each of the `rows`
            // chunks of `i` was written whole (`silu_times_into` returned true for each; no
            // zeroing pass first).
            unsafe { y.set_len(rows * i) };
            Ok(Some(y))
        })?;
        y.map(|y| output_like(x, y, i)).transpose()
    }

    /// `y = x W_p^T` for one f32 row `x` on the CPU and the weights `parts` (of one input
    /// width) stacked along the outputs, into `y` (their rows together): the values
    /// [`QuantWeight::forward`] gives for that row, without tensors (a decode step's path).
    pub(crate) fn row_product(parts: &[&Self], x: &[f32], y: &mut [f32]) -> Result<()> {
        // Parts one after another in one stacked buffer, of one type, are one run of rows
        // (one stream, split into tasks as one).
        let mut runs: Vec<(QuantType, Run<'_>)> = Vec::with_capacity(parts.len());
        for &p in parts {
            if p.cols != x.len() {
                return Err(Error::input(
                    "x",
                    format!("{} values for `{}`", p.cols, p.name),
                    format!("{}", x.len()),
                ));
            }
            if let (Some((ty, Run::Stacked(buf, range))), Blocks::Stacked(b, r)) =
                (runs.last_mut(), &p.blocks)
            {
                if Arc::ptr_eq(buf, b) && range.end == r.start && *ty == p.ty {
                    range.end = r.end;
                    continue;
                }
            }
            let run = match &p.blocks {
                Blocks::Stacked(b, r) => Run::Stacked(b, r.clone()),
                _ => Run::Bytes(p.data()?),
            };
            runs.push((p.ty, run));
        }
        let data = runs
            .iter()
            .map(|(ty, run)| {
                let bytes = match run {
                    Run::Bytes(b) => Some(*b),
                    Run::Stacked(b, r) => b.as_slice().get(r.clone()),
                };
                bytes
                    .map(|b| (*ty, b))
                    .ok_or_else(|| Error::Kernel("a stacked range outside its buffer".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        quant_gemv_parts_rows(&data, x, x.len(), y)
    }

    /// `y = silu(x W_g^T) * (x W_u^T)` for one f32 row `x` on the CPU: the values
    /// [`QuantWeight::forward_gated`] gives for that row, without tensors.
    pub(crate) fn row_gated(gate: &Self, up: &Self, x: &[f32], y: &mut [f32]) -> Result<()> {
        if gate.cols != x.len() || up.cols != x.len() {
            return Err(Error::input(
                "x",
                format!("{} values for `{}`", gate.cols, gate.name),
                format!("{}", x.len()),
            ));
        }
        let (gd, ud) = ((gate.ty, gate.data()?), (up.ty, up.data()?));
        quant_gemv_gated_rows(gd, ud, x, x.len(), y)
    }

    /// `x W_p^T` for the weights `parts` (of one input width) stacked along the outputs,
    /// `(..., sum of their rows)`, for f32 rows on the CPU, as one product
    /// ([`stacked_values`]); `Ok(None)` elsewhere (each part's [`QuantWeight::forward`] then).
    pub(crate) fn stacked_rows(parts: &[Self], x: &Tensor) -> Result<Option<Tensor>> {
        let Some(cols) = parts.first().map(|p| p.cols) else {
            return Ok(None);
        };
        if parts.iter().any(|p| p.cols != cols) || x.dim(D::Minus1)? != cols {
            return Ok(None);
        }
        let parts: Vec<&Self> = parts.iter().collect();
        let out: usize = parts.iter().map(|p| p.rows).sum();
        let y = with_cpu_rows(x, |xs, rows| stacked_values(&parts, xs, rows))?;
        y.map(|y| output_like(x, y, out)).transpose()
    }

    /// The rows `ids` (an embedding lookup), dequantized on the CPU: `(..., cols)` f32 for
    /// ids `(...)`, on `ids`' device.
    pub fn rows_of(&self, ids: &Tensor) -> Result<Tensor> {
        let flat: Vec<u32> = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
        let row_bytes = self
            .ty
            .bytes_of(self.cols)
            .ok_or_else(|| Error::Kernel(format!("`{}`: rows are not whole blocks", self.name)))?;
        let data = self.data()?;
        let mut out = vec![0f32; flat.len() * self.cols];
        for (&id, dst) in flat.iter().zip(out.chunks_mut(self.cols)) {
            let id = id as usize;
            if id >= self.rows {
                return Err(Error::input(
                    "ids",
                    format!("ids below {} (`{}`)", self.rows, self.name),
                    format!("id {id}"),
                ));
            }
            let src = &data[id * row_bytes..(id + 1) * row_bytes];
            if !quant_gemv::dequantize(self.ty, src, dst) {
                return Err(Error::Kernel(format!(
                    "`{}` row {id} does not dequantize",
                    self.name
                )));
            }
        }
        let mut shape = ids.dims().to_vec();
        shape.push(self.cols);
        Ok(Tensor::from_vec(out, shape, &Device::Cpu)?.to_device(ids.device())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layers' Q, K and V copied into one buffer (`QuantWeight::stacked`, Q and K reordered
    /// as llama.cpp's rotary rows): the same blocks as the weights reordered apart, and a
    /// decode step's product over a layer's three (joined into one run) the same bits.
    #[test]
    fn weights_in_one_buffer_multiply_as_apart() -> Result<()> {
        let cols = 256;
        let part = |i: usize, ty: QuantType, rows: usize| -> Result<QuantWeight> {
            let w = Tensor::from_vec(
                crate::kernels::test_values(rows * cols, 60 + i),
                (rows, cols),
                &Device::Cpu,
            )?;
            Ok(QuantWeight {
                blocks: Blocks::Owned(Arc::new(
                    QTensor::quantize(&w, ty.candle_dtype())?.data()?.to_vec(),
                )),
                name: format!("part{i}"),
                ty,
                rows,
                cols,
                on_device: None,
            })
        };
        // Two layers: Q and K reordered as llama.cpp's rotary rows (4 and 2 heads), V as is;
        // the second layer's V of another type (Q4_K_M files mix them).
        let layers = [
            [
                part(0, QuantType::Q4_1, 32)?,
                part(1, QuantType::Q4_1, 16)?,
                part(2, QuantType::Q4_1, 16)?,
            ],
            [
                part(3, QuantType::Q5_0, 32)?,
                part(4, QuantType::Q5_0, 16)?,
                part(5, QuantType::Q8_0, 16)?,
            ],
        ];
        let groups: Vec<Vec<(QuantWeight, Option<usize>)>> = layers
            .iter()
            .map(|[q, k, v]| {
                vec![
                    (q.clone(), Some(4)),
                    (k.clone(), Some(2)),
                    (v.clone(), None),
                ]
            })
            .collect();
        let stacked = QuantWeight::stacked(&groups)?;
        let x = crate::kernels::test_values(cols, 9);
        for ([q, k, v], s) in layers.iter().zip(&stacked) {
            let apart = [q.unpermuted_rows(4)?, k.unpermuted_rows(2)?, v.clone()];
            for (a, b) in apart.iter().zip(s) {
                assert_eq!(a.data()?, b.data()?, "{}", a.name);
                assert_eq!((a.ty, a.dims()), (b.ty, b.dims()));
            }
            let n = 64;
            let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
            QuantWeight::row_product(&[&apart[0], &apart[1], &apart[2]], &x, &mut want)?;
            QuantWeight::row_product(&[&s[0], &s[1], &s[2]], &x, &mut got)?;
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "the stacked product differs"
            );
        }
        Ok(())
    }

    /// Weights of different types stacked along the outputs (row counts that are no multiple
    /// of a panel, so panels span two weights): the stacked product equals each weight's own
    /// product bit for bit, for a decode step's or a short prompt's rows (row kernels, each
    /// row of the result the same bits as that row alone) and a longer prompt's (one packed
    /// product), contiguous or not; the gated product equals silu of the gate's times the up
    /// projection's.
    #[test]
    fn stacked_weights_multiply_as_each_alone() -> Result<()> {
        let cols = 256;
        let mut parts = Vec::new();
        for (i, (ty, rows)) in [
            (QuantType::Q4_1, 40),
            (QuantType::Q8_0, 24),
            (QuantType::Q4K, 40),
        ]
        .into_iter()
        .enumerate()
        {
            let w = Tensor::from_vec(
                crate::kernels::test_values(rows * cols, 30 + i),
                (rows, cols),
                &Device::Cpu,
            )?;
            parts.push(quantized_by_candle(&w, ty, &format!("part{i}"))?);
        }
        for rows in [1, 3, 7, 40, 70] {
            let x = Tensor::from_vec(
                crate::kernels::test_values(rows * 2 * cols, 8),
                (rows, 2 * cols),
                &Device::Cpu,
            )?;
            // A strided view, and the same values contiguous.
            let strided = x.narrow(1, 0, cols)?;
            let contiguous = strided.contiguous()?;
            let alone: Vec<Tensor> = parts
                .iter()
                .map(|p| p.forward(&contiguous))
                .collect::<Result<_>>()?;
            let want: Vec<f32> = Tensor::cat(&alone, 1)?.flatten_all()?.to_vec1()?;
            for x in [&strided, &contiguous] {
                let Some(got) = QuantWeight::stacked_rows(&parts, x)? else {
                    // Without the packed micro-kernels (scalar code) a prompt's many rows go
                    // part by part instead.
                    assert!(
                        !crate::kernels::gemm::microkernel::available() && rows > few_rows(),
                        "{rows} rows: no CPU path"
                    );
                    continue;
                };
                let got: Vec<f32> = got.flatten_all()?.to_vec1()?;
                assert_eq!(got.len(), want.len());
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{rows} rows"
                );
            }
            if rows <= 7 {
                // The row kernels on several rows of `x`: each the same as alone.
                for i in 0..rows {
                    let one = QuantWeight::stacked_rows(&parts, &contiguous.narrow(0, i, 1)?)?
                        .ok_or(Error::Kernel("no CPU path".into()))?;
                    let one: Vec<f32> = one.flatten_all()?.to_vec1()?;
                    let n = one.len();
                    assert!(
                        one.iter()
                            .zip(&want[i * n..(i + 1) * n])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "row {i} of {rows}"
                    );
                }
            }
            let (gate, up) = (&parts[0], &parts[2]);
            let Some(gated) = QuantWeight::forward_gated(gate, up, &contiguous)? else {
                assert!(
                    !crate::kernels::gemm::microkernel::available() && rows > few_rows(),
                    "{rows} rows: no gated CPU path"
                );
                continue;
            };
            let (g, u) = (gate.forward(&contiguous)?, up.forward(&contiguous)?);
            let (g, u): (Vec<f32>, Vec<f32>) =
                (g.flatten_all()?.to_vec1()?, u.flatten_all()?.to_vec1()?);
            let gated: Vec<f32> = gated.flatten_all()?.to_vec1()?;
            for ((y, g), u) in gated.iter().zip(&g).zip(&u) {
                assert_eq!(
                    y.to_bits(),
                    (crate::kernels::activation::silu(*g) * u).to_bits(),
                    "{rows} rows"
                );
            }
        }
        Ok(())
    }

    /// `w` `(rows, cols)` quantized to `ty` by candle, as a weight named `name`.
    fn quantized_by_candle(w: &Tensor, ty: QuantType, name: &str) -> Result<QuantWeight> {
        let (rows, cols) = w.dims2()?;
        let q = QTensor::quantize(w, ty.candle_dtype())?;
        Ok(QuantWeight {
            blocks: Blocks::Owned(Arc::new(q.data()?.to_vec())),
            name: name.to_string(),
            ty,
            rows,
            cols,
            on_device: None,
        })
    }

    /// Every matrix of `tests/fixtures/gguf/types.gguf` stored in a block type (one of each,
    /// 2 rows of 512).
    fn block_type_weights() -> Result<Vec<QuantWeight>> {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/types.gguf");
        let file = GgufFile::open(path)?;
        let mut out = Vec::new();
        for info in file.tensors() {
            let (Ok(_), [cols, rows]) = (info.dtype, info.ggml_dims.as_slice()) else {
                continue;
            };
            out.extend(QuantWeight::from_gguf(&file, &info.name, *rows, *cols)?);
        }
        Ok(out)
    }

    /// What a CUDA or Metal device gets, checked on the CPU with candle's CPU backend: the
    /// blocks read as candle's `QTensor` dequantize to this crate's values bit for bit (same
    /// bytes, same `(rows, cols)`); the exact device product is this crate's within f32
    /// rounding, and candle's quantized one (8-bit activations, as llama.cpp) within a few
    /// hundredths of its magnitude.
    #[test]
    fn the_blocks_a_device_gets_are_the_same_weight() -> Result<()> {
        let mut checked = Vec::new();
        for q in block_type_weights()? {
            let (ty, rows, cols) = (q.ty, q.rows, q.cols);
            let mine: Vec<f32> = q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?;
            let theirs = q.candle_qtensor(&Device::Cpu)?;
            assert_eq!(theirs.shape().dims(), [rows, cols], "{}", q.name);
            let theirs: Vec<f32> = theirs.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?;
            assert!(
                mine.iter()
                    .zip(&theirs)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{}: candle's values differ",
                q.name
            );
            let x = Tensor::from_vec(
                crate::kernels::test_values(2 * cols, 7),
                (2, cols),
                &Device::Cpu,
            )?;
            let on = q.blocks_on(&Device::Cpu)?;
            let a = q.forward(&x)?;
            let scale = a.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-3);
            // Both routes a device takes (CUDA's exact one, candle's kernels), run here.
            let exact = QuantWeight::dequantized_product(&on, &x)?;
            let kernels = QuantWeight::kernels_product(&on, &x)?;
            for (route, b, tol) in [("exact", exact, 1e-5), ("kernels", kernels, 0.05)] {
                let diff = (&a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(
                    diff <= tol * scale,
                    "{} ({ty}, {route}): {diff} against {scale}",
                    q.name
                );
            }
            checked.push(ty);
        }
        assert!(checked.len() >= 5, "block types checked: {checked:?}");
        Ok(())
    }

    /// On CUDA (skipped without a device): one f32 row times every type of `types.gguf` by
    /// the exact device route equals this crate's CPU product within f32 rounding, through
    /// the one-row kernels wherever they take the type (every block type at 512 columns).
    #[cfg(feature = "cuda")]
    #[test]
    fn exact_rows_on_cuda_are_the_cpu_products() -> Result<()> {
        use crate::weights::cuda_gemv::ExactGemv;
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: skipped");
            return Ok(());
        };
        let mut kernels = Vec::new();
        for q in block_type_weights()? {
            let (ty, cols, name) = (q.ty, q.cols, q.name.clone());
            let x = Tensor::from_vec(
                crate::kernels::test_values(cols, 3),
                (1, cols),
                &Device::Cpu,
            )?;
            let want: Vec<f32> = q.forward(&x)?.flatten_all()?.to_vec1()?;
            let on = q.on(&dev)?;
            let got: Vec<f32> = on.forward(&x.to_device(&dev)?)?.flatten_all()?.to_vec1()?;
            let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5 * scale, "{name} ({ty}): {g} vs {w}");
            }
            if ExactGemv::kernel(ty, cols).is_some() {
                kernels.push(ty);
            }
        }
        assert_eq!(
            kernels.len(),
            10,
            "types through the one-row kernels: {kernels:?}"
        );
        // More rows than one launch block takes and a part block (37), and rows of 5 K-quant
        // blocks (the unrolled loop's body and its rest): weights quantized by candle.
        let (rows, cols) = (37, 1280);
        let w = Tensor::from_vec(
            crate::kernels::test_values(rows * cols, 11),
            (rows, cols),
            &Device::Cpu,
        )?;
        let x = Tensor::from_vec(
            crate::kernels::test_values(cols, 5),
            (1, cols),
            &Device::Cpu,
        )?;
        for ty in [
            QuantType::Q2K,
            QuantType::Q3K,
            QuantType::Q4K,
            QuantType::Q5K,
            QuantType::Q6K,
            QuantType::Q4_1,
        ] {
            let q = quantized_by_candle(&w, ty, &format!("{ty}"))?;
            let want: Vec<f32> = q.forward(&x)?.flatten_all()?.to_vec1()?;
            let got: Vec<f32> = q
                .on(&dev)?
                .forward(&x.to_device(&dev)?)?
                .flatten_all()?
                .to_vec1()?;
            let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            assert_eq!(got.len(), rows);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * scale,
                    "{ty} {rows} x {cols}: {g} vs {w}"
                );
            }
            assert!(ExactGemv::kernel(ty, cols).is_some(), "{ty}");
        }
        Ok(())
    }
}
