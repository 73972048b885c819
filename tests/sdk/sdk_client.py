"""The client the SDK scripts share."""

import os

from openai import OpenAI


def sdk_client():
    """An engine reached directly (SLUICE_ENGINE_URL), or a gateway as the SDK finds it itself
    (OPENAI_BASE_URL, OPENAI_API_KEY, SSL_CERT_FILE: demo.env); the model is SLUICE_SDK_MODEL
    or the first one listed."""
    if "SLUICE_ENGINE_URL" in os.environ:
        base = os.environ["SLUICE_ENGINE_URL"].rstrip("/") + "/v1"
        client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    else:
        client = OpenAI(max_retries=0, timeout=120)
    return client, os.environ.get("SLUICE_SDK_MODEL") or client.models.list().data[0].id
