"""Why a remote call failed, in one line naming the path and the fix: no bucket, no credentials, no
permission; and whether an error from a library underneath says that a store did not answer."""

from __future__ import annotations

import errno
import os
import re
from typing import Iterator

from tieflax.storage.paths import bucket_and_key

# What a store that stopped answering looks like from the libraries underneath orbax (gcsfs/aiohttp, tensorstore's
# curl transport, google-auth): a connection reset or refused, a timeout, a 5xx/408/429, curl's "too slow".
_NO_ANSWER_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN}
_NO_ANSWER_TEXT = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|5\d\d|408|429)\b|timed? ?out|timeout|too slow|"
                             r"server disconnected|connection (reset|refused|aborted|closed)|cannot connect|"
                             r"temporarily unavailable|broken pipe", re.IGNORECASE)
_NO_ANSWER_TYPES = ("ClientError", "ClientOSError", "ServerDisconnectedError", "ServerTimeoutError",
                    "ClientConnectorError", "ClientPayloadError", "TimeoutError", "ConnectionError",
                    "TransportError", "RetryError")


def causes(e: BaseException) -> Iterator[BaseException]:
    """``e``, then the exceptions it was raised from or during, outermost first."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_no_answer(e: BaseException) -> bool:
    """True when ``e`` (or an exception it was raised from) says a store did not answer (a transient
    outage: worth retrying within the deadline), not that it refused (no permission, no bucket) or that
    a disk is full."""
    for x in causes(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return False
        if re.search(r"\b(401|403|404)\b|forbidden|permission|access denied|not found|no such bucket", str(x),
                     re.IGNORECASE):
            return False
    for x in causes(e):
        if isinstance(x, OSError) and x.errno in _NO_ANSWER_ERRNOS:
            return True
        if any(t.__name__ in _NO_ANSWER_TYPES for t in type(x).__mro__) or _NO_ANSWER_TEXT.search(str(x)):
            return True
    return False


def object_named_in(e: BaseException, under: str) -> str | None:
    """The object under ``under`` (a gs:// or s3:// prefix) that ``e``'s messages name, as a URL, if any
    (gcsfs names it as ``bucket/key``, tensorstore as ``gs://bucket/key`` or in an HTTP URL)."""
    scheme, bucket, _ = bucket_and_key(under)
    key_text = r"[^\s\"',\]\)]+"
    patterns = (rf"{scheme}://{re.escape(bucket)}/({key_text})", rf"/b/{re.escape(bucket)}/o/({key_text})",
                rf"/b/{re.escape(bucket)}/o\?(?:[^\s]*&)?name=([^\s&\"']+)", rf"(?<![\w/]){re.escape(bucket)}/({key_text})")
    for x in causes(e):
        for pattern in patterns:
            match = re.search(pattern, str(x))
            if match:
                import urllib.parse  # noqa: PLC0415

                key = urllib.parse.unquote(match.group(1).split("?", 1)[0]).rstrip(":.;")
                return f"{scheme}://{bucket}/{key}"
    return None


def _gcs_credentials_configured() -> bool:
    if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING") or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return True
    home = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    return os.path.isfile(os.path.join(home, "application_default_credentials.json"))


def _why(path: str, action: str, detail: str) -> str:
    scheme, bucket, _ = bucket_and_key(path)
    text = " ".join(detail.split())
    low = text.lower()
    code = {c for c in ("401", "403", "404") if re.search(rf"\b{c}\b", low)}  # HTTP status in the text
    if "credential" in low or "anonymous caller" in low or "401" in code or "unauthenticated" in low:
        fix = ("no credentials found (the request went out anonymous): run `gcloud auth application-default "
               "login` or set GOOGLE_APPLICATION_CREDENTIALS" if scheme == "gs" else
               "no credentials found: configure the AWS credential chain (aws configure, AWS_PROFILE or "
               "AWS_ACCESS_KEY_ID)")
    elif "nosuchbucket" in low or ("not found" in low and "bucket" in low) or "404" in code:
        fix = f"the bucket {scheme}://{bucket} does not exist: create it (or fix the name)"
    elif "403" in code or "forbidden" in low or "access denied" in low or "permission" in low:
        fix = (f"permission denied on {scheme}://{bucket}: grant this account write access to the bucket "
               "(roles/storage.objectAdmin) or choose another" if action == "write" else
               f"permission denied on {scheme}://{bucket}: grant this account read access")
    else:
        fix = "check the bucket, the network and the credentials"
    return f"cannot {action} {path}: {fix} ({text[:200]})"
