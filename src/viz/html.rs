//! The self-contained HTML view (head view, model view and explanation view, no network).
//! Long inputs carry their weights as bytes, so that a 512-token page stays ~25 MB.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::viz::dump::AttentionDump;
use crate::viz::explain::Explanation;

const TEMPLATE: &str = include_str!("attention_view.html");
const DATA_SLOT: &str = "/*__ATTENTION_DATA__*/null";
const META_SLOT: &str = "/*__ATTENTION_META__*/null";

/// Pages whose weights hold more values than this carry them as bytes (`round(w * 255)`,
/// base64) instead of JSON numbers: 6 layers x 12 heads at 512 tokens are 18.9 million
/// values, ~230 MB as numbers and ~25 MB as bytes.
const FULL_PRECISION_VALUES: usize = 1 << 20;

#[derive(Serialize)]
struct PageSentence<'a> {
    model: &'a str,
    text: &'a str,
    /// The labels a person reads ([`AttentionDump::display_tokens`]).
    tokens: Vec<String>,
    shape: [usize; 4],
    /// `[l][h][i][j]`, for pages small enough to carry numbers.
    #[serde(skip_serializing_if = "Option::is_none")]
    attentions: Option<&'a [Vec<Vec<Vec<f32>>>]>,
    /// Otherwise the weights row-major as bytes (`w = byte / 255`), base64.
    #[serde(skip_serializing_if = "Option::is_none")]
    attentions_u8: Option<String>,
    layer_ids: &'a [usize],
    head_ids: &'a [usize],
    #[serde(skip_serializing_if = "Option::is_none")]
    explain: Option<PageExplain<'a>>,
}

/// An explanation as the page shows it.
#[derive(Serialize)]
struct PageExplain<'a> {
    method: &'static str,
    title: String,
    /// Rollout's or grad's `(seq, seq)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    matrix: Option<&'a [Vec<f32>]>,
    /// Norms `[l][h][i][j]` as numbers (small pages)...
    #[serde(skip_serializing_if = "Option::is_none")]
    norms: Option<&'a [Vec<Vec<Vec<f32>>>]>,
    /// ... or as bytes (`v = byte / 255 * norms_max`), base64 ...
    #[serde(skip_serializing_if = "Option::is_none")]
    norms_u8: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    norms_max: Option<f32>,
    /// ... or, for a long input, `‖f_h(x_j)‖` `[l][h][j]`: the page multiplies the weights by
    /// them (a second `[l][h][i][j]` array would double the page).
    #[serde(skip_serializing_if = "Option::is_none")]
    value_norms: Option<&'a [Vec<Vec<f32>>]>,
}

const NORM_TITLE: &str = "value-weighted norms |a f(x)| (Kobayashi et al. 2020)";

/// `values` (each in `[0, max]`) as base64 bytes `round(v / max * 255)`.
fn quantized<'a>(values: impl Iterator<Item = &'a f32>, max: f32) -> String {
    use base64::Engine;
    let scale = if max > 0.0 { 255.0 / max } else { 0.0 };
    let bytes: Vec<u8> = values
        .map(|&v| (v * scale).round().clamp(0.0, 255.0) as u8)
        .collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `e` for the page; `large` pages carry numbers as bytes, and `weights_whole` says whether
/// the dump holds every layer and head (a norm explanation is then the weights' multiple).
fn page_explain(e: &Explanation, large: bool, weights_whole: bool) -> PageExplain<'_> {
    // Norms: the page names the layer and head it shows.
    let title = match e {
        Explanation::Norm { .. } => NORM_TITLE.to_string(),
        _ => e.title(None, None),
    };
    match e {
        Explanation::Rollout { matrix } | Explanation::Grad { matrix, .. } => PageExplain {
            method: e.method().name(),
            title,
            matrix: Some(matrix),
            norms: None,
            norms_u8: None,
            norms_max: None,
            value_norms: None,
        },
        Explanation::Norm { norms, value_norms } => {
            let all = || norms.iter().flatten().flatten().flatten();
            let max = all().fold(0f32, |m, &v| m.max(v));
            let factors = value_norms.as_deref().filter(|_| large && weights_whole);
            let bytes = large && factors.is_none();
            PageExplain {
                method: "norm",
                title,
                matrix: None,
                norms: (!large).then_some(norms.as_slice()),
                norms_u8: bytes.then(|| quantized(all(), max)),
                norms_max: bytes.then_some(max),
                value_norms: factors,
            }
        }
    }
}

#[derive(Serialize)]
struct PageMeta<'a> {
    title: &'a str,
    words: bool,
    /// Query heads per key/value head (grouped-K/V decoders); 1 otherwise.
    kv_group: usize,
}

/// One HTML page showing every dump (a sentence selector when there are several).
pub fn render_html(dumps: &[AttentionDump], title: &str, words: bool) -> Result<String> {
    render_html_grouped(dumps, title, words, 1)
}

/// [`render_html`] for a model whose query heads share key/value heads `kv_group` at a
/// time: each group's heads side by side, behind a label that selects the group.
pub fn render_html_grouped(
    dumps: &[AttentionDump],
    title: &str,
    words: bool,
    kv_group: usize,
) -> Result<String> {
    let data: Vec<PageSentence> = dumps
        .iter()
        .map(|d| {
            let large = d.shape.iter().product::<usize>() > FULL_PRECISION_VALUES;
            let bytes = || quantized(d.attentions.iter().flatten().flatten().flatten(), 1.0);
            PageSentence {
                model: &d.model,
                text: &d.text,
                tokens: d.display_tokens(),
                shape: d.shape,
                attentions: (!large).then_some(d.attentions.as_slice()),
                attentions_u8: large.then(bytes),
                layer_ids: &d.layer_ids,
                head_ids: &d.head_ids,
                explain: d.explain.as_ref().map(|e| {
                    let whole = d.layer_ids.iter().copied().eq(0..d.attentions.len())
                        && d.head_ids.iter().copied().eq(0..d.shape[1]);
                    page_explain(e, large, whole)
                }),
            }
        })
        .collect();
    let data = script_json(&data)?;
    let meta = script_json(&PageMeta {
        title,
        words,
        kv_group: kv_group.max(1),
    })?;
    Ok(TEMPLATE
        .replacen(DATA_SLOT, &data, 1)
        .replacen(META_SLOT, &meta, 1))
}

/// JSON safe to embed in a `<script>`: `<`, `>` and `&` become `\u003c`, `\u003e`,
/// `\u0026` (they can only occur inside JSON strings, where the escapes mean the same).
fn script_json<T: Serialize>(value: &T) -> Result<String> {
    let s = serde_json::to_string(value)
        .map_err(|e| Error::config(format!("cannot serialize the attention data: {e}")))?;
    Ok(s.replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_both_slots_and_escapes_script_tags() -> Result<()> {
        let dump = AttentionDump {
            model: "m".into(),
            text: "</script><b>".into(),
            tokens: vec!["</script>".into()],
            token_text: Vec::new(),
            shape: [1, 1, 1, 1],
            attentions: vec![vec![vec![vec![1.0]]]],
            layer_ids: vec![0],
            head_ids: vec![0],
            explain: None,
        };
        let page = render_html(std::slice::from_ref(&dump), "t", false)?;
        assert!(!page.contains(DATA_SLOT) && !page.contains(META_SLOT));
        assert!(page.contains("\"kv_group\":1"));
        let grouped = render_html_grouped(&[dump], "t", false, 3)?;
        assert!(grouped.contains("\"kv_group\":3"));
        assert!(!page.contains("</script><b>"));
        assert!(page.contains("\\u003c/script\\u003e"));
        Ok(())
    }

    /// The JSON of the page's data slot.
    fn data_of(page: &str) -> serde_json::Value {
        let start = page
            .find("const DATA = ")
            .map_or(0, |i| i + "const DATA = ".len());
        let end = start + page[start..].find(";\n").unwrap_or(0);
        serde_json::from_str(&page[start..end]).unwrap_or(serde_json::Value::Null)
    }

    /// Small pages carry numbers; long inputs carry bytes (`round(w * 255)`), and their norm
    /// explanation as each key's value norm (the page multiplies the weights by them).
    #[test]
    fn long_inputs_carry_bytes() -> Result<()> {
        use base64::Engine;
        let n = 300; // 1 x 12 x 300 x 300 > FULL_PRECISION_VALUES
        let row: Vec<f32> = (0..n)
            .map(|j| if j == 0 { 0.5 } else { 0.5 / (n - 1) as f32 })
            .collect();
        let head = vec![row; n];
        let attentions = vec![vec![head; 12]];
        let vn: Vec<Vec<Vec<f32>>> = vec![vec![(0..n).map(|j| 1.0 + j as f32).collect(); 12]];
        let norms = vec![vec![vec![vec![0.0f32; n]; n]; 12]];
        let dump = AttentionDump {
            model: "m".into(),
            text: "t".into(),
            tokens: (0..n).map(|i| format!("t{i}")).collect(),
            token_text: Vec::new(),
            shape: [1, 12, n, n],
            attentions,
            layer_ids: vec![0],
            head_ids: (0..12).collect(),
            explain: Some(Explanation::Norm {
                norms,
                value_norms: Some(vn),
            }),
        };
        let data = data_of(&render_html(std::slice::from_ref(&dump), "t", false)?);
        let sent = &data[0];
        assert!(sent.get("attentions").is_none());
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(sent["attentions_u8"].as_str().unwrap_or_default())
            .map_err(|e| Error::config(e.to_string()))?;
        assert_eq!(bytes.len(), 12 * n * n);
        assert_eq!((bytes[0], bytes[1]), (128, 0)); // 0.5 * 255 = 127.5 -> 128; 0.0017 -> 0
        let x = &sent["explain"];
        assert_eq!(x["method"], "norm");
        assert!(x.get("norms").is_none() && x.get("norms_u8").is_none());
        assert_eq!(x["value_norms"][0][11][2], 3.0);
        // A small page: numbers, as they are.
        let mut small = dump.clone();
        small.attentions = vec![vec![vec![vec![1.0]]]];
        small.shape = [1, 1, 1, 1];
        small.explain = None;
        let data = data_of(&render_html(&[small], "t", false)?);
        assert_eq!(data[0]["attentions"][0][0][0][0], 1.0);
        Ok(())
    }
}
