//! Attention of one query row per head (a decode step) against keys and values read as
//! stored (f32, f16 or bf16): scores by the matrix-vector kernels, the softmax in f32
//! (base 2), the context as the weighted sum of the value rows. The tiled kernels compute on
//! contiguous f32 operands, which meant a copy of every layer's cache view on every step
//! (an f32 one for an f16 / bf16 cache; see docs/performance-archive.md).

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use crate::error::{Error, Result};
use crate::kernels::decode::gemv::{add_rows, dot_rows, Widen};
use crate::kernels::scratch::with_scratch;
use crate::kernels::simd::{exp2_shifted_sum, row_max};

/// Where the heads of K or V lie in their storage: head `(b, g)` holds `rows` rows of
/// `width` values from `offset + b * sb + g * sh`, one after another.
#[derive(Debug, Clone, Copy)]
struct Place {
    offset: usize,
    sb: usize,
    sh: usize,
    rows: usize,
    width: usize,
}

impl Place {
    fn of<T>(self, data: &[T]) -> Rows<'_, T> {
        Rows { data, place: self }
    }
}

/// K or V: a storage and where its heads lie.
#[derive(Debug, Clone, Copy)]
struct Rows<'a, T> {
    data: &'a [T],
    place: Place,
}

impl<'a, T> Rows<'a, T> {
    fn head(&self, b: usize, g: usize) -> Result<&'a [T]> {
        let p = &self.place;
        let start = p.offset + b * p.sb + g * p.sh;
        self.data
            .get(start..start + p.rows * p.width)
            .ok_or_else(|| Error::Kernel(format!("head ({b}, {g}) runs past its storage")))
    }
}

/// The context `(batch, heads, 1, d_v)` in `v`'s dtype of one query row per head, with no
/// mask, when K and V are f32, f16 or bf16 CPU tensors whose rows lie one after another in each
/// head (a [`crate::KvCache`]'s views do); `None` otherwise (the caller runs the tiled
/// kernels). Shapes were checked by the caller.
///
/// # Shapes
/// - `q`: `(batch, heads, 1, d_k)`, `k`: `(batch, kv_heads, seq_k, d_k)`, `v`: `(batch,
///   kv_heads, seq_k, d_v)`
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Option<Tensor>> {
    let (b, h, sq, _) = q.dims4()?;
    let (_, _, _, dv) = v.dims4()?;
    if sq != 1 {
        return Ok(None);
    }
    let qs: Vec<f32> = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?; // (b, h, dk)
    let Some(ctx) = attention_rows(&qs, h, k, v, scale)? else {
        return Ok(None);
    };
    let out = Tensor::from_vec(ctx, (b, h, 1, dv), &Device::Cpu)?.to_dtype(v.dtype())?;
    Ok(Some(out))
}

/// [`attention`] for the query rows `qs` `(batch, heads, d_k)` as f32 values: the context
/// `(batch, heads, d_v)` as f32 values, `None` where [`attention`] gives `None`. K and V
/// are checked against `qs` here (a decode step's path calls this without tensors).
pub(crate) fn attention_rows(
    qs: &[f32],
    h: usize,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
) -> Result<Option<Vec<f32>>> {
    attention_rows_in(qs, h, k, v, scale, None)
}

/// [`attention_rows`] with the keys of each head in about `runs` runs (else
/// [`runs_for`]'s).
fn attention_rows_in(
    qs: &[f32],
    h: usize,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    runs: Option<usize>,
) -> Result<Option<Vec<f32>>> {
    let (b, kvh, sk, dk) = k.dims4()?;
    let (bv, kvh_v, sk_v, dv) = v.dims4()?;
    let stored = matches!(k.dtype(), DType::F16 | DType::BF16 | DType::F32);
    let fits = (bv, kvh_v, sk_v) == (b, kvh, sk)
        && kvh > 0
        && h.is_multiple_of(kvh)
        && h > 0
        && dk > 0
        && dv > 0
        && qs.len() == b * h * dk;
    if !fits || sk == 0 || !stored || v.dtype() != k.dtype() || !k.device().is_cpu() {
        return Ok(None);
    }
    let mut ctx = vec![0f32; b * h * dv];
    {
        let (kg, kl) = k.storage_and_layout();
        let (vg, vl) = v.storage_and_layout();
        let rows = |l: &candle_core::Layout, width: usize| {
            let s = l.stride();
            (s[3] == 1 && s[2] == width).then(|| (l.start_offset(), s[0], s[1]))
        };
        let (Some((ko, ksb, ksh)), Some((vo, vsb, vsh))) = (rows(kl, dk), rows(vl, dv)) else {
            return Ok(None);
        };
        let sizes = (h, kvh, sk, dk, dv);
        let runs = runs.unwrap_or_else(|| runs_for(sk));
        let at = |(offset, sb, sh), width| Place {
            offset,
            sb,
            sh,
            rows: sk,
            width,
        };
        let (kp, vp) = (at((ko, ksb, ksh), dk), at((vo, vsb, vsh), dv));
        match (&*kg, &*vg) {
            (Storage::Cpu(CpuStorage::BF16(kd)), Storage::Cpu(CpuStorage::BF16(vd))) => {
                run(qs, kp.of(kd), vp.of(vd), sizes, (scale, runs), &mut ctx)?
            }
            (Storage::Cpu(CpuStorage::F16(kd)), Storage::Cpu(CpuStorage::F16(vd))) => {
                run(qs, kp.of(kd), vp.of(vd), sizes, (scale, runs), &mut ctx)?
            }
            (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) => {
                run(qs, kp.of(kd), vp.of(vd), sizes, (scale, runs), &mut ctx)?
            }
            _ => return Ok(None),
        }
    }
    Ok(Some(ctx))
}

/// Keys a run takes at least.
const MIN_KEYS: usize = 16;

/// Keys a run takes at most beyond the first two runs.
const RUN_KEYS: usize = 512;

/// Runs of keys per key/value head for `sk` keys: one below `2 * MIN_KEYS`, else two (two
/// tasks a thread for SmolLM2's 3 key/value heads on 2 threads), more past `2 * RUN_KEYS`.
/// A function of `sk` alone, so that the sums, whose rounding the runs decide, are the same
/// bits on any number of threads.
fn runs_for(sk: usize) -> usize {
    if sk < 2 * MIN_KEYS {
        1
    } else {
        sk.div_ceil(RUN_KEYS).max(2)
    }
}

/// Tasks of (batch, key/value head, run of keys; about `runs` runs a head): each reads its
/// keys and values once for all the query heads of its group (`s = scale log2(e) K q`, `p =
/// 2^(s - max s)`, `o = p V`, kept with `max s` and `sum p`); a head's runs are merged after
/// (weights `2^(m_c - m)`), the context `o / sum p`. One run is the one-pass softmax as it
/// was per head; reading the keys once for the group's queries saved ~1% of a SmolLM2 decode
/// step at 240 tokens, 3% at 800 (see docs/performance-archive.md).
fn run<T: Widen>(
    q: &[f32],
    k: Rows<'_, T>,
    v: Rows<'_, T>,
    (h, kvh, sk, dk, dv): (usize, usize, usize, usize, usize),
    (scale, runs): (f64, usize),
    ctx: &mut [f32],
) -> Result<()> {
    let b = q.len() / (h * dk).max(1);
    let group = h / kvh.max(1);
    let log2_scale = (scale * std::f64::consts::LOG2_E) as f32;
    let heads = b * kvh;
    let run_len = sk.div_ceil(runs.clamp(1, sk.max(1)));
    let runs = sk.div_ceil(run_len.max(1));
    // Per task, per query head of the group: `dv` values of `o`, then `max s` and `sum p`.
    let part = dv + 2;
    let mut parts = vec![0f32; heads * runs * group * part];
    let work = |(t, out): (usize, &mut [f32])| -> Result<()> {
        let (head, c) = (t / runs, t % runs);
        let (bi, g) = (head / kvh, head % kvh);
        let (kh, vh) = (k.head(bi, g)?, v.head(bi, g)?);
        let first = c * run_len;
        let n = run_len.min(sk - first);
        let (kr, vr) = (
            &kh[first * dk..(first + n) * dk],
            &vh[first * dv..(first + n) * dv],
        );
        with_scratch(n + dk, |buf| {
            let (s, qr) = buf.split_at_mut(n);
            for (j, o) in out.chunks_mut(part).enumerate() {
                let i = bi * h + g * group + j;
                for (d, x) in qr.iter_mut().zip(&q[i * dk..(i + 1) * dk]) {
                    *d = x * log2_scale;
                }
                dot_rows(kr, qr, s); // (n,) base-2 scores
                let m = row_max(s);
                let sum = exp2_shifted_sum(s, m);
                let (o, stats) = o.split_at_mut(dv);
                o.fill(0.0);
                add_rows(vr, s, o);
                stats[0] = m;
                stats[1] = sum;
            }
            Ok(())
        })
    };
    // Small calls on this thread: a hand-over to the pool costs more than they do.
    if b * h * sk * (dk + dv) < 1 << 15 {
        parts
            .chunks_mut(group * part)
            .enumerate()
            .try_for_each(work)?;
    } else {
        crate::kernels::decode::keep_warm::for_each_chunk(&mut parts, group * part, |c, o| {
            work((c, o))
        })?;
    }
    // Each query head's runs merged: `o = sum_c 2^(m_c - m) o_c`, `l` likewise.
    for (i, out) in ctx.chunks_mut(dv).enumerate() {
        let (bi, hi) = (i / h, i % h);
        let (g, j) = (hi / group.max(1), hi % group.max(1));
        let at = |c: usize| ((bi * kvh + g) * runs + c) * group * part + j * part;
        let m = (0..runs)
            .map(|c| parts[at(c) + dv])
            .fold(f32::NEG_INFINITY, f32::max);
        out.fill(0.0);
        let mut l = 0f32;
        for c in 0..runs {
            let p = &parts[at(c)..at(c) + part];
            let w = (p[dv] - m).exp2();
            l += w * p[dv + 1];
            for (o, x) in out.iter_mut().zip(&p[..dv]) {
                *o += w * x;
            }
        }
        let inv = 1.0 / l;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equals the tiled kernels on the same values in f32 (grouped heads, a batch of two,
    /// the keys a narrowed view of a larger cache as a sliding window reads them).
    #[test]
    fn equals_the_tiled_kernels() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, kvh, cap, sk, dk, dv) = (2, 6, 2, 40, 29, 16, 24);
        let vals = |n: usize, m: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 37 % m) as f32 - (m / 2) as f32) / 8.0)
                .collect()
        };
        let q = Tensor::from_vec(vals(b * h * dk, 13), (b, h, 1, dk), &dev)?;
        let kc = Tensor::from_vec(vals(b * kvh * cap * dk, 17), (b, kvh, cap, dk), &dev)?;
        let vc = Tensor::from_vec(vals(b * kvh * cap * dv, 11), (b, kvh, cap, dv), &dev)?;
        let (k, v) = (kc.narrow(2, 5, sk)?, vc.narrow(2, 5, sk)?);
        let scale = 0.3;
        let (want, _) = crate::kernels::attend::on_tensors::attention(
            &q,
            &k,
            &v,
            &crate::kernels::attend::mask_plan::MaskPlan::default(),
            scale,
            crate::kernels::attend::WeightsMode::Skip,
        )?;
        let want: Vec<f32> = want.flatten_all()?.to_vec1()?;
        for dt in [DType::BF16, DType::F16] {
            let (qh, kh, vh) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
            // `to_dtype` made the views contiguous; narrow a converted cache instead.
            let (kch, vch) = (kc.to_dtype(dt)?, vc.to_dtype(dt)?);
            let (kh2, vh2) = (kch.narrow(2, 5, sk)?, vch.narrow(2, 5, sk)?);
            for (kk, vv) in [(&kh, &vh), (&kh2, &vh2)] {
                let got = attention(&qh, kk, vv, scale)?
                    .ok_or_else(|| Error::Kernel("not taken".into()))?;
                assert_eq!(got.dims(), &[b, h, 1, dv]);
                let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                for (g, w) in got.iter().zip(&want) {
                    // The values are exact in both formats; the context is rounded once.
                    assert!(
                        (g - w).abs() <= 8e-3 * (1.0 + w.abs()),
                        "{dt:?}: {g} vs {w}"
                    );
                }
            }
        }
        // f32 operands (the narrowed cache views), exactly but for the order of the sums.
        let got = attention(&q, &k, &v, scale)?.ok_or_else(|| Error::Kernel("not taken".into()))?;
        let got: Vec<f32> = got.flatten_all()?.to_vec1()?;
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "f32: {g} vs {w}");
        }
        // The keys of each head in runs merged after: the same values within f32 rounding,
        // for any number of runs (up to one key each, and more runs than keys).
        let qs: Vec<f32> = q.flatten_all()?.to_vec1()?;
        for runs in [1, 2, 3, 7, 29, 40] {
            let got = attention_rows_in(&qs, h, &k, &v, scale, Some(runs))?
                .ok_or_else(|| Error::Kernel("not taken".into()))?;
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{runs} runs: {g} vs {w}"
                );
            }
        }
        // The same bits on any number of threads: the runs depend on the keys alone.
        for sk in [5, 40, 700, 1500] {
            let k = Tensor::from_vec(vals(b * kvh * sk * dk, 17), (b, kvh, sk, dk), &dev)?;
            let v = Tensor::from_vec(vals(b * kvh * sk * dv, 11), (b, kvh, sk, dv), &dev)?;
            let on = |threads: usize| -> Result<Option<Vec<f32>>> {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .map_err(|e| Error::Kernel(e.to_string()))?;
                pool.install(|| attention_rows(&qs, h, &k, &v, scale))
            };
            let one = on(1)?.ok_or_else(|| Error::Kernel("not taken".into()))?;
            for threads in [2, 3, 8] {
                assert_eq!(
                    on(threads)?,
                    Some(one.clone()),
                    "{sk} keys, {threads} threads"
                );
            }
        }
        // Several query rows, or a strided key layout, go to the tiled kernels.
        let q2 = Tensor::cat(&[&q, &q], 2)?;
        assert!(attention(&q2, &k, &v, scale)?.is_none());
        let kt = kc
            .to_dtype(DType::BF16)?
            .transpose(2, 3)?
            .contiguous()?
            .transpose(2, 3)?;
        let qb = q.to_dtype(DType::BF16)?;
        let vb = vc.to_dtype(DType::BF16)?;
        assert!(attention(&qb, &kt, &vb, scale)?.is_none());
        Ok(())
    }
}
