//! `{"messages": ...}` SFT lines: rendered with the checkpoint's chat
//! template, assistant turns (and only they) are targets.

use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::init::{init_model, preset};
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_trainer::data::{read_sft_jsonl, ChatRender};

#[test]
fn assistant_turns_are_the_targets() {
    let dir = std::env::temp_dir().join(format!("arcticd-chat-data-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let rep = init_model(preset("tiny").unwrap(), &dir, 1).unwrap();
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let template = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    let chat = ChatRender {
        tokenizer: &tokenizer,
        template: &template,
    };
    let data = dir.join("chat.jsonl");
    let line = serde_json::json!({"messages": [
        {"role": "user", "content": "add two numbers"},
        {"role": "assistant", "content": "def add(a, b): return a + b"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "you are welcome"},
    ]});
    std::fs::write(&data, format!("{line}\n")).unwrap();
    let ex = read_sft_jsonl(&data, rep.vocab_size, Some(&chat)).unwrap();
    let ex = &ex[0];
    assert_eq!(ex.tokens.len(), ex.loss_mask.len());
    // Target runs, decoded.
    let mut runs: Vec<Vec<u32>> = Vec::new();
    for (i, (&t, &m)) in ex.tokens.iter().zip(&ex.loss_mask).enumerate() {
        if m == 1 {
            if i == 0 || ex.loss_mask[i - 1] == 0 {
                runs.push(Vec::new());
            }
            if let Some(r) = runs.last_mut() {
                r.push(t);
            }
        }
    }
    let texts: Vec<String> = runs
        .iter()
        .map(|r| tokenizer.decode(r, false).unwrap())
        .collect();
    println!("{texts:?}");
    assert_eq!(texts.len(), 2, "{texts:?}");
    assert!(texts[0].contains("def add(a, b): return a + b") && texts[0].contains("<|im_end|>"));
    assert!(texts[1].contains("you are welcome") && !texts[1].contains("thanks"));
    // The whole example is the rendered conversation.
    let all = template
        .render(line["messages"].as_array().unwrap(), None, false)
        .unwrap();
    assert_eq!(tokenizer.decode(&ex.tokens, false).unwrap(), all);
    let _ = std::fs::remove_dir_all(&dir);
}
