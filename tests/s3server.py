"""A real S3 API server for tests: moto's server mode on 127.0.0.1, reached over HTTP through s3fs.

Tests thereby exercise the same requests a bucket on AWS, MinIO or Ceph receives (PUT, ranged GET,
LIST, DELETE), not a mocked client. Subprocesses (the laionkit CLI, torchrun ranks) reach the server
through ``S3Server.env``: the usual ``AWS_*`` variables, with the endpoint in ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest


@dataclass
class S3Server:
    endpoint: str
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        """The environment a subprocess needs to use the bucket (on top of ``os.environ``)."""
        return {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_EC2_METADATA_DISABLED": "true"}

    @property
    def storage_options(self) -> dict:
        """The same as ``--storage-options`` JSON for s3fs, for in-process use."""
        return {"key": "testing", "secret": "testing", "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": "us-east-1"}}

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def new_bucket(self) -> str:
        """A fresh empty bucket (each test gets its own, so tests never see each other's objects)."""
        import boto3

        name = f"t-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
        return name


def start_server():
    """Start moto's threaded server on a free port; returns (server, endpoint URL)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@pytest.fixture(scope="session")
def s3_endpoint():
    pytest.importorskip("s3fs", reason="install the test extra: pip install -e '.[test]'")
    server, endpoint = start_server()
    yield endpoint
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch) -> S3Server:
    """A fresh bucket on the session's S3 server, with this process's AWS_* pointing at it."""
    server = S3Server(s3_endpoint, "")
    server.bucket = server.new_bucket()
    for key, value in server.env.items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    from laionkit.common import storage

    storage.options._FILESYSTEMS.clear()  # a cached filesystem may hold another test's credentials
    return server
