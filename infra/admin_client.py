"""The admin API's client: `AdminClient`, what the ``thaw`` CLI operates a platform through.

One coroutine per admin route (see `admin_api`), over aiohttp. A refusal comes back as
`AdminApiError` carrying the HTTP status and the server's one-line message (and the field it
names), so the CLI prints something a user can act on; a gateway that does not answer at all is
`AdminUnreachable`, whose message says where it looked.

Where the platform and its key are, when not given: the URL from ``$THAW_URL``, else the
``gateway_url`` file that a running ``thaw serve`` keeps in its state directory, else
``http://127.0.0.1:8000``; the key from ``$THAW_ADMIN_KEY``, else the state directory's
``admin_key`` file (`resolve_endpoint`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp

from infra.admin_key import read_key_file
from infra.platform_config import ADMIN_KEY_FILE, DEFAULT_PORT, GATEWAY_URL_FILE
from wire import DeployProgress, MigrationReport

URL_ENV = "THAW_URL"
ADMIN_KEY_ENV = "THAW_ADMIN_KEY"


class AdminApiError(Exception):
    """The admin API refused or failed a call: `status` and the server's message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class AdminUnreachable(Exception):
    """No Thaw gateway answered at the platform's URL: nothing listens there, or only Ray Serve's
    proxy does, without the gateway's route (as in the seconds while `thaw serve` starts)."""


def resolve_endpoint(url: str | None, admin_key: str | None, state_dir: Path,
                     environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The gateway URL and admin key to use (see the module docstring for the order)."""
    environ = os.environ if environ is None else environ
    if url is None:
        url = environ.get(URL_ENV) or read_key_file(state_dir / GATEWAY_URL_FILE) or f"http://127.0.0.1:{DEFAULT_PORT}"
    if admin_key is None:
        admin_key = environ.get(ADMIN_KEY_ENV) or read_key_file(state_dir / ADMIN_KEY_FILE)
    return url.rstrip("/"), admin_key


class AdminClient:
    """Use as ``async with AdminClient(url, key) as admin: await admin.list_models()``."""

    def __init__(self, url: str, admin_key: str | None, timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AdminClient:
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, body: Any = None, params: Mapping[str, str] | None = None,
                       data: bytes | None = None) -> Any:
        """One call: `body` sent as JSON, or `data` as raw bytes."""
        assert self._session is not None, "use AdminClient as an async context manager"
        payload = {"json": body} if data is None else {"data": data}
        try:
            async with self._session.request(method, f"{self.url}{path}", params=params, **payload) as response:
                text = await response.text()
                payload = _json_or_none(text)
                if response.status >= 400:
                    error = payload.get("error") if isinstance(payload, dict) else None
                    if isinstance(error, dict):
                        raise AdminApiError(response.status, str(error.get("message")), error.get("param"))
                    if response.status == 404:
                        # Not our JSON error: Ray Serve's proxy answers, but the gateway's route is
                        # not there (yet, while `thaw serve` starts, or the app is gone).
                        raise AdminUnreachable(f"a server answers at {self.url} but no Thaw gateway is routed "
                                               f"there yet; is `thaw serve` still starting? (HTTP 404 for {path})")
                    raise AdminApiError(response.status, f"HTTP {response.status}: {text[:200]}")
                return payload
        except aiohttp.ClientConnectionError as exc:
            raise AdminUnreachable(f"no Thaw gateway answers at {self.url} ({exc}); is `thaw serve` running? "
                                   f"(pass --url or set {URL_ENV})") from None

    # ---- models ------------------------------------------------------------------------------

    async def list_models(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return await self._request("GET", "/admin/models", params={"tenant": tenant} if tenant else None)

    async def deploy(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("POST", "/admin/models", dict(spec))

    async def update(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("PUT", f"/admin/models/{spec['tenant']}/{spec['name']}", dict(spec))

    async def get_model(self, model_id: str) -> dict[str, Any]:
        return await self._request("GET", f"/admin/models/{model_id}")

    # `deploy` and `update` answer when the work is done (bounded by this client's timeout); a
    # real-size checkpoint is better deployed as a job, watched as it goes:

    async def start_deploy(self, spec: Mapping[str, Any], update: bool = False) -> DeployProgress:
        """Starts a deploy (or update) job; answers at once with where it stands."""
        return DeployProgress.from_dict(await self._request("POST", "/admin/deploys", dict(spec),
                                                            params={"update": "true"} if update else None))

    async def deploy_status(self, deploy_id: str, wait_s: float = 0.0) -> DeployProgress:
        """The job now, or once it finished or after `wait_s` seconds (a long poll, at most 30)."""
        return DeployProgress.from_dict(await self._request("GET", f"/admin/deploys/{deploy_id}",
                                                            params={"wait_s": f"{wait_s:g}"} if wait_s else None))

    # ---- uploads: a deploy's source sent from this machine (infra.source_upload drives them) --

    async def create_upload(self) -> str:
        return str((await self._request("POST", "/admin/uploads"))["upload_id"])

    async def upload_piece(self, upload_id: str, path: str, offset: int, data: bytes) -> int:
        """Appends `data` to the upload's file `path` at `offset`; returns the file's new size."""
        reply = await self._request("PUT", f"/admin/uploads/{upload_id}/files/{quote(path)}",
                                    params={"offset": str(offset)}, data=data)
        return int(reply["size"])

    async def upload_status(self, upload_id: str) -> dict[str, Any]:
        return await self._request("GET", f"/admin/uploads/{upload_id}")

    async def seal_upload(self, upload_id: str, files: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        return await self._request("POST", f"/admin/uploads/{upload_id}/seal",
                                   {"files": {path: dict(entry) for path, entry in files.items()}})

    async def delete_upload(self, upload_id: str) -> dict[str, Any]:
        return await self._request("DELETE", f"/admin/uploads/{upload_id}")

    async def list_deploys(self) -> list[DeployProgress]:
        return [DeployProgress.from_dict(item) for item in await self._request("GET", "/admin/deploys")]

    async def delete(self, model_id: str) -> dict[str, Any]:
        return await self._request("DELETE", f"/admin/models/{model_id}")

    async def scale(self, model_id: str, min_instances: int | None, max_instances: int | None) -> dict[str, Any]:
        return await self._request("POST", f"/admin/models/{model_id}/scale",
                                   {"min_instances": min_instances, "max_instances": max_instances})

    # ---- the cluster -------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "/admin/status")

    async def drain(self, node_id: str) -> dict[str, Any]:
        return await self._request("POST", f"/admin/nodes/{node_id}/drain")

    async def undrain(self, node_id: str) -> dict[str, Any]:
        return await self._request("POST", f"/admin/nodes/{node_id}/undrain")

    async def migrate(self, instance_id: str, request_id: str | None = None, *, to_node: str | None = None,
                      to_instance: str | None = None, method: str = "kv") -> MigrationReport:
        body = {"instance_id": instance_id, "request_id": request_id, "to_node": to_node,
                "to_instance": to_instance, "method": method}
        return MigrationReport.from_dict(
            await self._request("POST", "/admin/migrate", {k: v for k, v in body.items() if v is not None}))

    # ---- tenants and keys --------------------------------------------------------------------

    async def list_tenants(self) -> list[dict[str, Any]]:
        """Each tenant as ``{"tenant", "max_instances", "max_queued_requests"}`` (None: no limit)."""
        return await self._request("GET", "/admin/tenants")

    async def set_tenant_quota(self, tenant: str, quota: Mapping[str, int | None]) -> dict[str, Any]:
        """Sets the limits `quota` names (None lifts one), keeps the others; returns the whole quota."""
        return await self._request("PUT", f"/admin/tenants/{tenant}/quota", dict(quota))

    async def create_tenant(self, name: str) -> dict[str, Any]:
        return await self._request("POST", "/admin/tenants", {"name": name})

    async def delete_tenant(self, name: str) -> dict[str, Any]:
        return await self._request("DELETE", f"/admin/tenants/{name}")

    async def list_keys(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return await self._request("GET", "/admin/keys", params={"tenant": tenant} if tenant else None)

    async def create_key(self, tenant: str) -> dict[str, Any]:
        return await self._request("POST", f"/admin/tenants/{tenant}/keys")

    async def revoke_key(self, key_id: str) -> dict[str, Any]:
        return await self._request("DELETE", f"/admin/keys/{key_id}")


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
