"""Object-store servers for the tests, on 127.0.0.1 only, each started once per test session.

``GcsServer`` runs ``tests/gcs_emulator.py`` (gcp-storage-emulator with Cloud Storage's generation
preconditions) in a subprocess and points every client at it through the standard variables:
``STORAGE_EMULATOR_HOST`` (gcsfs, google-cloud-storage), ``TENSORSTORE_GCS_HTTP_URL`` and
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (tensorstore). Subprocesses the tests start inherit them.
"""

from __future__ import annotations

import json
import urllib.parse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listens_on(pid: int, port: int) -> bool:
    """True when process ``pid`` holds the socket listening on 127.0.0.1:``port`` (Linux ``/proc``)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[1].rsplit(":", 1)[1] == f"{port:04X}" and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def start_server(argv_for_port, health_path: str, attempts: int = 5) -> tuple[subprocess.Popen, int]:
    """Starts ``argv_for_port(port)`` on a free port and waits until it answers ``health_path``; -> (process,
    port). The port is free when chosen but not reserved: another test's server (the other xdist worker)
    can take it first, and then this server exits and the answer comes from the other one, whose bucket
    a test would freeze or fill by mistake. So the answering socket must be this process's own; else a
    new port is tried."""
    for _ in range(attempts):
        port = free_port()
        process = subprocess.Popen(argv_for_port(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(f"http://127.0.0.1:{port}{health_path}")
        except TimeoutError:
            process.kill()
            process.wait(timeout=10)
            raise
        if process.poll() is None and _listens_on(process.pid, port):
            return process, port
        process.kill()
        process.wait(timeout=10)
    raise RuntimeError(f"no free port held by the server after {attempts} attempts: {argv_for_port(0)}")


def wait_for(url: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:  # it answered (a server that wants credentials answers 401)
            return
        except OSError:
            if time.time() > deadline:
                raise TimeoutError(f"no server answered at {url} within {timeout:.0f} s")
            time.sleep(0.1)


class GcsServer:
    """The emulator in a subprocess; ``env`` holds the variables that point clients at it."""

    def __init__(self, *args: str):
        """``args``: the emulator's access rules (``--require-token T``, ``--deny-writes REGEX``)."""
        self.process, self.port = start_server(
            lambda port: [sys.executable, os.path.join(HERE, "gcs_emulator.py"), "--port", str(port), *args], "/")
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token", "GOOGLE_CLOUD_PROJECT": "test"}
        self._auth = {"Authorization": "Bearer test-token"}

    def new_bucket(self, prefix: str = "tieflax") -> str:
        """Creates a fresh bucket; returns ``gs://<name>``."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", method="POST",
                                         data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json", **self._auth})
        with urllib.request.urlopen(request, timeout=10):
            pass
        return f"gs://{name}"

    def objects(self, bucket_url: str, prefix: str = "") -> list[str]:
        """Every object name under ``prefix`` in the bucket (JSON API listing, paged)."""
        bucket = bucket_url.split("://", 1)[1].split("/", 1)[0]
        names, token = [], None
        while True:
            query = f"prefix={urllib.parse.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            listing = urllib.request.Request(f"{self.url}/storage/v1/b/{bucket}/o?{query}", headers=self._auth)
            with urllib.request.urlopen(listing, timeout=10) as r:
                page = json.load(r)
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return names

    def thaw(self, timeout: float = 120.0) -> None:
        """Resumes a server a test froze (SIGSTOP) and returns once it answers a request. It first serves,
        one by one, what the clients sent while it was frozen (a training run's writes of a few MB); a rerun
        started before that is over would spend its storage deadline waiting behind them on a busy machine."""
        os.kill(self.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout
        while True:
            try:  # one request, queued behind the others: a retry would only add to the queue
                with urllib.request.urlopen(urllib.request.Request(f"{self.url}/storage/v1/b?project=test",
                                                                   headers=self._auth),
                                            timeout=max(1.0, deadline - time.monotonic())):
                    return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test server did not answer within {timeout:.0f} s of its thaw: {e}")
                time.sleep(0.2)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)




class S3Server:
    """moto's S3 server in a subprocess; ``env`` points boto3/s3fs (``AWS_ENDPOINT_URL``) and tensorstore
    (``tieflax.storage.kvstore_spec`` reads the same variable) at it, with test credentials."""

    def __init__(self):
        self.process, self.port = start_server(
            lambda port: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], "/moto-api/")
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1"}

    def new_bucket(self, prefix: str = "tieflax") -> str:
        import boto3  # noqa: PLC0415

        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
