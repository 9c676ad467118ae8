"""An OpenAI-compatible endpoint in front of the run's engine, so that agent code written against
the plain `openai` client trains without changes (`rollout.agent.openai: my_agent:run`, or the
shorthand `rollout.agent: my_agent:run`; docs/agents.md, "Agent code written for the OpenAI API").

`run(client, row)` is an ordinary async function, called once per episode with an
`openai.AsyncOpenAI` client whose base URL is this endpoint and whose every request carries the
episode's id (the `X-Grpokit-Episode` header; the `user` field is read too). The endpoint serves
`POST /v1/chat/completions` (with `tools`; no streaming, `n` = 1) over the current policy:

- the request's messages are rendered by the tokenizer's chat template (tools in the template's
  own way, or in a system message: grpokit.rollout.episodes.chat), an assistant message the
  endpoint wrote being rendered from the exact text it sampled;
- the prompt goes to the engine through the agent-loop runner's batching (grpokit.rollout.
  episodes.custom: every live episode's call in one engine call), at the run's sampling settings
  (a request's `temperature` / `top_p` are not used: the trainer must know the distribution the
  tokens were drawn from), within what remains of the episode's token budget;
- the answer is the sampled text with its hermes tool calls parsed into `tool_calls`, and the call
  is recorded: the exact prompt ids, completion ids and sampler log-probs.

When `run` returns, the episode's calls become its training sequences: consecutive calls merge
into one sequence only when the next call's prompt ids continue the previous sequence's ids
exactly (the tokens between them are the observation, masked); otherwise the call starts a new
segment (trained with the episode's one advantage, as step-wise turns are). A number returned by
`run` is the episode's own reward (`{name: env}` in `rewards`). A request whose episode id the
trainer did not hand out is refused (400) with one line.

Served with FastAPI on uvicorn, on a free local port, in a thread of the trainer's process. (No
`from __future__ import annotations` here: FastAPI reads the handlers' annotations at run time.)
"""

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from grpokit.errors import ConfigError
from grpokit.rollout.episodes.chat import ChatTokens
from grpokit.rollout.episodes.custom import Sampled, Trajectory
from grpokit.rollout.episodes.parse import parse_tool_calls

log = logging.getLogger("grpokit.rollout")

HEADER = "X-Grpokit-Episode"


@dataclass
class _Episode:
    handle: Any                                   # the runner's EngineHandle of this episode
    calls: list[tuple[list[int], Sampled, str]] = field(default_factory=list)   # prompt ids, sampled, text
    written: dict[str, str] = field(default_factory=dict)   # the answers' key -> the exact text sampled
    tool_calls: int = 0
    names: dict[str, str] = field(default_factory=dict)     # tool-call id -> the tool's name
    messages: list[dict] = field(default_factory=list)


class Gateway:
    """The endpoint; `open(handle)` hands out an episode id, `close(id)` returns its calls."""

    def __init__(self, tokenizer, eos_ids: list[int], host: str = "127.0.0.1"):
        try:
            import uvicorn
            from fastapi import FastAPI, Request
            from fastapi.responses import JSONResponse
        except ImportError:
            raise ConfigError("rollout.agent.openai needs fastapi and uvicorn: pip install 'grpokit[agents]'") from None
        self.tok, self.eos_ids = tokenizer, list(eos_ids)
        self.episodes: dict[str, _Episode] = {}
        self.lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="grpokit-gateway")  # blocked calls
        app = FastAPI(title="grpokit policy", docs_url=None, redoc_url=None, openapi_url=None)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            try:
                body = await request.json()
            except ValueError:
                return _error(JSONResponse, 400, "the body is not JSON", "invalid_json")
            code, out = await self._chat(body if isinstance(body, dict) else {}, request.headers.get(HEADER))
            return JSONResponse(out, status_code=code) if code != 200 else out

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "grpokit-policy", "object": "model", "owned_by": "grpokit"}]}

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="grpokit-gateway")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the OpenAI-compatible endpoint did not start")
            time.sleep(0.01)
        log.info("OpenAI-compatible endpoint for rollout.agent.openai at %s", self.url)

    # ------------------------------------------------------------------------------ episodes
    def open(self, handle) -> str:
        eid = uuid.uuid4().hex
        with self.lock:
            self.episodes[eid] = _Episode(handle)
        return eid

    def close(self, eid: str) -> _Episode:
        with self.lock:
            return self.episodes.pop(eid)

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------ a call
    async def _chat(self, body: dict, header: str | None) -> tuple[int, dict]:
        eid = header or body.get("user")
        with self.lock:
            ep = self.episodes.get(eid) if isinstance(eid, str) else None
        if ep is None:
            return 400, _body(f"unknown episode id {str(eid)[:40]!r}: this endpoint serves the episodes the trainer "
                              f"runs (the client it passes to your agent sends the id in the {HEADER} header)",
                              "unknown_episode")
        if body.get("stream"):
            return 400, _body("streaming is not supported (stream: false)", "unsupported")
        if body.get("n", 1) != 1:
            return 400, _body("n must be 1", "unsupported")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, _body("messages must be a non-empty list", "invalid_request")
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
        try:
            chat = ChatTokens(self.tok, tools, self.eos_ids)
            rendered = [self._message(m, ep, chat) for m in messages]
            prompt = chat.prompt_ids(rendered)
        except (ConfigError, KeyError, TypeError, ValueError) as exc:
            return 400, _body(f"the conversation cannot be rendered: {type(exc).__name__}: {exc}", "invalid_request")
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        loop = asyncio.get_running_loop()
        try:
            sampled = await loop.run_in_executor(self.executor, ep.handle.generate, prompt,
                                                 int(cap) if cap is not None else None)
        except Exception as exc:  # noqa: BLE001 - the episode was abandoned or the engine failed: the agent sees it
            return 503, _body(f"generation failed: {type(exc).__name__}: {exc}", "generation_failed")
        ids = sampled.ids[:-1] if sampled.ids and sampled.ids[-1] in self.eos_ids else sampled.ids
        text = self.tok.decode(ids)
        ep.calls.append((prompt, sampled, text))
        message, finish = self._answer(text, sampled, ep)
        ep.messages = rendered + [{"role": "assistant", "content": text}]
        return 200, {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                     "model": "grpokit-policy",
                     "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sampled.ids),
                               "total_tokens": len(prompt) + len(sampled.ids)}}

    def _answer(self, text: str, sampled: Sampled, ep: _Episode) -> tuple[dict, str]:
        """The assistant message of a sampled text (its tool calls parsed) and the finish reason."""
        parsed = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "length" if sampled.finish_reason == "length" else "stop"
        if parsed.calls and parsed.error is None:
            content = text[:text.index("<tool_call>")].strip()
            calls = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
            message = {"role": "assistant", "content": content or None, "tool_calls": calls}
            ep.tool_calls += len(calls)
            ep.names.update((c["id"], c["function"]["name"]) for c in calls)
            finish = "tool_calls" if finish == "stop" else finish
        ep.written[_key(message)] = text
        return message, finish

    def _message(self, m: dict, ep: _Episode, chat: ChatTokens) -> dict:
        """A request message as the chat template takes it: an assistant message this endpoint wrote
        as the exact text it sampled, tool calls in the hermes format, a tool result in the role
        the template has."""
        role, content = m["role"], _text(m.get("content"))
        if role == "assistant":
            written = ep.written.get(_key(m))
            if written is not None:
                return {"role": "assistant", "content": written}
            calls = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": _arguments(c["function"].get("arguments"))})
                            + "\n</tool_call>" for c in m.get("tool_calls") or [])
            return {"role": "assistant", "content": (content + "\n" if content and calls else content) + calls}
        if role == "tool":
            return chat.observation(content, m.get("name") or ep.names.get(m.get("tool_call_id")))
        return {"role": role, "content": content}


# ------------------------------------------------------------------------------ the episodes' sequences
def sequences(calls: list[tuple[list[int], Sampled, str]]) -> list[Trajectory]:
    """An episode's calls as training sequences: a call whose prompt continues the current sequence
    exactly (its ids are the sequence's prompt and ids, then more) extends it, the extra ids masked
    as observation; any other call starts a new segment."""
    out: list[Trajectory] = []
    for prompt, s, text in calls:
        if not s.ids:
            continue
        cur = out[-1] if out else None
        if cur is not None and prompt[:len(cur.prompt_ids) + len(cur.ids)] == cur.prompt_ids + cur.ids:
            obs = prompt[len(cur.prompt_ids) + len(cur.ids):]
            cur.ids += obs + s.ids
            cur.mask += [0] * len(obs) + [1] * len(s.ids)
            cur.logprobs += [0.0] * len(obs) + s.logprobs
            cur.completion = text
        else:
            out.append(Trajectory(prompt_ids=list(prompt), ids=list(s.ids), mask=[1] * len(s.ids),
                                  logprobs=list(s.logprobs), completion=text))
    return out


class OpenAIAgent:
    """The agent-loop function (grpokit.rollout.episodes.custom.LoopRunner) that runs the async
    `fn(client, row)` of an episode against the gateway and returns its sequences."""

    def __init__(self, fn, tokenizer, eos_ids: list[int], *, timeout_s: float = 600.0):
        if not asyncio.iscoroutinefunction(fn):
            raise ConfigError(f"rollout.agent.openai {getattr(fn, '__name__', fn)!r} must be an async function "
                              "`async def run(client, row)`")
        try:
            import openai
        except ImportError:
            raise ConfigError("rollout.agent.openai needs the openai package: pip install 'grpokit[agents]'") from None
        self.openai, self.fn, self.timeout_s = openai, fn, timeout_s
        self.tok, self.eos_ids = tokenizer, list(eos_ids)
        self.gateway: Gateway | None = None     # started at the first episode, again after `close`
        self._lock = threading.Lock()

    def __call__(self, handle, row: dict):
        with self._lock:
            if self.gateway is None:
                self.gateway = Gateway(self.tok, self.eos_ids)
            gateway = self.gateway
        eid = gateway.open(handle)
        try:
            result = asyncio.run(self._play(gateway, eid, row))
        finally:
            ep = gateway.close(eid)
        segs = sequences(ep.calls)
        if not segs:
            raise RuntimeError("the agent made no call that sampled a token")
        segs[-1].reward = float(result) if isinstance(result, (int, float)) and not isinstance(result, bool) else None
        segs[-1].info = {"tool_calls": ep.tool_calls, "messages": ep.messages}
        return segs

    async def _play(self, gateway: Gateway, eid: str, row: dict):
        client = self.openai.AsyncOpenAI(base_url=gateway.url, api_key="grpokit", max_retries=0,
                                         timeout=self.timeout_s, default_headers={HEADER: eid})
        try:
            return await self.fn(client, dict(row))
        finally:
            await client.close()

    def close(self) -> None:
        with self._lock:
            gateway, self.gateway = self.gateway, None
        if gateway is not None:
            gateway.shutdown()


def _key(message: dict) -> str:
    calls = [(c["function"]["name"], json.dumps(_arguments(c["function"].get("arguments")), sort_keys=True))
             for c in message.get("tool_calls") or []]
    return json.dumps([_text(message.get("content")).strip(), calls])


def _arguments(value) -> dict:
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value or "{}")
    except (TypeError, ValueError):
        return {"_raw": str(value)}
    return out if isinstance(out, dict) else {"_value": out}


def _text(content) -> str:
    """A message's content as text (a list of parts: their text joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _body(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


def _error(response_cls, status: int, message: str, code: str):
    return response_cls(_body(message, code), status_code=status)
