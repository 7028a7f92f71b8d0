"""A typed Python client for the TensorWasm HTTP API (the `tensorwasm` command line uses it).

    from app.client import AdminClient, TensorWasmClient, TensorWasmError

    with AdminClient("http://127.0.0.1:8080", admin_token) as admin:
        tenant = admin.create_tenant("acme", quota={"timeout_ms": 5000})
        key = admin.create_api_key("acme").key
    with TensorWasmClient("http://127.0.0.1:8080", key) as tw:
        tw.deploy("echo", wasm_bytes)
        print(tw.invoke("echo", b"hi").output)

Every failure raises `TensorWasmError` with the server's error code, message and HTTP status.
"""

from app.client.admin import AdminClient
from app.client.base import DEFAULT_URL
from app.client.errors import TensorWasmError
from app.client.tenant import Deployment, InvokeResult, TensorWasmClient

__all__ = ["DEFAULT_URL", "AdminClient", "Deployment", "InvokeResult", "TensorWasmClient", "TensorWasmError"]
