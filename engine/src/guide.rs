//! Guided decoding of a short choice: a sequence's generated text must
//! begin with one of a few given strings ([`SamplingParams::prefix_choices`]
//! (crate::sampler::SamplingParams::prefix_choices)), or, with
//! [`exact_choice`](crate::sampler::SamplingParams::exact_choice), be one
//! of them and end there. The server uses the first for `tool_choice:
//! "required"` (the prompt opens a call, and the model may write only the
//! name of a declared tool), the second for vLLM's `guided_choice`.
//!
//! The check is on text, not on one tokenization of each choice: a token
//! is allowed when the text generated so far followed by its bytes is
//! still a prefix of some choice, or (for a prefix) already runs past one
//! whole choice. So the model may reach a choice by any of its
//! tokenizations (`=get` as one token, or `=` then `get`), and for a
//! prefix a token that completes a choice and goes on (`>\n`) is allowed
//! too. Once the text holds a whole choice the guide is done: sampling is
//! free again, or, for an exact choice, the sequence stops there.

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// The bytes each token id of a tokenizer decodes to, packed in one
/// buffer ([`Tokenizer::token_table`] builds it once and shares it; ids
/// past it, which a model's padded vocabulary may have, are empty).
#[derive(Debug)]
pub struct TokenBytes {
    bytes: Vec<u8>,
    /// Token `i`'s bytes are `bytes[ends[i - 1]..ends[i]]` (from 0 for
    /// the first).
    ends: Vec<u32>,
}

impl TokenBytes {
    /// The table of the tokenizer's ids.
    pub fn new(tokenizer: &Tokenizer) -> Self {
        Self::from_tokens((0..tokenizer.vocab_size()).map(|id| tokenizer.token_bytes(id as u32)))
    }

    /// The table of these tokens' bytes, id by id.
    pub fn from_tokens<B: AsRef<[u8]>>(tokens: impl IntoIterator<Item = B>) -> Self {
        let mut bytes = Vec::new();
        let mut ends = Vec::new();
        for t in tokens {
            bytes.extend_from_slice(t.as_ref());
            ends.push(bytes.len() as u32);
        }
        TokenBytes { bytes, ends }
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Token `id`'s bytes (empty for an id past the table).
    pub fn get(&self, id: usize) -> &[u8] {
        match self.ends.get(id) {
            Some(&end) => {
                let start = if id == 0 { 0 } else { self.ends[id - 1] };
                &self.bytes[start as usize..end as usize]
            }
            None => &[],
        }
    }
}

/// One sequence's progress through its choices.
#[derive(Debug, Clone, PartialEq)]
pub struct Guide {
    choices: Vec<Vec<u8>>,
    /// The text is one whole choice and nothing after it.
    exact: bool,
    /// What the sequence generated while the guide was on.
    text: Vec<u8>,
    done: bool,
}

impl Guide {
    /// A guide over `choices` the text must begin with; `None` when there
    /// are none (free sampling).
    pub fn new(choices: &[String]) -> Option<Self> {
        Self::with(choices, false)
    }

    /// A guide over `choices` the text must be one of (`exact`) or begin
    /// with.
    pub fn with(choices: &[String], exact: bool) -> Option<Self> {
        (!choices.is_empty()).then(|| Guide {
            choices: choices.iter().map(|c| c.as_bytes().to_vec()).collect(),
            exact,
            text: Vec::new(),
            done: false,
        })
    }

    /// Whether the text has become one whole choice of an exact guide,
    /// so the sequence ends.
    pub fn finished(&self) -> bool {
        self.exact && self.done
    }

    /// Whether the next token is still restricted.
    pub fn active(&self) -> bool {
        !self.done
    }

    /// Whether a token of these bytes may come next (once the guide is
    /// done, any). A token of no bytes
    /// (an id the tokenizer lacks) never may: it would not move the text.
    pub fn allows(&self, token: &[u8]) -> bool {
        self.done || Self::continues(&self.rests(), token, self.exact)
    }

    /// What each choice the text is still a prefix of has left to write.
    fn rests(&self) -> Vec<&[u8]> {
        let n = self.text.len();
        self.choices
            .iter()
            .filter(|c| c.len() > n && c[..n] == self.text[..])
            .map(|c| &c[n..])
            .collect()
    }

    /// Whether `token` writes on towards one of `rests` (or, unless
    /// `exact`, completes one and goes on).
    fn continues(rests: &[&[u8]], token: &[u8], exact: bool) -> bool {
        !token.is_empty()
            && rests
                .iter()
                .any(|r| r.starts_with(token) || (!exact && token.starts_with(r)))
    }

    /// Record the token sampled next (one [`allows`](Self::allows)
    /// permitted).
    pub fn advance(&mut self, token: &[u8]) {
        if self.done {
            return;
        }
        self.text.extend_from_slice(token);
        let text = &self.text;
        self.done = self.choices.iter().any(|c| text.starts_with(c));
    }

    /// Which of `table`'s tokens may come next, as a mask over the
    /// vocabulary; an error when none may (the choices cannot be written
    /// with this vocabulary).
    pub fn mask(&self, table: &TokenBytes, allowed: &mut Vec<bool>) -> Result<()> {
        allowed.clear();
        if self.done {
            allowed.resize(table.len(), true);
            return Ok(());
        }
        let rests = self.rests();
        allowed
            .extend((0..table.len()).map(|id| Self::continues(&rests, table.get(id), self.exact)));
        if allowed.iter().any(|&a| a) {
            Ok(())
        } else {
            Err(Error::Input(format!(
                "no token of the vocabulary continues {:?} towards any of the {} choices",
                String::from_utf8_lossy(&self.text),
                self.choices.len()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guide(choices: &[&str]) -> Guide {
        Guide::new(&choices.iter().map(|c| c.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn no_choices_is_no_guide() {
        assert_eq!(Guide::new(&[]), None);
    }

    #[test]
    fn any_tokenization_of_a_choice_is_allowed_and_nothing_else() {
        let mut g = guide(&["=get_weather>", "=get_time>"]);
        for ok in ["=", "=get", "=get_weather>", "=get_time>\n"] {
            assert!(g.allows(ok.as_bytes()), "{ok:?}");
        }
        for bad in ["", "get", "=set", "=get_date>", " =get"] {
            assert!(!g.allows(bad.as_bytes()), "{bad:?}");
        }
        g.advance(b"=get_");
        assert!(g.active());
        assert!(g.allows(b"weather"));
        assert!(g.allows(b"t"));
        assert!(!g.allows(b"date"));
        g.advance(b"time");
        assert!(g.active(), "the closing '>' is still to come");
        assert!(g.allows(b">\n"), "a token may complete a choice and go on");
        assert!(!g.allows(b"s>"));
        g.advance(b">\n");
        assert!(!g.active());
        assert!(g.allows(b"anything"));
    }

    #[test]
    fn a_choice_that_prefixes_another_ends_the_guide_when_written() {
        let mut g = guide(&["ab", "abc"]);
        g.advance(b"ab");
        assert!(!g.active());
    }

    #[test]
    fn the_mask_covers_the_vocabulary_and_refuses_an_impossible_choice() {
        let tok = Tokenizer::from_inner(crate::tokenizer::train_bpe(300).unwrap());
        let vocab = tok.vocab_size();
        let table = TokenBytes::new(&tok);
        assert_eq!(table.len(), vocab);
        assert!(table.get(vocab + 4).is_empty(), "ids past the tokenizer");
        let g = guide(&["=read_file>"]);
        let mut allowed = Vec::new();
        g.mask(&table, &mut allowed).unwrap();
        assert_eq!(allowed.len(), vocab);
        for (id, &a) in allowed.iter().enumerate() {
            assert_eq!(a, g.allows(table.get(id)), "id {id}");
        }
        let eq = tok.encode("=").unwrap();
        assert!(eq.iter().all(|&t| allowed[t as usize]));
        assert!(allowed.iter().filter(|&&a| a).count() < vocab / 2);
    }

    #[test]
    fn a_choice_no_token_can_write_is_an_error() {
        let table = TokenBytes::from_tokens([&b"a"[..], b"b", b""]);
        assert_eq!(table.get(1), b"b");
        assert_eq!(table.get(7), b"");
        let mut allowed = Vec::new();
        guide(&["ab"]).mask(&table, &mut allowed).unwrap();
        assert_eq!(allowed, [true, false, false]);
        let err = guide(&["ca"]).mask(&table, &mut allowed).unwrap_err();
        assert!(err.to_string().contains("no token"), "{err}");
    }

    #[test]
    fn an_exact_choice_admits_no_token_past_it_and_finishes_there() {
        let choices = ["yes".to_string(), "no".to_string()];
        let mut g = Guide::with(&choices, true).unwrap();
        assert!(g.allows(b"y") && g.allows(b"no"));
        assert!(!g.allows(b"no."), "nothing may follow a choice");
        g.advance(b"ye");
        assert!(g.allows(b"s") && !g.allows(b"s!") && !g.finished());
        g.advance(b"s");
        assert!(g.finished());
        let prefix = Guide::new(&choices).unwrap();
        assert!(prefix.allows(b"no.") && !prefix.finished());
    }
}
