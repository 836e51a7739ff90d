"""The OpenAI-compatible endpoint an agent talks to: Starlette under uvicorn, on loopback, in the environment
process that runs the agent's episodes (tidal.rollout.agent.env).

Every request names its episode, by the API key the agent was started with (``Authorization: Bearer KEY``,
what the `openai` client sends from ``OPENAI_API_KEY``), an ``X-Tidal-Episode: KEY`` header, or the body's
``user`` field. A request for an episode the endpoint does not hold gets 401, so another local process
cannot feed a run. Routes:

- ``POST /v1/chat/completions``: put on the episode's inbox as a `Call`; the episode (the environment
  process's thread) answers it with the policy's next action, as a ``chat.completion`` object. ``stream``
  and ``n`` > 1 are refused (400): one sampled answer per call is what is trained.
- ``POST /v1/tidal/reward`` ``{"reward": R}``: the episode's outcome, when the agent scores itself (else its
  environment's verifier scores the last answer). A reward that is not a finite number gets 400.
- ``POST /v1/completions``: a text prompt (a string), answered with a ``text_completion``. The episode
  compares texts: a prompt that extends the previous prompt and its answer adds only its new text (that
  text alone is tokenised); any other prompt restarts the sample. ``echo``, ``suffix``, ``stream`` and
  ``n`` > 1 are refused (400), and so is a prompt of token ids.
- ``GET /v1/models``: the one model served.

A call waits for its answer as long as the episode's turn takes; when the episode ends first (its turn
limit, a failure, the run stopping) the call gets 409 with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

log = logging.getLogger("tidal.rollout.agent")


class CallRefused(Exception):
    """An answer to a call that is an HTTP error: `status` and an OpenAI-style message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Call:
    """One request of an agent, waiting for its answer (a response body, or CallRefused); `kind` is "chat"
    (/v1/chat/completions) or "text" (/v1/completions)."""

    body: dict[str, Any]
    kind: str = "chat"
    answer: Future = field(default_factory=Future)


@dataclass
class Session:
    """An episode as the endpoint sees it: its key, the calls waiting for the episode, a posted reward."""

    key: str
    inbox: queue.Queue = field(default_factory=queue.Queue)
    reward: float | None = None
    ended: str = ""  # why calls are no longer answered ("" while the episode runs)


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class AgentEndpoint:
    """The server, started on a free loopback port; `base_url` is what an agent's OPENAI_BASE_URL is."""

    def __init__(self, model: str = "tidal-policy", host: str = "127.0.0.1", start_timeout_s: float = 10.0) -> None:
        self.model, self.host = model, host
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/tidal/reward", self._reward, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ])
        config = uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="tidal-agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {host} within {start_timeout_s:g} s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        log.info("agent endpoint serving %s", self.base_url)

    def open(self, key: str) -> Session:
        with self._lock:
            self.sessions[key] = s = Session(key)
        return s

    def end(self, key: str, why: str) -> None:
        """No more answers for `key`: its waiting calls get 409 with `why`, later ones 401."""
        with self._lock:
            s = self.sessions.pop(key, None)
        if s is None:
            return
        s.ended = why
        while True:
            try:
                call: Call = s.inbox.get_nowait()
            except queue.Empty:
                break
            if not call.answer.done():
                call.answer.set_exception(CallRefused(409, f"the episode ended: {why}", "episode_ended"))

    def close(self) -> None:
        for key in list(self.sessions):
            self.end(key, "the environment process is stopping")
        self.server.should_exit = True
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ routes

    def _session(self, request: Request, body: dict[str, Any]) -> Session:
        auth = request.headers.get("authorization", "")
        keys = [auth[7:].strip() if auth.lower().startswith("bearer ") else "",
                request.headers.get("x-tidal-episode", ""), str(body.get("user") or "")]
        with self._lock:
            for k in keys:
                if k and k in self.sessions:
                    return self.sessions[k]
        raise CallRefused(401, "no running episode has this key: an agent uses the OPENAI_API_KEY (or the "
                               "X-Tidal-Episode header) it was started with", "authentication_error")

    async def _json(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except Exception:
            raise CallRefused(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise CallRefused(400, "the request body must be a JSON object")
        return body

    async def _chat(self, request: Request) -> JSONResponse:
        return await self._call(request, "chat")

    async def _completions(self, request: Request) -> JSONResponse:
        return await self._call(request, "text")

    async def _call(self, request: Request, kind: str) -> JSONResponse:
        try:
            body = await self._json(request)
            session = self._session(request, body)
            if body.get("stream"):
                raise CallRefused(400, "stream=true is not served: each call's one sampled answer is trained, "
                                       "whole; call without streaming")
            if int(body.get("n") or 1) != 1:
                raise CallRefused(400, "n must be 1: the episode trains one answer per call")
            if kind == "text":
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    body["prompt"] = prompt = prompt[0]
                if not isinstance(prompt, str) or not prompt:
                    raise CallRefused(400, "prompt must be one non-empty string (token ids and batches of prompts "
                                           "are not served)")
                if body.get("echo") or body.get("suffix"):
                    raise CallRefused(400, "echo and suffix are not served: the answer is the sampled text alone")
            call = Call(body, kind)
            session.inbox.put(call)
            return JSONResponse(await asyncio.wrap_future(call.answer))
        except CallRefused as e:
            return JSONResponse(error_body(e.message, e.kind), status_code=e.status)

    async def _reward(self, request: Request) -> JSONResponse:
        try:
            body = await self._json(request)
            session = self._session(request, body)
            value = body.get("reward")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise CallRefused(400, f"reward must be a finite number, got {value!r:.80}")
            session.reward = float(value)
            return JSONResponse({"ok": True, "reward": float(value)})
        except CallRefused as e:
            return JSONResponse(error_body(e.message, e.kind), status_code=e.status)

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "tidal"}]})
