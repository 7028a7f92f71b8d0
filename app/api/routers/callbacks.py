"""The tenant's callback signing secret: GET shows it (made at its first use), POST rotates it."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import PlatformDep, TenantDep
from app.api.errors import error_responses
from app.api.schemas import CallbackSecretOut

router = APIRouter(prefix="/v1/callbacks", tags=["callbacks"])


_MISMATCH = "the database is busy or out of reach, or the secret does not open with this node's secrets key (secrets_key_mismatch)"


@router.get(
    "/secret", operation_id="get_callback_secret", response_model=CallbackSecretOut, responses=error_responses(401, 403, s503=_MISMATCH)
)
async def get_callback_secret(tenant: TenantDep, platform: PlatformDep) -> CallbackSecretOut:
    """The key callbacks are signed with (`X-TensorWasm-Signature: t=<unix>,sha256=<hex HMAC-SHA256 of "<t>." + body>`);
    made at the first read or callback."""
    row = await platform.callback_secrets.get(tenant.id)
    return CallbackSecretOut(secret=row.value, created_at=row.created_at)


@router.post("/secret", operation_id="rotate_callback_secret", response_model=CallbackSecretOut, responses=error_responses(401, 403))
async def rotate_callback_secret(tenant: TenantDep, platform: PlatformDep) -> CallbackSecretOut:
    """Replace the signing key: callbacks sent from now on are signed with the new one."""
    row = await platform.callback_secrets.rotate(tenant)
    return CallbackSecretOut(secret=row.value, created_at=row.created_at)
