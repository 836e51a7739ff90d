"""A test agent written against the plain `openai` client, knowing nothing of Tidal (its endpoint comes
from OPENAI_BASE_URL and OPENAI_API_KEY, as for any OpenAI-compatible server).

    python agent_probe.py MODE PROMPT

- ``turns``: three calls, each answer followed by a user turn "next" (a multi-turn conversation); the
  answers it got are printed as JSON lines (what the agent saw).
- ``tools``: offers a ``calculator`` function; answers each tool call with its result and calls again,
  until an answer has no tool call.
- ``rewrite``: after the first answer, calls again with its own history rewritten (the answer dropped).
- ``reward``: one call, then posts reward 0.25 to ``/v1/tidal/reward`` and exits.
- ``text``: three calls to /v1/completions, each prompt the previous one, its answer and " next:".
- ``crash``: exits with code 3 before any call.
- ``silent``: sleeps without calling.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

from openai import OpenAI

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate an expression",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


def main() -> None:
    mode, prompt = sys.argv[1], sys.argv[2]
    print(f"probe: {mode}", flush=True)
    if mode == "crash":
        print("crashing on purpose", flush=True)
        sys.exit(3)
    if mode == "silent":
        time.sleep(60)
        return
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    if mode == "text":
        text = prompt
        for turn in range(3):
            r = client.completions.create(model="policy", prompt=text, max_tokens=5)
            print(json.dumps({"turn": turn, "content": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                              "tool_calls": []}), flush=True)
            text += r.choices[0].text + " next:"
        return
    messages: list = [{"role": "user", "content": prompt}]
    extra = {"tools": TOOLS} if mode == "tools" else {}
    for turn in range(6):
        r = client.chat.completions.create(model="policy", messages=messages, temperature=0.7, **extra)
        msg = r.choices[0].message
        print(json.dumps({"turn": turn, "content": msg.content, "finish_reason": r.choices[0].finish_reason,
                          "tool_calls": [c.function.model_dump() for c in msg.tool_calls or []]}), flush=True)
        if mode == "reward":
            req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/tidal/reward",
                                         data=json.dumps({"reward": 0.25}).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                                                  "Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).read()
            return
        if mode == "rewrite":
            if turn == 0:
                messages = [{"role": "user", "content": prompt + "?"}]  # its answer dropped, its prompt edited
                continue
            return
        messages.append(msg.model_dump(exclude_none=True))
        if mode == "tools":
            if not msg.tool_calls:
                return
            for c in msg.tool_calls:
                expr = json.loads(c.function.arguments)["expression"]
                messages.append({"role": "tool", "tool_call_id": c.id, "content": str(eval(expr, {}, {}))})
            continue
        if turn == 2:
            return
        messages.append({"role": "user", "content": "next"})


if __name__ == "__main__":
    main()
