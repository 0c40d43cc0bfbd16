"""How an ``S3Storage`` reaches its bucket: bucket, prefix and obstore configuration from the
``s3://bucket/prefix`` URL, the storage options and the standard ``AWS_*`` environment (options
win, the environment fills the rest), and which obstore errors mean a missing key.

A 404 is recognised by its status too, not only by ``NotFoundError``: obstore raises a generic
error for some (a HEAD's bodiless 404, retried GETs), so trusting the exception class alone would
report a missing key as a storage failure.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from obstore.exceptions import NotFoundError

from dstt.errors import NotARunError

_TRUE = {"1", "true", "yes", "on"}


def _is_missing(e: BaseException) -> bool:
    """A 404: obstore raises ``NotFoundError`` for some and a generic error for others (a
    HEAD's bodiless 404, retried GETs)."""
    return isinstance(e, NotFoundError) or "status: 404" in str(e)


def _config(url: str, options: dict[str, Any]) -> tuple[str, str, dict[str, Any], bool]:
    """Bucket, prefix, obstore config and allow_http from the URL, options and environment."""
    u = urlparse(url)
    if u.scheme not in ("s3", "s3a") or not u.netloc:
        raise NotARunError(f"{url!r} is not an s3://bucket/prefix URL")
    cfg: dict[str, Any] = {}
    env = os.environ
    endpoint = (
        options.get("endpoint") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        cfg["endpoint"] = endpoint
    for key, var in (
        ("access_key_id", "AWS_ACCESS_KEY_ID"),
        ("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
        ("session_token", "AWS_SESSION_TOKEN"),
    ):
        value = options.get(key) or env.get(var)
        if value:
            cfg[key] = value
    cfg["region"] = (
        options.get("region")
        or env.get("AWS_REGION")
        or env.get("AWS_DEFAULT_REGION")
        or "us-east-1"
    )
    allow = options.get("allow_http")
    if allow is None:
        allow = env.get("AWS_ALLOW_HTTP", "").lower() in _TRUE
    return u.netloc, u.path.strip("/"), cfg, bool(allow)
