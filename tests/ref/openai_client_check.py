"""Drive a running `arcticd serve` with the official `openai` Python client.

Usage: python openai_client_check.py --base-url http://127.0.0.1:PORT/v1 --model NAME

Checks: model listing and retrieval; plain chat; streaming (the streamed
text equals the non-streamed greedy text, and the usage chunk it asks
for); a forced tool call that comes back as OpenAI `tool_calls` with JSON
arguments, and its round trip (the call and a tool
result sent back); log-probs with top alternatives; text completions with
token ids; 32 concurrent requests each answered exactly as when sent alone;
an empty message list rejected with a 400. Prints a JSON summary; exits
non-zero on the first failure. Needs only `pip install openai`.
"""

import argparse
import concurrent.futures
import json
import sys

import openai


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
    m = args.model
    summary = {}

    ids = [x.id for x in client.models.list().data]
    assert m in ids, ids

    user = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=m, messages=user, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert r.usage.prompt_tokens > 0
    summary["chat"] = c.message.content

    extra = {"ignore_eos": True}
    plain = client.chat.completions.create(
        model=m, messages=user, max_tokens=12, temperature=0, extra_body=extra
    )
    parts, finish, roles = [], None, []
    for chunk in client.chat.completions.create(
        model=m, messages=user, max_tokens=12, temperature=0, stream=True, extra_body=extra
    ):
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            if ch.delta.content:
                parts.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    assert roles == ["assistant"], roles
    assert finish == "length", finish
    assert "".join(parts) == plain.choices[0].message.content, (parts, plain.choices[0].message.content)
    summary["stream_chunks"] = len(parts)

    # stream_options.include_usage: the client gets the usage from the last
    # chunk, which has no choices; one model by name.
    usage = None
    for chunk in client.chat.completions.create(
        model=m, messages=user, max_tokens=12, temperature=0, stream=True, extra_body=extra,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            assert chunk.choices == [], chunk
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 12, usage
    assert usage.total_tokens == usage.prompt_tokens + 12, usage
    summary["stream_usage"] = usage.total_tokens
    assert client.models.retrieve(m).id == m

    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=m, messages=ask, tools=tools, max_tokens=16, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    c = r.choices[0]
    # A call cut off by max_tokens is "length", as OpenAI reports it (the
    # test's random model does not close its call in 16 tokens).
    want = "length" if r.usage.completion_tokens == 16 else "tool_calls"
    assert c.finish_reason == want, (c.finish_reason, r.usage)
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather", call
    assert isinstance(json.loads(call.function.arguments), dict)
    follow = ask + [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})},
    ]
    r2 = client.chat.completions.create(model=m, messages=follow, tools=tools, max_tokens=8)
    assert r2.choices[0].message.role == "assistant"
    summary["tool_call"] = call.function.arguments

    # The same forced call streamed: the client puts the call back together
    # from `tool_calls` deltas.
    stream = client.chat.completions.create(
        model=m, messages=ask, tools=tools, max_tokens=16, stream=True, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    got, finish = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                slot = got.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                finish = ch.finish_reason
    assert finish == c.finish_reason, (finish, c.finish_reason)
    assert got[0]["name"] == "get_weather", got
    assert json.loads(got[0]["arguments"]) == json.loads(call.function.arguments), (got, call)

    r = client.chat.completions.create(
        model=m, messages=user, max_tokens=6, logprobs=True, top_logprobs=3,
        extra_body=extra,
    )
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens == 6, (len(lp), r.usage)
    for t in lp:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
    summary["logprobs"] = [t.logprob for t in lp]

    r = client.completions.create(
        model=m, prompt="The quick brown fox", max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert len(c.logprobs.token_logprobs) == 5
    tids = c.model_extra.get("token_ids")
    assert tids is not None and len(tids) == 5, c.model_extra
    summary["completion"] = c.text

    # Scoring a text the way evaluation harnesses do: echo the prompt with
    # its log-probs and generate nothing. The completion above, sent back
    # as token ids after its prompt, gets the log-probs it was generated
    # with.
    ids = c.model_extra["prompt_token_ids"] + tids
    e = client.completions.create(
        model=m, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0,
    ).choices[0]
    elp = e.logprobs
    assert len(elp.tokens) == len(elp.text_offset) == len(elp.top_logprobs) == len(ids)
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None, elp
    assert all(x <= 0 for x in elp.token_logprobs[1:]), elp
    # As OpenAI documents: each token's alternatives include the token.
    assert all(t in top for t, top in zip(elp.tokens[1:], elp.top_logprobs[1:])), elp
    assert elp.token_logprobs[-5:] == c.logprobs.token_logprobs, (elp, c.logprobs)
    assert e.text.startswith("The quick brown fox"), e.text
    summary["echo_prompt_logprobs"] = len(elp.token_logprobs)

    # A list of prompts, streamed with echo: each choice's chunks join into
    # the text the whole answer gives at the same index.
    two = ["The quick brown fox", "Once upon a time"]
    ask = dict(model=m, prompt=two, n=2, max_tokens=4, echo=True, temperature=0,
               extra_body={"ignore_eos": True})
    whole = {c.index: c.text for c in client.completions.create(**ask).choices}
    joined = {}
    for chunk in client.completions.create(stream=True, **ask):
        for c in chunk.choices:
            joined[c.index] = joined.get(c.index, "") + c.text
    assert joined == whole and len(whole) == 4, (joined, whole)
    assert whole[2].startswith("Once upon a time"), whole
    summary["streamed_prompt_list_choices"] = len(joined)

    # vLLM's guided choice through extra_body, and a required tool call
    # that can only name a declared tool.
    labels = ["positive", "negative"]
    g = client.chat.completions.create(
        model=m, messages=user, max_tokens=16, n=3, temperature=1.0, seed=1,
        extra_body={"guided_choice": labels},
    )
    assert all(c.message.content in labels and c.finish_reason == "stop" for c in g.choices), g
    summary["guided_choice"] = [c.message.content for c in g.choices]
    named = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time")]
    req = client.chat.completions.create(
        model=m, messages=user, tools=named, tool_choice="required", max_tokens=24,
        temperature=1.0, seed=2,
    )
    call_names = [tc.function.name for tc in req.choices[0].message.tool_calls or []]
    assert call_names and call_names[0] in ("get_weather", "get_time"), req
    summary["required_tool"] = call_names[0]

    def ask_one(i):
        msgs = [{"role": "user", "content": f"Request number {i}: count to {i % 7 + 2}."}]
        out = client.chat.completions.create(
            model=m, messages=msgs, max_tokens=10, temperature=0, extra_body=extra
        )
        return out.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(ask_one, range(32)))
    alone = [ask_one(i) for i in range(32)]
    assert together == alone, [i for i in range(32) if together[i] != alone[i]]
    summary["concurrent"] = 32

    try:
        client.chat.completions.create(model=m, messages=[], max_tokens=4)
        raise AssertionError("an empty message list was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400
    try:
        client.chat.completions.create(model=m, messages=user, max_tokens=10**7)
        raise AssertionError("an over-long request was accepted")
    except openai.BadRequestError as e:
        assert "context length" in str(e), str(e)

    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
