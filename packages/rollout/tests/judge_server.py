"""A scripted OpenAI-compatible judge for tests: POST /v1/chat/completions answers by what the graded
text holds. "HANG" in it: no answer for `hang_s`; "REFUSE": a refusal; "GARBLE": a reply with no score;
"ERROR": HTTP 500; otherwise `Score: N` where N is `score` (or the number after "SCORE=" in the text).
Every request can be delayed by `delay_s`. It counts requests and the most it held at once."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JudgeServer:
    def __init__(self, score: float = 8.0, delay_s: float = 0.0, hang_s: float = 30.0, rule=None) -> None:
        """`rule(text, n)`: the reply for the n-th request (from 1), None to hang; it replaces the script."""
        self.score, self.delay_s, self.hang_s, self.rule = score, delay_s, hang_s, rule
        self.requests = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests += 1
                    n = server.requests
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    server.bodies.append(body)
                try:
                    server.answer(self, body, n)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left: as scripted
                    pass
                finally:
                    with server._lock:
                        server.in_flight -= 1

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # every worker thread's connection accepted at once

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, handler: BaseHTTPRequestHandler, body: dict, n: int) -> None:
        text = body["messages"][-1]["content"]
        time.sleep(self.delay_s)
        if self.rule is not None:  # its reply is read by the script below (SCORE=N, HANG, ...)
            text = self.rule(text, n) or "HANG"
        if "HANG" in text:
            time.sleep(self.hang_s)
        if "ERROR" in text:
            handler.send_response(500)
            handler.end_headers()
            return
        message: dict = {"role": "assistant", "content": f"Looks fine.\nScore: {self.score:g}"}
        if m := re.search(r"SCORE=(\d+)", text):
            message["content"] = f"Score: {m.group(1)}"
        if "REFUSE" in text:
            message = {"role": "assistant", "content": None, "refusal": "I cannot grade this."}
        elif "GARBLE" in text:
            message["content"] = "I think it is rather good."
        data = json.dumps({"id": "x", "object": "chat.completion",
                           "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
