//! [`AttentionDump`]: one sentence's attention weights, every layer and head.

use candle_core::{IndexOp, Tensor};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::text::{display_label, EncodedText};
use crate::viz::explain::Explanation;
use crate::viz::words::{aggregate, word_groups};

/// Which layers and heads to keep (`None` = all).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DumpSelection {
    /// Only this layer.
    pub layer: Option<usize>,
    /// Only this head.
    pub head: Option<usize>,
}

/// One sentence's attention: `attentions[l][h][i][j]` is the weight query token `i` gives
/// key token `j` in layer `layer_ids[l]`, head `head_ids[h]`.
///
/// Serializes (for `--format json`) to exactly
/// `{"model", "text", "tokens", "token_text", "shape", "attentions"}`, plus `"explain"` (see
/// [`Explanation`]) when an explanation is attached.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionDump {
    /// The model's name.
    pub model: String,
    /// The sentence.
    pub text: String,
    /// Its tokens (or words, after [`AttentionDump::into_words`]).
    pub tokens: Vec<String>,
    /// Each token's (or word's) text as the tokenizer decodes it: concatenated, the decoded
    /// text ([`EncodedText::token_text`]).
    pub token_text: Vec<String>,
    /// `[layers, heads, seq, seq]`
    pub shape: [usize; 4],
    /// `[layer][head][query][key]` weights; each query row sums to 1.
    pub attentions: Vec<Vec<Vec<Vec<f32>>>>,
    /// Real layer number of each entry of `attentions`.
    #[serde(skip)]
    pub layer_ids: Vec<usize>,
    /// Real head number of each entry of `attentions[l]`.
    #[serde(skip)]
    pub head_ids: Vec<usize>,
    /// An explanation of the sentence (`--explain`), when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<Explanation>,
}

impl AttentionDump {
    /// Extracts sentence `index` of a batch (its real tokens only) from the per-layer
    /// attentions.
    ///
    /// # Shapes
    /// - `attentions`: one `(batch, heads, seq, seq)` tensor per layer; `item` has at most
    ///   `seq` tokens
    pub fn from_batch(
        model: &str,
        item: &EncodedText,
        index: usize,
        attentions: &[Tensor],
        select: DumpSelection,
    ) -> Result<Self> {
        let n = item.len();
        let layers = attentions.len();
        let heads = match attentions.first() {
            Some(a) => a.dims4()?.1,
            None => return Err(Error::input("attentions", "at least one layer", "none")),
        };
        let layer_ids: Vec<usize> = match select.layer {
            Some(l) if l >= layers => {
                return Err(Error::input(
                    "--layer",
                    format!("a layer in 0..{layers}"),
                    l.to_string(),
                ))
            }
            Some(l) => vec![l],
            None => (0..layers).collect(),
        };
        let head_ids: Vec<usize> = match select.head {
            Some(h) if h >= heads => {
                return Err(Error::input(
                    "--head",
                    format!("a head in 0..{heads}"),
                    h.to_string(),
                ))
            }
            Some(h) => vec![h],
            None => (0..heads).collect(),
        };
        let mut out = Vec::with_capacity(layer_ids.len());
        for &l in &layer_ids {
            let a = attentions[l].i(index)?.narrow(1, 0, n)?.narrow(2, 0, n)?; // (heads, n, n)
            let a = a.to_dtype(candle_core::DType::F32)?;
            let mut per_head = Vec::with_capacity(head_ids.len());
            for &h in &head_ids {
                per_head.push(a.i(h)?.to_vec2::<f32>()?);
            }
            out.push(per_head);
        }
        Ok(Self {
            model: model.to_string(),
            text: item.text.clone(),
            tokens: item.tokens.clone(),
            token_text: item.token_text.clone(),
            shape: [layer_ids.len(), head_ids.len(), n, n],
            attentions: out,
            layer_ids,
            head_ids,
            explain: None,
        })
    }

    /// Aggregates word pieces into words: a word's weight as a key is the sum over its
    /// pieces, as a query the mean over its pieces (rows still sum to 1).
    pub fn into_words(self, item: &EncodedText) -> Self {
        let groups = word_groups(item);
        let attentions = self
            .attentions
            .iter()
            .map(|heads| heads.iter().map(|m| aggregate(m, &groups)).collect())
            .collect();
        let tokens: Vec<String> = groups.iter().map(|g| g.label.clone()).collect();
        let token_text = groups
            .iter()
            .map(|g| {
                self.token_text
                    .get(g.tokens.clone())
                    .unwrap_or_default()
                    .concat()
            })
            .collect();
        let n = tokens.len();
        Self {
            tokens,
            token_text,
            shape: [self.shape[0], self.shape[1], n, n],
            attentions,
            explain: self.explain.map(|e| e.into_words(item)),
            ..self
        }
    }

    /// The labels a person reads: each token's decoded text (a leading space kept, line
    /// breaks written as `\n`), or its vocabulary string where the text is empty
    /// ([`crate::viz::display_label`]).
    pub fn display_tokens(&self) -> Vec<String> {
        self.tokens
            .iter()
            .enumerate()
            .map(|(i, t)| display_label(self.token_text.get(i).map_or("", String::as_str), t))
            .collect()
    }

    /// `(layer position, head position)` of the head to show a person: among the heads
    /// that relate words to other words (at least half of the words' weight on words two
    /// or more positions away, not on the token itself, its neighbours or special tokens;
    /// the most such heads when none reaches half), the one whose rows are most focused
    /// (lowest mean row entropy over the non-special tokens, rows renormalised after
    /// dropping special-token keys). Identity, previous/next-token and `[CLS]`/`[SEP]`
    /// parking heads are so left out.
    pub fn sharpest_head(&self, special: &[bool]) -> (usize, usize) {
        self.sharpest_among(special, None)
    }

    /// Like [`AttentionDump::sharpest_head`], restricted to head position `head` when given
    /// (the layer where that head is picked).
    pub fn sharpest_among(&self, special: &[bool], head: Option<usize>) -> (usize, usize) {
        let heads: Vec<(usize, usize, f32, f32)> = self
            .attentions
            .iter()
            .enumerate()
            .flat_map(|(l, heads)| heads.iter().enumerate().map(move |(h, m)| (l, h, m)))
            .filter(|(_, h, _)| head.is_none_or(|only| only == *h))
            .map(|(l, h, m)| (l, h, relational_share(m, special), mean_entropy(m, special)))
            .collect();
        let most = heads.iter().map(|x| x.2).fold(0f32, f32::max);
        let needed = most.min(RELATIONAL_SHARE);
        heads
            .iter()
            .filter(|x| x.2 >= needed)
            .min_by(|a, b| a.3.total_cmp(&b.3))
            .map_or((0, head.unwrap_or(0)), |x| (x.0, x.1))
    }
}

/// Share of the words' weight on other words that a head needs to count as relating words.
const RELATIONAL_SHARE: f32 = 0.5;

/// Mean over the non-special rows of the weight on non-special keys at least two
/// positions away.
fn relational_share(m: &[Vec<f32>], special: &[bool]) -> f32 {
    let keep = |i: usize| !special.get(i).copied().unwrap_or(false);
    let rows: Vec<f32> = m
        .iter()
        .enumerate()
        .filter(|(i, _)| keep(*i))
        .map(|(i, row)| {
            row.iter()
                .enumerate()
                .filter(|(j, _)| keep(*j) && i.abs_diff(*j) > 1)
                .map(|(_, w)| w)
                .sum::<f32>()
        })
        .collect();
    if rows.is_empty() {
        0.0
    } else {
        rows.iter().sum::<f32>() / rows.len() as f32
    }
}

fn mean_entropy(m: &[Vec<f32>], special: &[bool]) -> f32 {
    let keep = |i: usize| !special.get(i).copied().unwrap_or(false);
    let mut total = 0f32;
    let mut rows = 0usize;
    for (i, row) in m.iter().enumerate().filter(|(i, _)| keep(*i)) {
        let mass: f32 = row
            .iter()
            .enumerate()
            .filter(|(j, _)| keep(*j))
            .map(|(_, w)| w)
            .sum();
        if mass <= 0.0 {
            continue;
        }
        let _ = i;
        let h: f32 = row
            .iter()
            .enumerate()
            .filter(|(j, _)| keep(*j))
            .map(|(_, &w)| w / mass)
            .filter(|&p| p > 0.0)
            .map(|p| -p * p.ln())
            .sum();
        total += h;
        rows += 1;
    }
    if rows == 0 {
        f32::INFINITY
    } else {
        total / rows as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item() -> EncodedText {
        EncodedText {
            text: "playing ball".into(),
            ids: vec![101, 1, 2, 3, 102],
            tokens: vec![
                "[CLS]".into(),
                "play".into(),
                "##ing".into(),
                "ball".into(),
                "[SEP]".into(),
            ],
            token_text: ["[CLS]", " play", "ing", " ball", " [SEP]"]
                .map(String::from)
                .to_vec(),
            type_ids: vec![0; 5],
            offsets: vec![(0, 0), (0, 4), (4, 7), (8, 12), (0, 0)],
            word_ids: vec![None, Some(0), Some(0), Some(1), None],
            special: vec![true, false, false, false, true],
        }
    }

    #[test]
    fn words_sum_keys_and_average_queries() {
        let n = 5;
        let m: Vec<Vec<f32>> = (0..n)
            .map(|i| (0..n).map(|j| if i == j { 0.6 } else { 0.1 }).collect())
            .collect();
        let dump = AttentionDump {
            model: "m".into(),
            text: "playing ball".into(),
            tokens: item().tokens,
            token_text: item().token_text,
            shape: [1, 1, n, n],
            attentions: vec![vec![m]],
            layer_ids: vec![0],
            head_ids: vec![0],
            explain: None,
        };
        let w = dump.into_words(&item());
        assert_eq!(w.tokens, vec!["[CLS]", "playing", "ball", "[SEP]"]);
        // A word's text is its pieces' texts joined; they still concatenate to the whole.
        assert_eq!(w.token_text, vec!["[CLS]", " playing", " ball", " [SEP]"]);
        assert_eq!(w.token_text.concat(), item().token_text.concat());
        assert_eq!(
            w.display_tokens(),
            vec!["[CLS]", " playing", " ball", " [SEP]"]
        );
        assert_eq!(w.shape, [1, 1, 4, 4]);
        let a = &w.attentions[0][0];
        // "playing" as a key = sum of its two pieces; as a query = mean of two rows.
        assert!((a[0][1] - 0.2).abs() < 1e-6);
        assert!((a[1][1] - 0.7).abs() < 1e-6);
        for row in a {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
    }

    /// One head per kind on 8 tokens (`[CLS]`, six words, `[SEP]`): the relational head is
    /// picked over sharper identity, previous-token and `[SEP]`-parking heads.
    #[test]
    fn the_head_shown_relates_words_to_other_words() {
        let n = 8;
        let special: Vec<bool> = (0..n).map(|i| i == 0 || i == n - 1).collect();
        let head = |f: &dyn Fn(usize) -> usize| -> Vec<Vec<f32>> {
            (0..n)
                .map(|i| {
                    let mut row = vec![0.02f32; n];
                    row[f(i)] += 1.0 - 0.02 * n as f32;
                    row
                })
                .collect()
        };
        let identity = head(&|i| i);
        let previous = head(&|i| i.saturating_sub(1));
        let parking = head(&|_| n - 1);
        // Each word looks at the word three places away (a broader, less sharp pattern).
        let relational: Vec<Vec<f32>> = (0..n)
            .map(|i| {
                let mut row = vec![0.05f32; n];
                row[(i + 3) % n] += 0.6;
                let s: f32 = row.iter().sum();
                row.iter().map(|w| w / s).collect()
            })
            .collect();
        let dump = AttentionDump {
            model: "m".into(),
            text: "t".into(),
            tokens: (0..n).map(|i| format!("t{i}")).collect(),
            token_text: Vec::new(),
            shape: [2, 2, n, n],
            attentions: vec![vec![identity.clone(), previous], vec![parking, relational]],
            layer_ids: vec![0, 1],
            head_ids: vec![0, 1],
            explain: None,
        };
        assert_eq!(dump.sharpest_head(&special), (1, 1));
        // Restricted to head 0 (identity or parking), the most relational of those.
        assert_eq!(dump.sharpest_among(&special, Some(0)).1, 0);
        // Without a relational head, the identity head is still shown, not nothing.
        let only = AttentionDump {
            attentions: vec![vec![identity]],
            shape: [1, 1, n, n],
            layer_ids: vec![0],
            head_ids: vec![0],
            ..dump
        };
        assert_eq!(only.sharpest_head(&special), (0, 0));
    }
}
