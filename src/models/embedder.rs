//! Sentence embeddings for a corpus: tokenize, batch by length, encode, pool over the real
//! tokens and normalise as the model's sentence-transformers pipeline does ([`Pooling`]:
//! all-MiniLM-L6-v2's mean and unit length by default), and return the rows in input order.

use candle_core::{Device, Tensor};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::models::batching::into_length_sorted_batches;
use crate::models::bert::{mean_pool_unit_rows, BertEncoder};
use crate::models::pooling::Pooling;
use crate::text::{EncodedBatch, EncodedText, TextEncoder};

/// Embeds sentences in length-sorted batches with a BERT-family encoder.
///
/// A sentence's embedding does not depend on the batch it lands in: padding is masked out
/// of every key and of the pooling.
///
/// ```no_run
/// # fn main() -> candle_attention::Result<()> {
/// use candle_attention::{Embedder, Model, ModelResolver};
/// use candle_core::{DType, Device};
///
/// let device = Device::Cpu;
/// let model = Model::load(ModelResolver::new().resolve(None)?, DType::F32, &device, false)?;
/// let rows = model.embedder(&device).embed(&["A man is eating food.", "The sky is blue."])?;
/// assert_eq!(rows.len(), 2); // input order, each of unit length
/// # Ok(()) }
/// ```
pub struct Embedder<'m> {
    encoder: &'m BertEncoder,
    text: &'m TextEncoder,
    device: Device,
    batch_size: usize,
    pooling: Pooling,
}

impl<'m> Embedder<'m> {
    /// Sentences per forward pass unless set otherwise (sentence-transformers' default).
    pub const DEFAULT_BATCH_SIZE: usize = 32;

    /// An embedder over `encoder` and its tokenizer, running on `device`, with mean pooling
    /// and unit length ([`Pooling::default`]; [`crate::Model::embedder`] uses the model's).
    pub fn new(encoder: &'m BertEncoder, text: &'m TextEncoder, device: &Device) -> Self {
        Self {
            encoder,
            text,
            device: device.clone(),
            batch_size: Self::DEFAULT_BATCH_SIZE,
            pooling: Pooling::default(),
        }
    }

    /// How token rows become a sentence's row.
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// The pooling in use.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Sentences per forward pass (at least 1).
    pub fn with_batch_size(mut self, batch_size: usize) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::config("the batch size must be at least 1"));
        }
        self.batch_size = batch_size;
        Ok(self)
    }

    /// Sentences per forward pass.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The embeddings of `texts` (unit length where the pooling normalizes), one row of
    /// `hidden` values per text, in input order.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        self.embed_with_progress(texts, |_| {})
    }

    /// [`Embedder::embed`], calling `done(n)` after each batch of `n` sentences.
    ///
    /// On the CPU, batches run side by side on rayon's threads (each batch's products are
    /// parallel too, and an idle thread takes work from either): no thread waits at the
    /// end of every small product for the other.
    pub fn embed_with_progress(
        &self,
        texts: &[&str],
        done: impl FnMut(usize) + Send,
    ) -> Result<Vec<Vec<f32>>> {
        // Tokenizing is serial work between the parallel products: spread it too.
        let items = texts
            .par_iter()
            .map(|t| self.text.encode(t))
            .collect::<Result<Vec<_>>>()?;
        let batches = into_length_sorted_batches(items, EncodedText::len, self.batch_size)?;
        let done = Mutex::new(done);
        let run = |(batch, members): (Vec<usize>, Vec<EncodedText>)| {
            let rows = self.embed_batch_rows(&self.text.pad(members, &self.device)?)?;
            if let Ok(mut done) = done.lock() {
                done(batch.len());
            }
            Ok((batch, rows))
        };
        let embedded: Vec<(Vec<usize>, Vec<Vec<f32>>)> = if self.device.is_cpu() {
            batches.into_par_iter().map(run).collect::<Result<_>>()?
        } else {
            batches.into_iter().map(run).collect::<Result<_>>()?
        };
        let mut rows = vec![Vec::new(); texts.len()];
        for (batch, embedded) in embedded {
            for (i, row) in batch.into_iter().zip(embedded) {
                rows[i] = row;
            }
        }
        Ok(rows)
    }

    /// [`Embedder::embed_batch`] as rows (pooled straight from the CPU's hidden states).
    fn embed_batch_rows(&self, batch: &EncodedBatch) -> Result<Vec<Vec<f32>>> {
        let hidden = self.hidden_states(batch)?;
        if self.pooling == Pooling::default() {
            if let Some(rows) = mean_pool_unit_rows(&hidden, &batch.attention_mask)? {
                return Ok(rows);
            }
        }
        Ok(self.pool(&hidden, batch)?.to_vec2()?)
    }

    /// Embeddings of one padded batch.
    ///
    /// # Shapes
    /// - returns `(batch, hidden)` f32 (rows of unit length where the pooling normalizes)
    pub fn embed_batch(&self, batch: &EncodedBatch) -> Result<Tensor> {
        self.pool(&self.hidden_states(batch)?, batch)
    }

    /// The encoder's last hidden states `(batch, seq, hidden)` for one padded batch.
    fn hidden_states(&self, batch: &EncodedBatch) -> Result<Tensor> {
        let out = self.encoder.forward(
            &batch.input_ids,
            Some(&batch.token_type_ids),
            Some(&batch.attention_mask),
            false,
        )?;
        Ok(out.hidden_states)
    }

    /// The pooling over the real tokens, in f32 `(batch, hidden)`.
    fn pool(&self, hidden: &Tensor, batch: &EncodedBatch) -> Result<Tensor> {
        self.pooling.pool(hidden, &batch.attention_mask)
    }
}
