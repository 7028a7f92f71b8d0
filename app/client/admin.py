"""Operator calls (admin token): tenants, quotas, API keys, workers."""

from __future__ import annotations

import math
from typing import Any

from pydantic import TypeAdapter

from app.api.schemas import ApiKeyCreated, ApiKeyOut, NodeOut, Quota, TenantOut, WorkerOut
from app.client.base import BaseClient, segment
from app.client.errors import TensorWasmError

_tenants = TypeAdapter(list[TenantOut])
_keys = TypeAdapter(list[ApiKeyOut])
_workers = TypeAdapter(list[WorkerOut])
_nodes = TypeAdapter(list[NodeOut])


def _quota_body(quota: dict[str, Any] | None) -> dict[str, Any]:
    body = {k: v for k, v in (quota or {}).items() if v is not None}
    for k, v in body.items():
        if isinstance(v, float) and not math.isfinite(v):  # JSON has no NaN or infinity
            raise TensorWasmError(0, "validation_error", f"{k} must be a finite number, got {v}")
    return body


def _tenant_path(tenant: str) -> str:
    """The server takes a tenant's id or its name in the path (an id first)."""
    return f"/v1/admin/tenants/{segment(tenant)}"


class AdminClient(BaseClient):
    """Every ``tenant`` argument is a tenant's id or its name."""

    # -- tenants ----------------------------------------------------------------------------
    def create_tenant(self, name: str, quota: dict[str, Any] | None = None) -> TenantOut:
        body: dict[str, Any] = {"name": name}
        if quota:
            body["quota"] = _quota_body(quota)
        return TenantOut.model_validate(self._request("POST", "/v1/admin/tenants", json=body).json())

    def list_tenants(self) -> list[TenantOut]:
        return _tenants.validate_python(self._request("GET", "/v1/admin/tenants").json())

    def get_tenant(self, tenant: str) -> TenantOut:
        return TenantOut.model_validate(self._request("GET", _tenant_path(tenant)).json())

    def tenant_id(self, tenant: str) -> str:
        return self.get_tenant(tenant).id

    def update_tenant(self, tenant: str, *, name: str | None = None, disabled: bool | None = None) -> TenantOut:
        body = {k: v for k, v in {"name": name, "disabled": disabled}.items() if v is not None}
        r = self._request("PATCH", _tenant_path(tenant), json=body)
        return TenantOut.model_validate(r.json())

    def disable_tenant(self, tenant: str) -> TenantOut:
        return self.update_tenant(tenant, disabled=True)

    def enable_tenant(self, tenant: str) -> TenantOut:
        return self.update_tenant(tenant, disabled=False)

    def delete_tenant(self, tenant: str) -> None:
        self._request("DELETE", _tenant_path(tenant))

    # -- quota ------------------------------------------------------------------------------
    def get_quota(self, tenant: str) -> Quota:
        return Quota.model_validate(self._request("GET", f"{_tenant_path(tenant)}/quota").json())

    def update_quota(self, tenant: str, **fields: Any) -> Quota:
        """Change only the fields given (PATCH); the others keep their values."""
        path = f"{_tenant_path(tenant)}/quota"
        return Quota.model_validate(self._request("PATCH", path, json=_quota_body(fields)).json())

    def replace_quota(self, tenant: str, **fields: Any) -> Quota:
        """Replace the whole quota (PUT): omitted fields take the platform defaults."""
        path = f"{_tenant_path(tenant)}/quota"
        return Quota.model_validate(self._request("PUT", path, json=_quota_body(fields)).json())

    # -- API keys ---------------------------------------------------------------------------
    def create_api_key(self, tenant: str) -> ApiKeyCreated:
        r = self._request("POST", f"{_tenant_path(tenant)}/api-keys")
        return ApiKeyCreated.model_validate(r.json())

    def list_api_keys(self, tenant: str) -> list[ApiKeyOut]:
        return _keys.validate_python(self._request("GET", f"{_tenant_path(tenant)}/api-keys").json())

    def revoke_api_key(self, tenant: str, key_id: str) -> None:
        self._request("DELETE", f"{_tenant_path(tenant)}/api-keys/{segment(key_id)}")

    # -- node -------------------------------------------------------------------------------
    def list_workers(self) -> list[WorkerOut]:
        return _workers.validate_python(self._request("GET", "/v1/admin/workers").json())

    def list_nodes(self) -> list[NodeOut]:
        """The cluster's nodes (the nodes table), alive or not."""
        return _nodes.validate_python(self._request("GET", "/v1/admin/nodes").json())
