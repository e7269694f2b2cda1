//! SFT data: JSONL, one example per line, either
//! `{"tokens": [ids], "loss_mask": [0/1 per token]}` (`loss_mask[t] = 1`:
//! token t is a target predicted from the tokens before it; `loss_mask[0]` is
//! ignored) or `{"messages": [...]}` (and optionally `"tools": [...]`, as in
//! OpenAI's fine-tuning format) rendered with the checkpoint's chat
//! template, assistant turns as targets. Any other key is an error.
//!
//! Every bad line is an error naming the file and line: invalid JSON, ids out
//! of range, mismatched tokens/loss_mask lengths, no target tokens.

use crate::step::SftExample;
use crate::{Error, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::error::plain_types;
use arcticd_engine::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::Path;

/// Tokenizer and template for `messages` lines.
pub struct ChatRender<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: &'a ChatTemplate,
}

/// Read and check every line of an SFT JSONL file (blank lines are skipped;
/// a leading UTF-8 byte-order mark is not part of the first line). An
/// example longer than `max_positions` (the model's
/// `max_position_embeddings`) is refused, as `serve` refuses such a
/// prompt: its positions are ones the model was never trained for, and its
/// cost grows with the square of its length.
pub fn read_sft_jsonl(
    path: &Path,
    vocab: usize,
    chat: Option<&ChatRender<'_>>,
    max_positions: Option<usize>,
) -> Result<Vec<SftExample>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |msg: String| Error::Input(format!("{}:{}: {msg}", path.display(), i + 1));
        let ex = parse_line(line, vocab, chat).map_err(|e| match e {
            Error::Input(m) => at(m),
            other => at(other.to_string()),
        })?;
        if let Some(max) = max_positions.filter(|&m| ex.tokens.len() > m) {
            return Err(at(format!(
                "the example is {} tokens, past the {max} positions the model was trained \
                 for (max_position_embeddings in its config.json); shorten or split it",
                ex.tokens.len()
            )));
        }
        out.push(ex);
    }
    if out.is_empty() {
        return Err(Error::Input(format!("{}: no examples", path.display())));
    }
    Ok(out)
}

fn parse_line(line: &str, vocab: usize, chat: Option<&ChatRender<'_>>) -> Result<SftExample> {
    let v: Value =
        serde_json::from_str(line).map_err(|e| Error::Input(format!("invalid JSON: {e}")))?;
    let keys = v
        .as_object()
        .ok_or_else(|| Error::Input("a line is a JSON object".into()))?;
    // Every key is read: one the format does not have, or the two forms
    // mixed, is an error rather than data silently left out.
    const FORMS: &str =
        "a line holds \"messages\" (with \"tools\" if any), or \"tokens\" and \"loss_mask\"";
    if let Some(k) = keys
        .keys()
        .find(|k| !["messages", "tools", "tokens", "loss_mask"].contains(&k.as_str()))
    {
        return Err(Error::Input(format!("unknown key \"{k}\": {FORMS}")));
    }
    let chat_form = keys.contains_key("messages") || keys.contains_key("tools");
    if chat_form && (keys.contains_key("tokens") || keys.contains_key("loss_mask")) {
        return Err(Error::Input(format!("both forms on one line: {FORMS}")));
    }
    let ex = if chat_form {
        let msgs = v
            .get("messages")
            .ok_or_else(|| Error::Input("\"tools\" without \"messages\"".into()))?
            .as_array()
            .ok_or_else(|| Error::Input("\"messages\" is not a list".into()))?;
        let tools = match v.get("tools") {
            None => None,
            Some(t) => {
                let t = t
                    .as_array()
                    .ok_or_else(|| Error::Input("\"tools\" is not a list".into()))?;
                arcticd_engine::tool_call::check_tools(t)
                    .map_err(|e| Error::Input(format!("\"tools\": {e}")))?;
                Some(t.as_slice())
            }
        };
        let chat = chat.ok_or_else(|| {
            Error::Input(
                "a \"messages\" line needs a checkpoint with a tokenizer and chat template".into(),
            )
        })?;
        render_messages(msgs, tools, chat)?
    } else {
        let tokens: Vec<u32> = serde_json::from_value(
            v.get("tokens")
                .cloned()
                .ok_or_else(|| Error::Input("neither \"tokens\" nor \"messages\"".into()))?,
        )
        .map_err(|e| {
            Error::Input(format!(
                "\"tokens\" is a list of token ids from 0 ({})",
                plain_types(&e.to_string())
            ))
        })?;
        let loss_mask: Vec<u8> = serde_json::from_value(
            v.get("loss_mask")
                .cloned()
                .ok_or_else(|| Error::Input("\"tokens\" without \"loss_mask\"".into()))?,
        )
        .map_err(|e| {
            Error::Input(format!(
                "\"loss_mask\" is a list of 0s and 1s ({})",
                plain_types(&e.to_string())
            ))
        })?;
        if let Some(&m) = loss_mask.iter().find(|&&m| m > 1) {
            return Err(Error::Input(format!("loss_mask value {m} is not 0 or 1")));
        }
        SftExample { tokens, loss_mask }
    };
    if ex.tokens.len() != ex.loss_mask.len() {
        return Err(Error::Input(format!(
            "{} tokens but {} loss_mask values",
            ex.tokens.len(),
            ex.loss_mask.len()
        )));
    }
    if let Some((t, &id)) = ex
        .tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= vocab)
    {
        return Err(Error::Input(format!(
            "token id {id} at position {t} is not below the vocabulary size {vocab}"
        )));
    }
    // The first token is never a target: nothing comes before it.
    if ex.tokens.len() < 2 {
        return Err(Error::Input(format!(
            "an example needs at least 2 tokens (the first is never a target), got {}",
            ex.tokens.len()
        )));
    }
    if ex.loss_mask.iter().skip(1).all(|&m| m == 0) {
        return Err(Error::Input(if chat_form {
            "no assistant message: nothing to train on".into()
        } else {
            "no target tokens: loss_mask is 0 at every position after the first (the first \
             token is never a target)"
                .into()
        }));
    }
    Ok(ex)
}

/// Where an assistant turn's content starts and ends in Qwen's chat format
/// (docs/ARCHITECTURE.md, "The model": `<|im_start|>{role}\n{content}<|im_end|>\n`).
const ASSISTANT_OPEN: &str = "<|im_start|>assistant\n";
const TURN_END: &str = "<|im_end|>";

/// Render the whole conversation once, then mark every assistant turn, from
/// after `<|im_start|>assistant\n` through its `<|im_end|>`, as target (the
/// template may render earlier turns differently once later ones exist, e.g.
/// Qwen3.5 drops their empty think block, so turns are found in the final
/// text rather than rendered one by one). Pieces are tokenized separately at
/// the turn boundaries (special tokens), so targets are exactly those turns.
fn render_messages(
    msgs: &[Value],
    tools: Option<&[Value]>,
    chat: &ChatRender<'_>,
) -> Result<SftExample> {
    // As `serve` reads them: OpenAI's string arguments, `developer`.
    let msgs = arcticd_engine::chat::openai_messages(msgs).map_err(|e| match e {
        arcticd_engine::Error::Input(why) => Error::Input(why),
        other => other.into(),
    })?;
    let msgs = msgs.as_slice();
    let n_assistant = msgs
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .count();
    let all = chat.template.render(msgs, tools, false)?;
    let mut pieces: Vec<(&str, bool)> = Vec::new();
    let mut rest = all.as_str();
    let mut found = 0;
    while let Some(open) = rest.find(ASSISTANT_OPEN) {
        let body_start = open + ASSISTANT_OPEN.len();
        let end = rest[body_start..].find(TURN_END).ok_or_else(|| {
            Error::Input(format!("assistant turn {} has no {TURN_END}", found + 1))
        })?;
        let body_end = body_start + end + TURN_END.len();
        pieces.push((&rest[..body_start], false));
        pieces.push((&rest[body_start..body_end], true));
        rest = &rest[body_end..];
        found += 1;
    }
    pieces.push((rest, false));
    if found != n_assistant {
        return Err(Error::Input(format!(
            "{n_assistant} assistant messages but {found} assistant turns in the rendered text"
        )));
    }
    let mut ex = SftExample {
        tokens: Vec::new(),
        loss_mask: Vec::new(),
    };
    for (text, target) in pieces {
        let ids = chat.tokenizer.encode(text)?;
        ex.loss_mask
            .extend(std::iter::repeat_n(u8::from(target), ids.len()));
        ex.tokens.extend(ids);
    }
    Ok(ex)
}

/// Examples of step `k`: lines `k*B .. k*B+B-1` modulo the number of lines.
pub fn batch_for_step(data: &[SftExample], step: usize, batch_size: usize) -> Vec<SftExample> {
    (0..batch_size)
        .map(|i| data[(step * batch_size + i) % data.len()].clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(lines: &str) -> (std::path::PathBuf, tempdir::Guard) {
        let g = tempdir::Guard::new();
        let p = g.0.join("d.jsonl");
        std::fs::write(&p, lines).unwrap();
        (p, g)
    }

    mod tempdir {
        pub struct Guard(pub std::path::PathBuf);
        impl Guard {
            pub fn new() -> Self {
                let p = std::env::temp_dir().join(format!(
                    "arcticd-data-test-{}-{}",
                    std::process::id(),
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_nanos())
                        .unwrap_or(0)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Guard(p)
            }
        }
        impl Drop for Guard {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn reads_tokens_lines_and_names_bad_lines() {
        let (p, _g) = write("{\"tokens\":[1,2,3],\"loss_mask\":[0,1,1]}\n\n{\"tokens\":[4,5],\"loss_mask\":[1,1]}\n");
        let d = read_sft_jsonl(&p, 10, None, None).unwrap();
        assert_eq!(d.len(), 2);
        // Past the model's positions: refused, naming the line and both
        // lengths; at the limit: read.
        let e = read_sft_jsonl(&p, 10, None, Some(2))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(":1: the example is 3 tokens, past the 2 positions"),
            "{e}"
        );
        assert_eq!(read_sft_jsonl(&p, 10, None, Some(3)).unwrap().len(), 2);
        // A leading byte-order mark is not part of the first line.
        let (bom, _g2) = write("\u{feff}{\"tokens\":[1,2,3],\"loss_mask\":[0,1,1]}\n");
        assert_eq!(
            read_sft_jsonl(&bom, 10, None, None).unwrap()[0].tokens,
            vec![1, 2, 3]
        );
        assert_eq!(
            batch_for_step(&d, 1, 3)
                .iter()
                .map(|e| e.tokens[0])
                .collect::<Vec<_>>(),
            vec![4, 1, 4]
        );
        for (bad, want) in [
            (
                "{\"tokens\":[1,2,30],\"loss_mask\":[0,1,1]}",
                ":1: token id 30",
            ),
            (
                "{\"tokens\":[1,2],\"loss_mask\":[0,1,1]}",
                ":1: 2 tokens but 3",
            ),
            (
                "{\"tokens\":[1,2],\"loss_mask\":[1,0]}",
                ":1: no target tokens",
            ),
            (
                "{\"tokens\":[1],\"loss_mask\":[1]}",
                ":1: an example needs at least 2 tokens (the first is never a target), got 1",
            ),
            (
                "{\"tokens\":[1,2],\"loss_mask\":[true,true]}",
                ":1: \"loss_mask\" is a list of 0s and 1s (invalid type: boolean `true`, \
                 expected a whole number from 0 to 255",
            ),
            ("{\"tokens\":[1,2]", ":1: invalid JSON"),
            (
                "{\"tokens\":[1,2],\"loss_mask\":[0,1],\"weight\":5}",
                ":1: unknown key \"weight\"",
            ),
            (
                "{\"tokens\":[1,2],\"loss_mask\":[0,1],\"messages\":[]}",
                ":1: both forms on one line",
            ),
            ("[1,2]", ":1: a line is a JSON object"),
        ] {
            let (p, _g) = write(&format!(
                "{{\"tokens\":[1,2],\"loss_mask\":[0,1]}}\n{bad}\n"
            ));
            let e = read_sft_jsonl(&p, 10, None, None).unwrap_err().to_string();
            let want = want.replace(":1:", ":2:");
            assert!(e.contains(&want), "{e} lacks {want}");
        }
    }
}
