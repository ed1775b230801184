"""The official anthropic Python SDK against the real daemon's /v1/messages, over TCP and the
Unix socket: what Claude Code speaks when ANTHROPIC_BASE_URL points at flashd.

Usage: anthropic_sdk_test.py FLASHD_BINARY TOKENIZER_DIR
"""

import signal
import sys
import tempfile

import anthropic
import httpx2

from sdk_support import MODEL, check, make_model, start, wait_ready

TOOLS = [{"name": "read_file", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}}]
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=%s"},
          {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]


def system(n):
    # The first block changes on every request, as some clients' billing line does.
    return [dict(SYSTEM[0], text=SYSTEM[0]["text"] % n), SYSTEM[1]]


def exercise(client, name):
    msgs = [{"role": "user", "content": "List the files."}]
    whole = client.messages.create(model=MODEL, max_tokens=12, system=system(1), messages=msgs,
                                   tools=TOOLS, extra_body={"temperature": 0})
    check(whole.type == "message" and whole.role == "assistant", name + ": a message")
    check(whole.id.startswith("msg_"), name + ": message id")
    check(whole.stop_reason in ("end_turn", "max_tokens", "tool_use"), name + ": stop_reason")
    check(whole.usage.output_tokens >= 1, name + ": output tokens counted")
    check(whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 50,
          name + ": the tools are part of the prompt")

    # The stream: its events rebuild the same message.
    with client.messages.stream(model=MODEL, max_tokens=12, system=system(2), messages=msgs,
                                tools=TOOLS, extra_body={"temperature": 0}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    check(kinds[0] == "message_start" and kinds[-1] == "message_stop", name + ": event order")
    check("message_delta" in kinds, name + ": message_delta")
    check([b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content],
          name + ": the stream rebuilds the same content")
    # The billing line differs between the two, the rest is identical: read from the cache.
    check(final.usage.cache_read_input_tokens > 0,
          name + ": a volatile billing line does not defeat the cache")

    # tool_use streamed: a named tool choice makes the model call read_file.
    with client.messages.stream(model=MODEL, max_tokens=16, system=system(3), messages=msgs,
                                tools=TOOLS, tool_choice={"type": "tool", "name": "read_file"},
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    check(any(s.content_block.type == "tool_use" and s.content_block.name == "read_file"
              for s in starts), name + ": a tool_use block starts with its name")
    check(any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
          or final.stop_reason == "max_tokens", name + ": input_json_delta fragments")
    uses = [b for b in final.content if b.type == "tool_use"]
    check(len(uses) >= 1 and uses[0].name == "read_file", name + ": the final message has the tool_use")

    # The round trip: the tool_use goes back with its result; the second turn resumes the first.
    history = msgs + [{"role": "assistant", "content": [b.model_dump() for b in final.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                    "content": "a.txt\nb.txt"}]}]
    after = client.messages.create(model=MODEL, max_tokens=8, system=system(4), messages=history,
                                   tools=TOOLS, extra_body={"temperature": 0})
    check(after.usage.cache_read_input_tokens > 0, name + ": the second turn reads the cache")

    # Thinking.
    thought = client.messages.create(model=MODEL, max_tokens=8, messages=msgs, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    check(thought.content and thought.content[0].type == "thinking", name + ": a thinking block")

    # A server tool flashd cannot run is left out; the prompt is the same as without it.
    web = {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}
    with_server_tool = client.messages.count_tokens(model=MODEL, system=system(5), messages=msgs,
                                                    tools=TOOLS + [web])
    counted = client.messages.count_tokens(model=MODEL, system=system(5), messages=msgs, tools=TOOLS)
    check(counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens,
          name + ": count_tokens equals the prompt the model saw")
    check(with_server_tool.input_tokens == counted.input_tokens, name + ": a server tool is left out")

    try:
        client.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "wizard", "content": "x"}])
        check(False, name + ": an unknown role must be refused")
    except anthropic.BadRequestError as e:
        check("messages[0].role" in str(e), name + ": a bad message names messages[0].role")
    try:
        client.messages.create(model="claude-unknown", max_tokens=4, messages=msgs)
        check(False, name + ": an unknown model must be refused")
    except anthropic.NotFoundError as e:
        check("claude-unknown" in str(e), name + ": an unknown model raises NotFoundError")
    return [b.model_dump() for b in whole.content]


def main():
    binary, tokenizer_dir = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as work:
        proc, url, sock, log = start(binary, make_model(binary, tokenizer_dir, work), work)
        try:
            wait_ready(url)
            tcp = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
            over_tcp = exercise(tcp, "tcp")
            uds = anthropic.Anthropic(
                base_url="http://flashd", api_key="unused", max_retries=0,
                http_client=anthropic.DefaultHttpxClient(transport=httpx2.HTTPTransport(uds=sock)))
            over_unix = exercise(uds, "unix")
            check(over_tcp == over_unix, "both listeners serve the same messages")
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
        check(code == 0, "daemon stopped cleanly")
    print("ok: anthropic SDK")


if __name__ == "__main__":
    main()
