"""A real S3-protocol server (moto) on loopback for the test suite.

``s3_server`` (session scope) starts moto's threaded server on 127.0.0.1 on a free port and sets
the project's one set of S3 variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``) for the whole session, with random key values so secret-leak tests can grep
for them. ``s3_bucket`` (function scope) gives each test a fresh bucket. The server can be stopped
and restarted on the same port to simulate an outage; moto keeps its data in process memory, so
objects survive a restart within the session.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class S3Server:
    """Handle on the loopback moto server: endpoint, credentials, bucket helper, stop/start."""

    host: str
    port: int
    access_key: str
    secret_key: str
    _server: Any = field(repr=False, default=None)

    @property
    def endpoint(self) -> str:
        """The ``AWS_ENDPOINT_URL`` of the server."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server thread is serving."""
        return self._server is not None

    def client(self) -> Any:
        """A boto3 S3 client bound to this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (unique name by default) through boto3 and return its name."""
        name = name or f"vpo-test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def start(self) -> None:
        """(Re)start the server on the same port; data from before a stop is still there."""
        from moto.server import ThreadedMotoServer

        if self._server is not None:
            return
        server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        server.start()
        self.port = server.get_host_and_port()[1]
        self._server = server

    def stop(self) -> None:
        """Stop serving (connections are refused until :meth:`start`)."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """Stop the server for the duration of the block, then start it again."""
        self.stop()
        try:
            yield
        finally:
            self.start()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """Session-wide loopback S3 server with the ``AWS_*`` env vars pointing at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server(
        host="127.0.0.1",
        port=0,
        access_key="VPOTESTKEY" + secrets.token_hex(6).upper(),
        secret_key="vpo-test-secret-" + secrets.token_hex(16),
    )
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SECURITY_TOKEN"):
            mp.delenv(var, raising=False)
        missing = os.path.join(os.sep, "nonexistent", "vpo-aws")
        mp.setenv("AWS_CONFIG_FILE", missing)  # never read a developer's ~/.aws
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
        mp.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        mp.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        mp.setenv("AWS_ENDPOINT_URL", server.endpoint)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the loopback server; returns its name."""
    if not s3_server.running:
        s3_server.start()
    return s3_server.make_bucket()
