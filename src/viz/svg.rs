//! A heatmap as a standalone SVG picture (for papers): the tokens on both axes, one cell per
//! (query, key), and a colour scale with its values.

use std::fmt::Write;

/// Left and top margins grow with the longest label; cells are square.
const CELL_MAX: f32 = 22.0;
const CELL_MIN: f32 = 4.0;
/// The picture's plot area fits this many pixels at most.
const PLOT: f32 = 720.0;
const FONT: &str = "DejaVu Sans, Helvetica, Arial, sans-serif";

/// White to dark blue, as the terminal heatmap (`t` in `[0, 1]`, square-root scale).
fn color(t: f32) -> String {
    let t = t.clamp(0.0, 1.0).sqrt();
    let lerp = |a: f32, b: f32| (a + (b - a) * t).round() as u8;
    format!(
        "#{:02x}{:02x}{:02x}",
        lerp(247.0, 8.0),
        lerp(251.0, 48.0),
        lerp(255.0, 107.0)
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `matrix[i][j]` (query `i`, key `j`) as an SVG document: `title` above, the tokens along
/// the left (queries) and the top (keys, rotated), cells coloured from 0 to the largest
/// value (square-root scale, so that small weights stay visible), and a colour scale whose
/// ticks give the values.
pub fn render_svg(tokens: &[String], matrix: &[Vec<f32>], title: &str) -> String {
    let n = matrix.len().max(1);
    let cell = (PLOT / n as f32).clamp(CELL_MIN, CELL_MAX);
    let font = (cell * 0.62).clamp(3.0, 12.0);
    let longest = tokens.iter().map(|t| t.chars().count()).max().unwrap_or(1) as f32;
    let label = (longest * font * 0.62 + 8.0).min(160.0);
    let (left, top) = (label + 4.0, label + 34.0);
    let plot = cell * n as f32;
    let scale_x = left + plot + 24.0;
    // Wide enough for the colour scale and the (bold, 13 px) title.
    let width = (left + plot + 110.0).max(title.chars().count() as f32 * 7.6 + 12.0);
    let height = top + plot + 16.0;
    let max = matrix
        .iter()
        .flatten()
        .fold(0f32, |m, &v| m.max(v))
        .max(f32::MIN_POSITIVE);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.1} {height:.1}" font-family="{FONT}">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="4" y="16" font-size="13" font-weight="bold">{}</text>"#,
        escape(title)
    );
    for (i, t) in tokens.iter().enumerate().take(n) {
        let y = top + (i as f32 + 0.5) * cell;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{y:.1}" font-size="{font:.1}" text-anchor="end" dominant-baseline="central">{}</text>"#,
            left - 4.0,
            escape(t)
        );
        let x = left + (i as f32 + 0.5) * cell;
        let _ = writeln!(
            out,
            r#"<text transform="translate({x:.1},{:.1}) rotate(-90)" font-size="{font:.1}" dominant-baseline="central">{}</text>"#,
            top - 4.0,
            escape(t)
        );
    }
    for (i, row) in matrix.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            let _ = writeln!(
                out,
                r#"<rect x="{:.2}" y="{:.2}" width="{cell:.2}" height="{cell:.2}" fill="{}"><title>{} &#8594; {}: {v}</title></rect>"#,
                left + j as f32 * cell,
                top + i as f32 * cell,
                color(v / max),
                escape(tokens.get(i).map_or("", String::as_str)),
                escape(tokens.get(j).map_or("", String::as_str)),
            );
        }
    }
    let _ = writeln!(
        out,
        r##"<rect x="{left:.1}" y="{top:.1}" width="{plot:.1}" height="{plot:.1}" fill="none" stroke="#57606a" stroke-width="0.8"/>"##
    );
    // The colour scale: 64 bands from the largest value (top) to 0, 5 ticks.
    let bands = 64;
    for b in 0..bands {
        let t = 1.0 - b as f32 / bands as f32;
        let _ = writeln!(
            out,
            r#"<rect x="{scale_x:.1}" y="{:.2}" width="14" height="{:.2}" fill="{}"/>"#,
            top + plot * b as f32 / bands as f32,
            plot / bands as f32 + 0.3,
            color(t)
        );
    }
    for k in 0..=4 {
        let t = 1.0 - k as f32 / 4.0;
        let y = top + plot * k as f32 / 4.0;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{y:.1}" font-size="10" dominant-baseline="central">{}</text>"#,
            scale_x + 18.0,
            tick(t * max)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// A tick value in 4 significant digits.
fn tick(v: f32) -> String {
    if v == 0.0 {
        "0".to_string()
    } else if (1e-3..1e4).contains(&v.abs()) {
        let digits = (3 - v.abs().log10().floor() as i32).max(0) as usize;
        format!("{v:.digits$}")
    } else {
        format!("{v:.3e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One cell per entry, each token on both axes (escaped), a colour scale whose top
    /// tick is the largest value; a well-formed document.
    #[test]
    fn cells_labels_and_scale() {
        let tokens: Vec<String> = ["[CLS]", "a<b", "[SEP]"]
            .iter()
            .map(|t| t.to_string())
            .collect();
        let m = vec![
            vec![0.5, 0.25, 0.25],
            vec![0.0, 1.0, 0.0],
            vec![0.1, 0.2, 0.7],
        ];
        let svg = render_svg(&tokens, &m, "layer 0, head 1");
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<title>").count(), 9);
        assert_eq!(svg.matches(">a&lt;b</text>").count(), 2);
        assert!(svg.contains(">1.000</text>") && svg.contains(">0</text>"));
        assert!(svg.contains(">layer 0, head 1</text>"));
        assert!(!svg.contains("a<b"));
    }

    #[test]
    fn ticks_keep_four_significant_digits() {
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(1.0), "1.000");
        assert_eq!(tick(0.01234), "0.01234");
        assert_eq!(tick(123.4), "123.4");
        assert_eq!(tick(2.5e-5), "2.500e-5");
    }
}
