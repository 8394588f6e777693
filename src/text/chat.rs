//! Chat templates: the Jinja template a checkpoint ships (`tokenizer.chat_template` in a
//! GGUF file's metadata, `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`
//! beside a `tokenizer.json`), rendered as transformers' `apply_chat_template` renders it:
//! blocks trimmed (`trim_blocks`, `lstrip_blocks`), `break` / `continue`, Python's string
//! methods (`.strip()`, `.startswith()`, ...), `raise_exception`, `strftime_now`, a `tojson`
//! that writes as Python's `json.dumps` does, the special tokens (`bos_token`, `eos_token`,
//! `unk_token`, `pad_token`) as variables, and `{% generation %}` blocks rendered as their
//! body.

use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use crate::error::{Error, Result};

/// One message of a conversation: `role` (`system`, `user`, `assistant`, ...) and its text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's chat template and the special tokens it is rendered with.
///
/// ```
/// use candle_attention::{ChatMessage, ChatTemplate};
///
/// let template = ChatTemplate::new(
///     "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}\
///      {% if add_generation_prompt %}<|assistant|>{% endif %}",
/// )?
/// .with_special_token("bos_token", "<s>");
/// let prompt = template.render(&[ChatMessage::new("user", " Hi! ")], true)?;
/// assert_eq!(prompt, "<s><|user|>Hi!\n<|assistant|>");
/// # Ok::<(), candle_attention::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    source: String,
    /// `(variable, token)`: `bos_token`, `eos_token`, `unk_token`, `pad_token` where known.
    special: Vec<(String, String)>,
}

/// Instructions a rendering may run before it is stopped with an error.
const FUEL: u64 = 20_000_000;

/// The special tokens a template sees, by variable name.
pub(crate) const SPECIAL: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

impl ChatTemplate {
    /// The template `source` (Jinja); an error when it does not parse.
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let t = Self {
            source: source.into(),
            special: Vec::new(),
        };
        if t.source.len() > MAX_SOURCE {
            return Err(Error::ChatTemplate(format!(
                "the chat template is {} bytes, more than the {MAX_SOURCE} this crate reads",
                t.source.len()
            )));
        }
        let jinja = t.jinja();
        on_big_stack(|| {
            environment()
                .template_from_str(&jinja)
                .map(|_| ())
                .map_err(|e| template_error("does not parse", &e))
        })?;
        Ok(t)
    }

    /// The template with `token` as the variable `name` (`bos_token`, ...), replacing any
    /// token it had by that name.
    pub fn with_special_token(mut self, name: &str, token: impl Into<String>) -> Self {
        self.special.retain(|(n, _)| n != name);
        self.special.push((name.to_string(), token.into()));
        self
    }

    /// The template of a checkpoint directory `dir` (where its `tokenizer.json` is), as
    /// transformers finds it: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of named templates, of which `default`); the
    /// special tokens from `tokenizer_config.json`, else `special_tokens_map.json` (strings
    /// or `{"content": ...}`). `None` when there is no template.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = dir.as_ref();
        let read = |name: &str| -> Result<Option<String>> {
            let path = dir.join(name);
            match std::fs::read_to_string(&path) {
                Ok(text) => Ok(Some(text)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(cause) => Err(Error::Io { path, cause }),
            }
        };
        // A JSON file of `dir`, `Null` where there is none.
        let json = |name: &str| -> Result<serde_json::Value> {
            match read(name)? {
                Some(text) => serde_json::from_str(&text).map_err(|e| Error::Config {
                    path: Some(dir.join(name)),
                    message: format!("not JSON: {e}"),
                }),
                None => Ok(serde_json::Value::Null),
            }
        };
        let config_path = dir.join("tokenizer_config.json");
        let config = json("tokenizer_config.json")?;
        let bad = |message: String| Error::Config {
            path: Some(config_path.clone()),
            message,
        };
        let source = match (read("chat_template.jinja")?, &config["chat_template"]) {
            (Some(text), _) => text,
            (None, serde_json::Value::Null) => return Ok(None),
            (None, serde_json::Value::String(s)) => s.clone(),
            (None, serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .ok_or_else(|| {
                    bad("`chat_template` is a list of templates without a `default` one".into())
                })?
                .to_string(),
            (None, other) => {
                return Err(bad(format!(
                    "`chat_template` is {other}, not a string or a list of named templates"
                )))
            }
        };
        let mut t = Self::new(source)?;
        // The legacy `special_tokens_map.json` where the config names no such token.
        let map = json("special_tokens_map.json")?;
        let token_of = |v: &serde_json::Value| -> Option<String> {
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        for name in SPECIAL {
            if let Some(token) = token_of(&config[name]).or_else(|| token_of(&map[name])) {
                t = t.with_special_token(name, token);
            }
        }
        Ok(Some(t))
    }

    /// The template's Jinja source, as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special token the template sees as `name` (`bos_token`, ...), if any.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// The conversation `messages` as the model's prompt text, ending with the opening of
    /// the assistant's turn when `add_generation_prompt`. Tokenize it with no special
    /// tokens added (the template writes them), as `apply_chat_template` does. An error
    /// names what failed: a `raise_exception` of the template's (a conversation it does not
    /// take), or an expression it cannot evaluate.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let jinja = self.jinja();
        on_big_stack(|| self.render_on(&jinja, messages, add_generation_prompt))
    }

    /// The prompt of one user turn: `user`'s message after `system`'s (where given), the
    /// assistant's turn opened (`render` with `add_generation_prompt`).
    pub fn render_turn(&self, system: Option<&str>, user: &str) -> Result<String> {
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", user));
        self.render(&messages, true)
    }

    /// [`ChatTemplate::render`] of `jinja` (the source as minijinja reads it).
    fn render_on(
        &self,
        jinja: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = environment();
        let template = env
            .template_from_str(jinja)
            .map_err(|e| template_error("does not parse", &e))?;
        let mut vars: Vec<(String, Value)> = self
            .special
            .iter()
            .map(|(n, t)| (n.clone(), Value::from(t.as_str())))
            .collect();
        vars.push((
            "messages".into(),
            Value::from(minijinja::value::Serde(messages)),
        ));
        vars.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        // Passed as None by transformers (so `tools is not none` is false, not undefined's true).
        vars.push(("tools".into(), Value::from(())));
        vars.push(("documents".into(), Value::from(())));
        let context = Value::from_pairs(vars);
        template
            .render(context)
            .map_err(|e| template_error("does not render", &e))
    }

    /// The source with transformers' `{% generation %}` / `{% endgeneration %}` tags (marking
    /// the assistant's tokens) as `{% if true %}` / `{% endif %}`: the same text rendered.
    /// Comments, expressions, other tags (their quoted strings skipped) and `raw` blocks are
    /// passed over as they are.
    fn jinja(&self) -> String {
        let src = self.source.as_str();
        let mut out = String::with_capacity(src.len());
        let (mut copied, mut pos) = (0, 0);
        while let Some(rel) = src[pos..].find('{') {
            let at = pos + rel;
            let end = match src.as_bytes().get(at + 1) {
                Some(b'#') => src[at + 2..].find("#}").map(|e| at + 2 + e + 2),
                Some(b'{') => tag_end(src, at + 2, "}}"),
                Some(b'%') => tag_end(src, at + 2, "%}"),
                _ => Some(at + 1),
            };
            let Some(end) = end else {
                break;
            };
            pos = end;
            if src.as_bytes().get(at + 1) != Some(&b'%') {
                continue;
            }
            let (open, word, close) = tag_words(&src[at + 2..end - 2]);
            let replace = match word {
                "generation" => "if true",
                "endgeneration" => "endif",
                "raw" => {
                    // Up to the end of its `endraw` tag, untouched.
                    pos = endraw(src, end).unwrap_or(src.len());
                    continue;
                }
                _ => continue,
            };
            out.push_str(&src[copied..at]);
            out.push_str(&format!("{{%{open} {replace} {close}%}}"));
            copied = end;
        }
        out.push_str(&src[copied..]);
        out
    }
}

/// The index just past `closer` from `from` on in `src`, quoted strings (`'...'`, `"..."`,
/// backslash escapes) passed over; `None` when it does not close.
fn tag_end(src: &str, from: usize, closer: &str) -> Option<usize> {
    let bytes = src.as_bytes();
    let mut i = from;
    let mut quote: Option<u8> = None;
    while i < bytes.len() {
        match (quote, bytes[i]) {
            (Some(_), b'\\') => i += 1,
            (Some(q), c) if c == q => quote = None,
            (None, c @ (b'\'' | b'"')) => quote = Some(c),
            (None, _) if bytes[i..].starts_with(closer.as_bytes()) => {
                return Some(i + closer.len())
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// A tag's inside (between `{%` and `%}`) as `(opening whitespace control, its one word or
/// all its text, closing whitespace control)`.
fn tag_words(inner: &str) -> (&str, &str, &str) {
    let (open, body) = match inner.strip_prefix(['-', '+']) {
        Some(b) => (&inner[..1], b),
        None => ("", inner),
    };
    let (body, close) = match body.strip_suffix(['-', '+']) {
        Some(b) => (b, &body[body.len() - 1..]),
        None => (body, ""),
    };
    (open, body.trim(), close)
}

/// The index just past the `{% endraw %}` tag after `from`, if any.
fn endraw(src: &str, from: usize) -> Option<usize> {
    let mut pos = from;
    while let Some(rel) = src[pos..].find("{%") {
        let at = pos + rel;
        let end = tag_end(src, at + 2, "%}")?;
        if tag_words(&src[at + 2..end - 2]).1 == "endraw" {
            return Some(end);
        }
        pos = end;
    }
    None
}

/// Largest chat template read, in bytes (real ones are a few KB, the longest ~20 KB).
const MAX_SOURCE: usize = 256 * 1024;

/// Stack of the thread a template is parsed and rendered on: minijinja recurses once per
/// filter or subscript of a chain, which [`MAX_SOURCE`] bytes of template can make deep.
const STACK: usize = 64 << 20;

/// `f` on a thread of [`STACK`] bytes of stack.
fn on_big_stack<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|scope| {
        let worker = std::thread::Builder::new()
            .name("chat-template".into())
            .stack_size(STACK)
            .spawn_scoped(scope, f)
            .map_err(|e| Error::ChatTemplate(format!("cannot start the template's thread: {e}")))?;
        worker
            .join()
            .map_err(|_| Error::ChatTemplate("the template's thread failed".into()))?
    })
}

/// An [`Error::ChatTemplate`] for a minijinja error.
fn template_error(what: &str, e: &minijinja::Error) -> Error {
    let mut message = format!("the chat template {what}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::ChatTemplate(message)
}

/// The environment transformers renders chat templates in, as far as templates see it.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // Jinja2's whitespace control as transformers sets it (a template's one trailing
    // newline dropped, as Jinja2 does by default).
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // A template is a file's metadata: its work bounded (real ones take thousands of steps).
    env.set_fuel(Some(FUEL));
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function("strftime_now", |format: String| {
        strftime(&format, now_utc())
            .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("join", join);
    env
}

/// Widest `tojson` indent taken.
const MAX_INDENT: usize = 64;

/// Longest string `tojson` or `join` makes, in bytes: a template is a file's metadata, and
/// minijinja's fuel counts steps, not a joined string's size.
const MAX_OUTPUT: usize = 64 << 20;

/// Jinja2's `join(value, d='', attribute=None)`: the items (or each one's `attribute`) as
/// strings with `d` between them; an error past [`MAX_OUTPUT`] bytes.
fn join(
    value: Value,
    d: Option<String>,
    attribute: Option<String>,
    kwargs: Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let d = match d {
        Some(d) => d,
        None => kwargs.get::<Option<String>>("d")?.unwrap_or_default(),
    };
    let attribute = match attribute {
        Some(a) => Some(a),
        None => kwargs.get::<Option<String>>("attribute")?,
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    for (i, item) in value.try_iter()?.enumerate() {
        let item = match &attribute {
            Some(a) => item.get_attr(a)?,
            None => item,
        };
        if i > 0 {
            out.push_str(&d);
        }
        match item.as_str() {
            Some(s) => out.push_str(s),
            None => out.push_str(&item.to_string()),
        }
        if out.len() > MAX_OUTPUT {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("join: more than {MAX_OUTPUT} bytes"),
            ));
        }
    }
    Ok(out)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=None, sort_keys=False)` with those
/// keyword arguments, as transformers' `tojson` filter (its `separators=` is not taken).
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // `separators=` (Python's) is not taken: an error names it.
    kwargs.assert_all_used()?;
    let invalid = |m: String| minijinja::Error::new(ErrorKind::InvalidOperation, m);
    if let Some(n) = indent.filter(|&n| n > MAX_INDENT) {
        return Err(invalid(format!(
            "tojson: an indent of {n} (at most {MAX_INDENT} here)"
        )));
    }
    let bad = |e: serde_json::Error| invalid(e.to_string());
    // Keys in the template's order (minijinja keeps it), or sorted.
    let out = match sort_keys {
        Some(true) => {
            let mut json = serde_json::to_value(&value).map_err(bad)?;
            sort(&mut json);
            write_json(&json, indent)
        }
        _ => write_json(&value, indent),
    }
    .map_err(bad)?;
    if out.len() > MAX_OUTPUT {
        return Err(invalid(format!(
            "tojson: {} bytes (at most {MAX_OUTPUT} here)",
            out.len()
        )));
    }
    let text = String::from_utf8(out).map_err(|e| invalid(e.to_string()))?;
    Ok(if ensure_ascii == Some(true) {
        escape_non_ascii(&text)
    } else {
        text
    })
}

/// Every object's keys in order, nested ones too (`sort_keys=True`; whether serde_json's
/// map keeps insertion order depends on a feature another crate may turn on).
fn sort(json: &mut serde_json::Value) {
    match json {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = std::mem::take(map).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut v) in entries {
                sort(&mut v);
                map.insert(k, v);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort),
        _ => {}
    }
}

/// `value` as JSON: Python's separators, or `indent` spaces a level.
fn write_json<T: Serialize>(value: &T, indent: Option<usize>) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&pad);
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))?;
        }
        None => {
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out,
                PythonFormatter,
            ))?;
        }
    }
    Ok(out)
}

/// Characters past ASCII as `\uXXXX` (UTF-16 units, lower-case hex), as `ensure_ascii=True`;
/// in JSON text they only occur inside strings.
fn escape_non_ascii(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        // Python's `ensure_ascii` escapes DEL too (it keeps ' ' to '~' only).
        if c.is_ascii() && c != '\x7f' {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// `", "` before every item but the first.
fn comma<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

/// serde_json's compact form with Python's default separators: `", "` and `": "`.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        comma(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        comma(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Seconds since the Unix epoch, now.
fn now_utc() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// `seconds` (since the Unix epoch, UTC) written by the `strftime` `format`: `%Y %y %m %d
/// %e %j %H %M %S %a %A %b %B %p %%`; another directive is an error. Python's
/// `datetime.now()` is local time; this is UTC.
fn strftime(format: &str, seconds: i64) -> std::result::Result<String, String> {
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = seconds.div_euclid(86_400);
    let secs = seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let yday = before + day + i64::from(leap && month > 2);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            return Err("strftime_now: a format ending in `%`".into());
        };
        let month_name = MONTHS[month as usize - 1];
        match d {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'm' => out.push_str(&format!("{month:02}")),
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:2}")),
            'j' => out.push_str(&format!("{yday:03}")),
            'H' => out.push_str(&format!("{hour:02}")),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'b' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            '%' => out.push('%'),
            other => return Err(format!("strftime_now: `%{other}` is not supported")),
        }
    }
    Ok(out)
}

/// `(year, month, day)` of the day `days` after 1970-01-01 (proleptic Gregorian; Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_writes_python_s_directives() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %j %a %A %b %B %y %e %p %%", t).as_deref(),
            Ok("2024-02-29 13:05:09 060 Thu Thursday Feb February 24 29 PM %")
        );
        assert_eq!(strftime("%d %b %Y", 0).as_deref(), Ok("01 Jan 1970"));
        assert_eq!(strftime("%d %b %Y", -86_400).as_deref(), Ok("31 Dec 1969"));
        assert!(strftime("%Q", t).is_err());
        assert!(strftime("50%", t).is_err());
    }

    #[test]
    fn civil_dates_round_the_calendar() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(-719_468), (0, 3, 1));
    }

    #[test]
    fn generation_tags_become_plain_blocks() -> Result<()> {
        let t = ChatTemplate::new(
            "{% for m in messages %}{%- generation -%} [{{ m.content }}] {%- endgeneration %}|{% endfor %}",
        )?;
        assert_eq!(
            t.jinja(),
            "{% for m in messages %}{%- if true -%} [{{ m.content }}] {%- endif %}|{% endfor %}"
        );
        let m = [
            ChatMessage::new("user", "a"),
            ChatMessage::new("assistant", "b"),
        ];
        assert_eq!(t.render(&m, false)?, "[a]|[b]|");
        // Tags cut short or empty are left to the parser (found by the GGUF fuzz target).
        for source in [
            "{%}",
            "a {%} b %}",
            "x {% generation",
            "{%-%}",
            "{%--%}",
            "{%%}",
            // Quotes, escapes and multi-byte characters inside a tag, unclosed.
            "{% set Ң\\Ң 'Ң\\Ң' ",
            "{{ \"Ң\\",
        ] {
            let t = ChatTemplate {
                source: source.into(),
                special: Vec::new(),
            };
            assert_eq!(t.jinja(), source);
            assert!(ChatTemplate::new(source).is_err(), "{source:?}");
        }
        Ok(())
    }

    #[test]
    fn errors_name_the_template_s_problem() {
        let e = ChatTemplate::new("{% for m in messages %}").map(|_| ());
        assert!(
            matches!(e, Err(Error::ChatTemplate(ref m)) if m.contains("does not parse")),
            "{e:?}"
        );
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}");
        let e = t.and_then(|t| t.render(&[], true)).map(|_| ());
        assert!(
            matches!(e, Err(Error::ChatTemplate(ref m)) if m.contains("roles must alternate")),
            "{e:?}"
        );
    }

    #[test]
    fn a_template_s_work_is_bounded() -> Result<()> {
        let t = ChatTemplate::new(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        )?;
        let e = t.render(&[], true).map(|_| ());
        assert!(
            matches!(e, Err(Error::ChatTemplate(ref m)) if m.contains("fuel")),
            "{e:?}"
        );
        Ok(())
    }

    /// A template asks for sizes the renderer refuses: a huge indent, a huge joined string,
    /// a huge source; a long filter chain runs on the template's own deep stack.
    #[test]
    fn a_template_s_sizes_are_bounded() -> Result<()> {
        let refused = |source: &str, what: &str| {
            let e = ChatTemplate::new(source).and_then(|t| t.render(&[], true));
            assert!(
                matches!(e, Err(Error::ChatTemplate(ref m)) if m.contains(what)),
                "{source:.60}: {e:?}"
            );
        };
        refused("{{ [1] | tojson(indent=100000000000) }}", "indent");
        refused(
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) | join | length }}",
            "join",
        );
        refused(&"x".repeat(MAX_SOURCE + 1), "bytes");
        let chain = format!("{{{{ 'a'{} }}}}", "|trim".repeat(20_000));
        assert_eq!(ChatTemplate::new(chain)?.render(&[], true)?, "a");
        Ok(())
    }

    #[test]
    fn special_tokens_replace_by_name() -> Result<()> {
        let t = ChatTemplate::new("{{ bos_token }}|{{ eos_token }}")?
            .with_special_token("bos_token", "<s>")
            .with_special_token("eos_token", "</s>")
            .with_special_token("bos_token", "<|begin|>");
        assert_eq!(t.special_token("bos_token"), Some("<|begin|>"));
        assert_eq!(t.render(&[], false)?, "<|begin|>|</s>");
        Ok(())
    }
}
