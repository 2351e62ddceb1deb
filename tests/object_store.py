"""A real S3 server for the tests (moto's, on a free local port) behind a proxy that can fail:
answer 500 to the next N writes, or go away (stop listening, and close the connections it has
unanswered) from the first request whose path holds a given text on, until told to come back. No test talks to the
internet: the standard AWS variables point every client at the proxy."""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ObjectStore:
    """moto's S3 server and the failing proxy in front of it; `env` is what a client needs."""

    def __init__(self, bucket: str = "plait"):
        from moto.server import ThreadedMotoServer

        self.moto_port = free_port()
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self.moto.start()
        self.fail_writes = 0  # the next N PUTs and POSTs answered 500 (S3's InternalError)
        self.down_from = ""  # the first request whose path holds this takes the server away
        self.down = threading.Event()  # set while it is away
        self.failed = 0  # 500s answered so far
        self.lock = threading.Lock()
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # (quiet)
                pass

            def handle_one_request(self):
                try:
                    super().handle_one_request()
                except ConnectionError:
                    self.close_connection = True

            def forward(self):
                body = self.read_body()
                with store.lock:
                    if store.down_from and store.down_from in self.path:
                        store.down.set()
                    away = store.down.is_set()
                    fail = not away and self.command in ("PUT", "POST") and store.fail_writes > 0
                    store.fail_writes -= fail
                    store.failed += fail
                if away:  # gone: the connection closes with no answer, as a server that died
                    store.stop_listening()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fail:
                    error = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", store.moto_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status, response.reason)
                for k, v in response.getheaders():
                    if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            def read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(parts)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        self.handler, self.proxy_port, self.proxy = Handler, free_port(), None
        self.listen()
        self.endpoint = f"http://127.0.0.1:{self.proxy_port}"
        # Test credentials (moto accepts any); retries few and quick, as a test wants them: the
        # standard variables a user would set too. No profile or config file of this machine is read.
        self.env = {"AWS_ACCESS_KEY_ID": "plait-test", "AWS_SECRET_ACCESS_KEY": "plait-test-secret",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                    "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                    "AWS_MAX_ATTEMPTS": "3", "AWS_RETRY_MODE": "standard"}
        self.bucket = bucket
        self.fs().mkdir(bucket)

    def fs(self):
        """An s3fs filesystem of this server for the test's own looks (no listings cached)."""
        import s3fs

        return s3fs.S3FileSystem(key=self.env["AWS_ACCESS_KEY_ID"], secret=self.env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_url=f"http://127.0.0.1:{self.moto_port}", use_listings_cache=False,
                                 skip_instance_cache=True)

    def listen(self) -> None:
        self.proxy = ThreadingHTTPServer(("127.0.0.1", self.proxy_port), self.handler)
        self.proxy.daemon_threads = True
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()

    def stop_listening(self) -> None:
        """New connections are refused from now on (called by a handler: serve_forever runs elsewhere)."""
        with self.lock:
            proxy, self.proxy = self.proxy, None
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()

    def come_back(self) -> None:
        self.down_from = ""
        self.down.clear()
        if self.proxy is None:
            self.listen()

    def close(self) -> None:
        self.stop_listening()
        self.moto.stop()
