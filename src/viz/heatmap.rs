//! A terminal heatmap of one attention matrix: rows = query tokens, columns = key tokens.

use std::fmt::Write;

/// How to draw cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeatmapStyle {
    /// 24-bit background colors with the weight (x100) printed in each cell.
    Color,
    /// No escape codes: shade characters (for pipes, files and `NO_COLOR`).
    Plain,
}

const LABEL_MAX: usize = 14;
const HEADER_MAX: usize = 10;

fn clip(s: &str, max: usize) -> String {
    let chars: Vec<char> = s.chars().collect();
    if chars.len() <= max {
        s.to_string()
    } else {
        chars[..max - 1].iter().collect::<String>() + "…"
    }
}

/// White to dark blue.
fn color(w: f32) -> (u8, u8, u8) {
    let t = w.clamp(0.0, 1.0).sqrt();
    let lerp = |a: f32, b: f32| (a + (b - a) * t).round() as u8;
    (lerp(247.0, 8.0), lerp(251.0, 48.0), lerp(255.0, 107.0))
}

/// Renders `matrix[i][j]` (query `i`, key `j`) with the tokens on both axes.
pub fn render_heatmap(tokens: &[String], matrix: &[Vec<f32>], style: HeatmapStyle) -> String {
    let labels: Vec<String> = tokens.iter().map(|t| clip(t, LABEL_MAX)).collect();
    let width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let heads: Vec<Vec<char>> = tokens
        .iter()
        .map(|t| clip(t, HEADER_MAX).chars().collect())
        .collect();
    let header_rows = heads.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = String::new();
    // Column labels, written top to bottom.
    for r in 0..header_rows {
        let _ = write!(out, "{:width$}  ", "");
        for h in &heads {
            let _ = write!(out, " {} ", h.get(r).copied().unwrap_or(' '));
        }
        out.push('\n');
    }
    for (i, row) in matrix.iter().enumerate() {
        let label = labels.get(i).map(String::as_str).unwrap_or("");
        let pad = width.saturating_sub(label.chars().count());
        let _ = write!(out, "{}{label}  ", " ".repeat(pad));
        for &w in row {
            match style {
                HeatmapStyle::Color => {
                    let (r, g, b) = color(w);
                    let fg = if w > 0.35 { "255;255;255" } else { "40;40;40" };
                    let pct = (w * 100.0).round();
                    let text = if pct < 1.0 {
                        "   ".to_string()
                    } else if pct >= 100.0 {
                        "100".to_string()
                    } else {
                        format!("{pct:>3.0}")
                    };
                    let _ = write!(out, "\x1b[48;2;{r};{g};{b}m\x1b[38;2;{fg}m{text}\x1b[0m");
                }
                HeatmapStyle::Plain => {
                    let shades = [' ', '·', '░', '▒', '▓', '█'];
                    let idx = ((w.clamp(0.0, 1.0).sqrt() * 5.0).round() as usize).min(5);
                    let c = shades[idx];
                    let _ = write!(out, "{c}{c}{c}");
                }
            }
        }
        out.push('\n');
    }
    out
}

/// The most tokens a heatmap is drawn for (3 characters a column: 48 columns fill ~160);
/// longer inputs are listed as each query's top keys ([`render_top_keys`]).
pub const HEATMAP_MAX_TOKENS: usize = 48;

/// Each query's `k` largest keys, one line per query: `i:token  j:key 41, j:key 12, ...`
/// (values x 100), readable at any length where a heatmap of hundreds of columns is not.
pub fn render_top_keys(tokens: &[String], matrix: &[Vec<f32>], k: usize) -> String {
    let label = |i: usize| {
        format!(
            "{i}:{}",
            clip(tokens.get(i).map_or("", String::as_str), LABEL_MAX)
        )
    };
    let width = (0..matrix.len())
        .map(|i| label(i).chars().count())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (i, row) in matrix.iter().enumerate() {
        let mut keys: Vec<(usize, f32)> = row.iter().copied().enumerate().collect();
        keys.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top: Vec<String> = keys
            .iter()
            .take(k)
            .map(|&(j, w)| format!("{} {:.0}", label(j), w * 100.0))
            .collect();
        let _ = writeln!(out, "{:>width$}  {}", label(i), top.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_keys_list_each_query_s_largest_keys_in_order() {
        let tokens: Vec<String> = ["a", "b", "c"].iter().map(|t| t.to_string()).collect();
        let m = vec![
            vec![0.1, 0.7, 0.2],
            vec![0.5, 0.25, 0.25],
            vec![0.0, 0.0, 1.0],
        ];
        let s = render_top_keys(&tokens, &m, 2);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0], "0:a  1:b 70, 2:c 20");
        assert!(lines[2].ends_with("2:c 100, 0:a 0"));
    }

    #[test]
    fn plain_heatmap_has_a_row_per_query_and_a_cell_per_key() {
        let tokens = vec!["[CLS]".to_string(), "hi".to_string(), "[SEP]".to_string()];
        let m = vec![
            vec![1.0, 0.0, 0.0],
            vec![0.5, 0.5, 0.0],
            vec![0.0, 0.0, 1.0],
        ];
        let s = render_heatmap(&tokens, &m, HeatmapStyle::Plain);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 5 + 3); // 5 header rows ("[CLS]") + 3 query rows
        assert!(lines[5].starts_with("[CLS]  ███"));
        assert!(lines[7].ends_with("███"));
        assert!(!s.contains('\x1b'));
    }

    #[test]
    fn color_heatmap_prints_percentages() {
        let tokens = vec!["a".to_string(), "b".to_string()];
        let m = vec![vec![0.25, 0.75], vec![1.0, 0.0]];
        let s = render_heatmap(&tokens, &m, HeatmapStyle::Color);
        assert!(s.contains(" 25") && s.contains(" 75") && s.contains("100"));
    }
}
