"""The official openai Python SDK against the real daemon, over TCP and the Unix socket.

Usage: openai_sdk_test.py FLASHD_BINARY TOKENIZER_DIR

Writes a tiny model with `flashd mkmodel` (the tokenizer in TOKENIZER_DIR), starts `flashd serve`
on a free port and a private socket with it, drives
/v1/completions through the SDK as a user would, and stops the daemon with SIGTERM.
"""

import os
import signal
import sys
import tempfile

import httpx2
import openai

from sdk_support import MODEL, check, make_model, start, wait_ready


def exercise(client, name):
    req = dict(model=MODEL, prompt="def add(a, b):", max_tokens=12, seed=42, temperature=0.8)
    whole = client.completions.create(**req)
    check(whole.object == "text_completion", name + ": object is text_completion")
    check(whole.model == MODEL, name + ": model echoed")
    choice = whole.choices[0]
    check(choice.finish_reason in ("length", "stop"), name + ": finish_reason " + choice.finish_reason)
    check(whole.usage.completion_tokens >= 1, name + ": completion tokens counted")
    check(
        whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens,
        name + ": usage adds up",
    )

    again = client.completions.create(**req)
    check(again.choices[0].text == choice.text, name + ": a seeded request is reproducible")

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **req))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    check(streamed == choice.text, name + ": the stream carries the same text")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(finishes == [choice.finish_reason], name + ": one finish_reason at the end of the stream")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens,
          name + ": the last chunk carries the usage")

    lp = client.completions.create(logprobs=3, **req)
    check(lp.choices[0].text == choice.text, name + ": logprobs do not change the tokens")
    check(len(lp.choices[0].logprobs.tokens) == lp.usage.completion_tokens, name + ": one logprob per token")
    check(all(len(t) <= 3 and len(t) >= 1 for t in lp.choices[0].logprobs.top_logprobs),
          name + ": top logprobs per token")

    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, top_p=0)
        check(False, name + ": top_p=0 must be refused")
    except openai.BadRequestError as e:
        check("top_p" in str(e), name + ": a bad field raises BadRequestError naming it")
    try:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=4)
        check(False, name + ": an unknown model must be refused")
    except openai.NotFoundError as e:
        check("gpt-4o" in str(e), name + ": an unknown model raises NotFoundError")
    return choice.text


def exercise_chat(client, name):
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                             "required": ["path"]}}}]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    req = dict(model=MODEL, messages=messages, tools=tools, max_tokens=12, seed=7, temperature=0.8)
    whole = client.chat.completions.create(**req)
    check(whole.object == "chat.completion", name + ": chat object")
    msg = whole.choices[0].message
    check(msg.role == "assistant", name + ": assistant message")
    check(whole.choices[0].finish_reason in ("length", "stop", "tool_calls"), name + ": chat finish_reason")
    check(whole.usage.prompt_tokens > 100, name + ": the tool schema is part of the prompt")
    cached = whole.usage.prompt_tokens_details.cached_tokens
    check(0 <= cached < whole.usage.prompt_tokens, name + ": cached_tokens reported")
    check(whole.usage.model_extra["prompt_cache_hit_tokens"] == cached, name + ": DeepSeek's hit count")

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **req))
    check(chunks[0].choices[0].delta.role == "assistant", name + ": the stream opens with the role")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(streamed == (msg.content or ""), name + ": the chat stream carries the same content")
    check(chunks[-1].usage.completion_tokens == whole.usage.completion_tokens, name + ": chat stream usage")

    thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=7,
                                              reasoning_effort="high")
    reasoning = getattr(thinking.choices[0].message, "reasoning_content", None)
    if reasoning is None and thinking.choices[0].message.model_extra:
        reasoning = thinking.choices[0].message.model_extra.get("reasoning_content")
    check(bool(reasoning), name + ": thinking mode returns reasoning_content")

    named = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=6, seed=3,
        tool_choice={"type": "function", "function": {"name": "read_file"}})
    calls = named.choices[0].message.tool_calls or []
    check(len(calls) >= 1 and calls[0].function.name == "read_file" and calls[0].id.startswith("call_"),
          name + ": a named tool_choice makes the reply call that tool")

    # A tool-call round trip: the call and its result go back as history.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
    ]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=4, seed=1)
    check(after.usage.prompt_tokens > whole.usage.prompt_tokens, name + ": tool results extend the prompt")
    # The second turn resumes where the first prompt ended: at least that much is cached.
    check(after.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens,
          name + ": the second turn reports the first turn's prompt as cached")

    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}], max_tokens=4)
        check(False, name + ": an unknown role must be refused")
    except openai.BadRequestError as e:
        check("messages[0].role" in str(e), name + ": a bad message names messages[0].role")


def exercise_responses(client, name):
    tools = [{"type": "function", "name": "shell", "description": "Run a command",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                             "required": ["cmd"]}}]
    req = dict(model=MODEL, instructions="You are a coding agent.", input="List the files.",
               tools=tools, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**req)
    check(whole.object == "response" and whole.id.startswith("resp_"), name + ": a response")
    check(whole.status in ("completed", "incomplete"), name + ": response status")
    if whole.status == "incomplete":
        check(whole.incomplete_details.reason == "max_output_tokens", name + ": incomplete reason")
    check(whole.usage.input_tokens > 50, name + ": the tools are part of the prompt")

    events = list(client.responses.create(stream=True, **req))
    kinds = [e.type for e in events]
    check(kinds[0] == "response.created" and kinds[1] == "response.in_progress",
          name + ": the stream opens with created, in_progress")
    check(kinds[-1] in ("response.completed", "response.incomplete"), name + ": the stream's end")
    check([e.sequence_number for e in events] == list(range(len(events))),
          name + ": sequence numbers count up from 0")
    final = events[-1].response
    def content(output):  # Ids are fresh in every response.
        return [{k: v for k, v in o.model_dump().items() if k not in ("id", "call_id")} for o in output]
    check(content(final.output) == content(whole.output),
          name + ": the stream's output equals the whole response's")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(text == whole.output_text, name + ": output_text deltas add up")
    check(final.usage.input_tokens_details.cached_tokens > 0, name + ": the repeat is cached")
    # A hosted tool flashd cannot run is left out; the request still works, with the same prompt.
    hosted = client.responses.create(**dict(req, tools=tools + [{"type": "web_search"}]))
    check(hosted.usage.input_tokens == whole.usage.input_tokens, name + ": a hosted tool is left out")

    # A function call, then its output sent back: the round trip Codex makes.
    forced = client.responses.create(model=MODEL, input="Run ls.", tools=tools, max_output_tokens=16,
                                     temperature=0, tool_choice={"type": "function", "name": "shell"})
    calls = [o for o in forced.output if o.type == "function_call"]
    check(len(calls) >= 1 and calls[0].name == "shell" and calls[0].call_id.startswith("call_"),
          name + ": a forced function_call item")
    # (Random weights rarely finish the arguments within 16 tokens; send back a complete call.)
    call = dict(calls[0].model_dump(), arguments='{"cmd": "ls"}')
    history = [{"role": "user", "content": "Run ls."}, call,
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.txt"}]
    after = client.responses.create(model=MODEL, input=history, tools=tools, max_output_tokens=4,
                                    temperature=0)
    check(after.usage.input_tokens > forced.usage.input_tokens, name + ": the output extends the input")
    try:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_x")
        check(False, name + ": previous_response_id must be refused")
    except openai.BadRequestError as e:
        check("previous_response_id" in str(e), name + ": previous_response_id is named")


def main():
    binary, tokenizer_dir = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as work:
        model_dir = make_model(binary, tokenizer_dir, work)
        proc, url, sock, log = start(binary, model_dir, work)
        try:
            tcp = openai.OpenAI(base_url=url + "/v1/", api_key="unused", max_retries=0)
            wait_ready(url)
            over_tcp = exercise(tcp, "tcp")
            exercise_chat(tcp, "tcp")
            exercise_responses(tcp, "tcp")
            uds = openai.OpenAI(
                base_url="http://flashd/v1/",
                api_key="unused",
                max_retries=0,
                http_client=openai.DefaultHttpx2Client(transport=httpx2.HTTPTransport(uds=sock)),
            )
            over_unix = exercise(uds, "unix")
            exercise_chat(uds, "unix")
            exercise_responses(uds, "unix")
            check(over_tcp == over_unix, "both listeners serve the same generations")
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
        check(code == 0, "daemon stopped cleanly")


if __name__ == "__main__":
    main()
