#!/usr/bin/env python3
"""A seeded generator of coding-agent traces, written as JSONL (one request per line).

  bench/agent_trace/generate.py OUT.jsonl [--seed 1] [--sessions 8] [--scale 0.03125]
                                [--hours 2] [--tenants 3] [--repos 4]

The shape follows what published traces of Claude Code and Codex use report: sessions of 20-150
requests; a system prompt plus tool definitions of 10-25K tokens shared by every session of one
client version; per-session volatile lines (an environment block with the working directory, the
date and a git status; Claude Code's per-request billing header line); tool outputs of 200-20K
tokens; subagents that share the parent's system prompt and tools but not its history;
compaction when the context passes ~100K tokens (the early turns replaced by a summary); think
time between a model reply and the tool result, longer before a new user message; several
repositories and tenants; one daemon restart halfway. Token counts are multiplied by --scale (the
ratios kept), so a default trace replays in minutes against a tiny model.

Four client shapes, each on its own API:
  claude-code   Anthropic Messages (system blocks, tools, tool_use / tool_result)
  codex         OpenAI Responses (instructions, tools, function_call / function_call_output)
  opencode      OpenAI Chat Completions (system message, tools, tool_calls / tool messages)
  ide-chat      flashd's sessions API (the daemon keeps the conversation, its replies included;
                a request carries the new message, the first one also "create": the session's
                system prompt and tools)

Lines (all with "t", seconds from the trace's start, in arrival order):
  {"t", "tenant", "session", "client", "api", "body", "volatile": [str, ...]}   a request
  {"t", "event": "restart"}                                                       a daemon restart
The first line is {"meta": {...}} with the generator's parameters. "volatile" lists the strings in
"body" that change per session or per request without changing its meaning (what a replayer may
blank to see what they cost). A captured trace in the same format replays the same way.
"""
import argparse
import heapq
import json
import random

WORDS = (
    "the of and to in is for on that with as by this it from be are at or an not file "
    "function return value error test build run path line code type name list data request "
    "response model cache block token state read write open close start stop check update "
    "config option default index result output input user system tool call args string number "
    "object array true false null import export class struct const static void int float "
    "double char bool size length count offset limit buffer stream socket server client thread "
    "lock queue map set key hash table row column query store load save parse format print log "
    "debug info warn trace event handler callback promise async await yield match case switch "
    "branch commit merge diff patch status repo module package version release install remove "
    "create delete insert select where order group join left right inner outer first last next "
    "prev begin end node edge graph tree leaf root parent child depth width height scale shift "
    "mask bit byte word page frame layer weight bias norm grad loss step batch epoch rate").split()


def text(rng, tokens):
    """About `tokens` tokens of code-like text (a word is about one token)."""
    out, line = [], []
    for _ in range(max(1, tokens)):
        line.append(rng.choice(WORDS))
        if len(line) >= rng.randint(6, 14):
            out.append(" ".join(line))
            line = []
    if line:
        out.append(" ".join(line))
    return "\n".join(out)


class Client:
    """One client version: its system prompt and tool definitions, shared by all its sessions."""

    def __init__(self, rng, kind, version, scale):
        self.kind, self.version = kind, version
        total = int(rng.randint(10000, 25000) * scale)
        self.system = "You are %s %s, a coding agent.\n%s" % (kind, version, text(rng, total // 4))
        self.tools = []
        names = ["Read", "Write", "Edit", "Bash", "Grep", "Glob", "Task", "WebFetch", "TodoWrite",
                 "NotebookEdit", "LS", "MultiEdit"]
        for name in names:
            self.tools.append({
                "name": name,
                "description": text(rng, (total * 3 // 4) // len(names)),
                "schema": {"type": "object",
                           "properties": {"path": {"type": "string", "description": "a path"},
                                          "arg": {"type": "string"}},
                           "required": ["path"]}})


def environment(rng, repo, day, scale):
    status = "\n".join("M src/%s_%d.cc" % (rng.choice(WORDS), rng.randint(1, 99))
                       for _ in range(rng.randint(1, 6)))
    commits = "\n".join("%07x %s" % (rng.getrandbits(28), text(rng, 8)) for _ in range(5))
    return ("<env>\nWorking directory: /home/dev/%s\nIs directory a git repo: Yes\nPlatform: linux\n"
            "Today's date: 2026-11-%02d\n</env>\ngitStatus: This is the git status at the start of the "
            "conversation.\nCurrent branch: %s\nStatus:\n%s\nRecent commits:\n%s" %
            (repo, day, rng.choice(WORDS) + "-" + rng.choice(WORDS), status, commits))


class Session:
    """A conversation kept as neutral turns; rendered into each client's API per request."""

    def __init__(self, rng, sid, tenant, client, repo, scale, env, parent=None):
        self.rng, self.sid, self.tenant, self.client = rng, sid, tenant, client
        self.repo, self.scale, self.env, self.parent = repo, scale, env, parent
        self.turns = []  # ("user", text) | ("assistant", text, [(id, name, args)]) | ("tool", id, text)
        self.context = 0  # Tokens of history (an estimate, in words).
        self.calls = 0
        self.created = False  # The sessions API's session exists.

    def add(self, turn, tokens):
        self.turns.append(turn)
        self.context += tokens

    def call_id(self):
        self.calls += 1
        prefix = {"claude-code": "toolu_", "codex": "call_", "opencode": "call_"}[self.client.kind]
        return "%s%s_%04d" % (prefix, self.sid.replace("-", ""), self.calls)


def billing_header(rng, client):
    return "x-anthropic-billing-header: cc_version=%s; cc_entrypoint=cli; cch=%05x;" % (
        client.version, rng.getrandbits(20))


def chat_tools(c):
    """Client c's tools in the Chat Completions shape (also what the sessions API takes)."""
    return [{"type": "function", "function": {"name": x["name"], "description": x["description"],
                                              "parameters": x["schema"]}} for x in c.tools]


def render(s, max_tokens):
    """The request body of session `s` now, and the volatile strings in it."""
    c = s.client
    if c.kind == "ide-chat":
        # flashd's sessions API: the daemon keeps the conversation (its own replies included);
        # a turn sends only the new message. The first also creates the session.
        body = {"messages": [{"role": "user", "content": s.turns[-1][1]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if not s.created:
            body["create"] = {"system": c.system, "tools": chat_tools(c)}
            s.created = True
        return "sessions", body, []
    volatile = [s.env] if s.env else []
    if c.kind == "claude-code":
        header = billing_header(s.rng, c)
        volatile.append(header)
        system = [{"type": "text", "text": header},
                  {"type": "text", "text": c.system + ("\n" + s.env if s.env else "")}]
        messages = []
        for t in s.turns:
            if t[0] == "user":
                messages.append({"role": "user", "content": [{"type": "text", "text": t[1]}]})
            elif t[0] == "assistant":
                blocks = [{"type": "text", "text": t[1]}]
                blocks += [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in t[2]]
                messages.append({"role": "assistant", "content": blocks})
            else:
                block = {"type": "tool_result", "tool_use_id": t[1], "content": t[2]}
                if messages[-1]["role"] == "user":
                    messages[-1]["content"].append(block)
                else:
                    messages.append({"role": "user", "content": [block]})
        tools = [{"name": x["name"], "description": x["description"], "input_schema": x["schema"]}
                 for x in c.tools]
        body = {"model": "deepseek-v4.1-flash", "max_tokens": max_tokens, "temperature": 0,
                "system": system, "tools": tools, "messages": messages, "stream": True}
        return "messages", body, volatile
    if c.kind == "codex":
        items = []
        if s.env:
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": s.env}]})
        for t in s.turns:
            if t[0] == "user":
                items.append({"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": t[1]}]})
            elif t[0] == "assistant":
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": t[1]}]})
                items += [{"type": "function_call", "call_id": i, "name": n,
                           "arguments": json.dumps(a)} for i, n, a in t[2]]
            else:
                items.append({"type": "function_call_output", "call_id": t[1], "output": t[2]})
        tools = [{"type": "function", "name": x["name"], "description": x["description"],
                  "parameters": x["schema"]} for x in c.tools]
        body = {"model": "deepseek-v4.1-flash", "max_output_tokens": max_tokens, "temperature": 0,
                "instructions": c.system, "tools": tools, "input": items, "stream": True,
                "store": False}
        return "responses", body, volatile
    messages = [{"role": "system", "content": c.system + ("\n" + s.env if s.env else "")}]
    for t in s.turns:
        if t[0] == "user":
            messages.append({"role": "user", "content": t[1]})
        elif t[0] == "assistant":
            m = {"role": "assistant", "content": t[1]}
            if t[2]:
                m["tool_calls"] = [{"id": i, "type": "function",
                                    "function": {"name": n, "arguments": json.dumps(a)}}
                                   for i, n, a in t[2]]
            messages.append(m)
        else:
            messages.append({"role": "tool", "tool_call_id": t[1], "content": t[2]})
    body = {"model": "deepseek-v4.1-flash", "max_tokens": max_tokens, "temperature": 0,
            "messages": messages, "tools": chat_tools(c), "stream": True,
            "stream_options": {"include_usage": True}}
    return "chat.completions", body, volatile


def generate(args):
    rng = random.Random(args.seed)
    scale = args.scale
    clients = []
    for kind in ("claude-code", "codex", "opencode", "ide-chat"):
        for v in ("1.0.%d" % rng.randint(10, 60), "1.1.%d" % rng.randint(0, 9)):
            clients.append(Client(rng, kind, v, scale))
    weights = {"claude-code": 5, "codex": 3, "opencode": 2, "ide-chat": 2}
    tenants = ["dev%d" % i for i in range(args.tenants)]
    repos = ["repo-%s" % w for w in rng.sample(WORDS, args.repos)]
    horizon = args.hours * 3600.0
    compact_at = int(100000 * scale)
    out = []

    def emit(t, s, max_tokens):
        api, body, volatile = render(s, max_tokens)
        out.append({"t": round(t, 3), "tenant": s.tenant, "session": s.sid, "client":
                    s.client.kind + "/" + s.client.version, "api": api, "body": body,
                    "volatile": volatile})

    def run_session(s, t, requests):
        """Appends the session's requests from time t; returns when it ends."""
        r = s.rng
        if s.client.kind == "ide-chat":
            # A chat beside the editor: a question with pasted code, the reply, the next one.
            for _ in range(requests):
                s.add(("user", text(r, int(r.randint(200, 4000) * scale) + 10)), 0)
                emit(t, s, args.max_tokens)
                t += r.uniform(2, 20) + r.expovariate(1 / 60.0)
            return t
        s.add(("user", text(r, r.randint(20, 200))), 100)
        for n in range(requests):
            emit(t, s, args.max_tokens)
            t += r.uniform(2, 20)  # The model's reply.
            if s.context > compact_at and s.parent is None:
                # Compaction: the client asks for a summary of the whole history, then goes on
                # from the summary alone (the early turns rewritten).
                s.add(("user", "Summarize this conversation so that the work can go on."), 20)
                emit(t, s, args.max_tokens)
                t += r.uniform(5, 30)
                summary = text(r, int(r.randint(2000, 6000) * scale))
                s.turns = [("user", "This session continues an earlier one. Summary:\n" + summary)]
                s.context = len(summary.split())
                continue
            if r.random() < 0.12 and n + 1 < requests:
                # The model answers; the user thinks, then asks for more.
                s.add(("assistant", text(r, r.randint(30, 300)), []), 150)
                t += r.expovariate(1 / 90.0)
                s.add(("user", text(r, r.randint(10, 120))), 60)
                continue
            cid = s.call_id()
            spawn = s.parent is None and r.random() < 0.05
            name = "Task" if spawn else r.choice(["Read", "Bash", "Grep", "Edit", "Glob"])
            s.add(("assistant", text(r, r.randint(5, 60)),
                   [(cid, name, {"path": "src/%s.cc" % r.choice(WORDS), "arg": text(r, 6)})]), 40)
            if spawn:
                # A subagent: the parent's system prompt and tools, a history of its own.
                sub = Session(random.Random(r.getrandbits(64)), s.sid + "-sub%d" % s.calls,
                              s.tenant, s.client, s.repo, scale, s.env, parent=s)
                t = run_session(sub, t + r.uniform(0.5, 2), r.randint(5, 20))
                result = text(r, r.randint(100, 800))
            else:
                t += r.uniform(0.2, 8)  # The tool runs.
                size = int(min(20000, r.lognormvariate(7.2, 1.1)) * scale)
                result = text(r, max(int(200 * scale), size))
            s.add(("tool", cid, result), len(result.split()))
        return t

    # Sessions start spread over the horizon; each tenant works in a few repositories.
    starts = sorted(rng.uniform(0, horizon * 0.75) for _ in range(args.sessions))
    # Each developer has one client they mostly use, at the version they installed (one of
    # them lags a version behind); now and then they try another.
    kinds = [k for k in weights for _ in range(weights[k])]
    primary = {t: rng.choice(kinds) for t in tenants}
    installed = {(t, c.kind): c for t in tenants for c in clients if c.version.startswith("1.1")}
    for c in clients:
        if c.version.startswith("1.0"):
            installed[(tenants[-1], c.kind)] = c
    for k, start in enumerate(starts):
        tenant = tenants[k % len(tenants)]
        kind = primary[tenant] if rng.random() < 0.8 else rng.choice(kinds)
        client = installed[(tenant, kind)]
        srng = random.Random(rng.getrandbits(64))
        repo = rng.choice(repos)
        env = environment(srng, repo, 1 + int(start // 86400) + rng.randint(0, 1), scale)
        s = Session(srng, "s%03d" % k, tenant, client, repo, scale, env)
        # 20-150 requests, most sessions short (a median near 40), a few long.
        run_session(s, start, min(150, max(20, int(srng.lognormvariate(3.7, 0.6)))))
    out.sort(key=lambda x: x["t"])
    restart = out[len(out) // 2]["t"] + 0.001
    out.append({"t": restart, "event": "restart"})
    out.sort(key=lambda x: x["t"])
    meta = {"generator": "bench/agent_trace/generate.py", "seed": args.seed,
            "sessions": args.sessions, "scale": scale, "hours": args.hours,
            "tenants": args.tenants, "repos": args.repos, "max_tokens": args.max_tokens,
            "requests": sum(1 for x in out if "body" in x)}
    return meta, out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--scale", type=float, default=1 / 32)
    p.add_argument("--hours", type=float, default=2)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--repos", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=1)
    args = p.parse_args()
    meta, lines = generate(args)
    with open(args.out, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for x in lines:
            f.write(json.dumps(x) + "\n")
    print("%d requests, %d sessions -> %s" % (meta["requests"], args.sessions, args.out))


if __name__ == "__main__":
    main()
