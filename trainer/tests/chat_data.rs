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
    let ex = read_sft_jsonl(&data, rep.vocab_size, Some(&chat), None).unwrap();
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
    // A line's tools are rendered with its messages (OpenAI's fine-tuning
    // format), and its targets stay the assistant turns.
    let tools = serde_json::json!([{"type": "function", "function": {"name": "add",
        "description": "adds", "parameters": {"type": "object", "properties": {}}}}]);
    let with_tools = serde_json::json!({"messages": line["messages"], "tools": tools});
    std::fs::write(&data, format!("{with_tools}\n")).unwrap();
    let ex_tools = &read_sft_jsonl(&data, rep.vocab_size, Some(&chat), None).unwrap()[0];
    let all_tools = template
        .render(
            line["messages"].as_array().unwrap(),
            Some(tools.as_array().unwrap()),
            false,
        )
        .unwrap();
    assert!(all_tools.contains("adds") && all_tools.len() > all.len());
    assert_eq!(
        tokenizer.decode(&ex_tools.tokens, false).unwrap(),
        all_tools
    );
    let targets =
        |e: &arcticd_trainer::step::SftExample| e.loss_mask.iter().filter(|m| **m == 1).count();
    assert_eq!(targets(ex_tools), targets(ex));
    // A tool call as OpenAI's wire form writes it (arguments a JSON
    // string) is read as `serve` reads it: the same tokens as the object.
    let call = |args: serde_json::Value| {
        serde_json::json!({"messages": [
            {"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "add", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c", "content": "3"},
            {"role": "assistant", "content": "3"}], "tools": tools})
    };
    let read = |line: serde_json::Value| {
        std::fs::write(&data, format!("{line}\n")).unwrap();
        read_sft_jsonl(&data, rep.vocab_size, Some(&chat), None)
    };
    let as_string = read(call(serde_json::json!("{\"a\": 1, \"b\": 2}"))).unwrap();
    let as_object = read(call(serde_json::json!({"a": 1, "b": 2}))).unwrap();
    assert_eq!(as_string[0].tokens, as_object[0].tokens);
    // Arguments that are no JSON object: the field is named.
    let e = read(call(serde_json::json!("{not json")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(":1: messages[1]: tool_calls[0].function.arguments is not JSON"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
