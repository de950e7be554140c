"""OpenAI-compatible `/v1/files` and `/v1/batches`, and the task that runs the batches.

Every file and batch belongs to the tenant whose key created it; another tenant's ids
answer 404, exactly like ids that do not exist.
"""

import asyncio
import contextlib

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse
from pydantic import ConfigDict, Field

from tierserve.batch import validate
from tierserve.batch.runner import BatchRunner
from tierserve.batch.store import BatchStore, new_id
from tierserve.errors import (ConflictError, InvalidRequestError, NotFoundError,
                              RequestTooLargeError, TierNotAllowedError)
from tierserve.server import completions
from tierserve.server.protocol import UnicodeBody, not_unicode
from tierserve.server.settings import Tenant
from tierserve.tasks import background

CHUNK = 1 << 20
UPLOAD_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}}
"""The upload's form in the OpenAPI document (the route reads it by hand, to stream it)."""


class BatchCreate(UnicodeBody):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    # the allowed values are documented, but checked in the route for OpenAI's messages
    endpoint: str = Field(json_schema_extra={"enum": list(validate.ENDPOINTS)})
    completion_window: str = Field(json_schema_extra={"enum": list(validate.WINDOWS)})
    metadata: dict[str, str] | None = None


class Batches:
    """The store and the runner of one server (absent without a data dir)."""

    def __init__(self, state, data_dir: str):
        self.state = state
        self.store = BatchStore(data_dir, state.settings.database)
        self.runner: BatchRunner | None = None

    async def run(self) -> None:
        """Wait for the backend, then run batches until cancelled (server shutdown)."""
        state = self.state
        while state.backend is None:
            await asyncio.sleep(0.1)
        seqs = state.backend.max_num_seqs
        self.runner = BatchRunner(self.store, self._execute,
                                  state.settings.batch_max_in_flight or 2 * seqs,
                                  hold=state.capacity.hold_batch if state.capacity else None)
        await self.runner.run()

    async def _execute(self, batch, custom_id: str, body: dict, request_id: str):
        tenant = self.state.tenant_named(batch["tenant"])
        return await completions.execute(self.state, batch["endpoint"], body, tenant,
                                         {"batch_id": batch["id"], "custom_id": custom_id},
                                         request_id)

    def wake(self) -> None:
        if self.runner is not None:
            self.runner.wake()


def register(app: FastAPI, state) -> None:
    settings = state.settings

    def store(request: Request) -> tuple[BatchStore, Tenant]:
        tenant = state.authenticate(request)
        if state.batches is None:
            raise NotFoundError("batch jobs are off on this server (start it with --data-dir)")
        return state.batches.store, tenant

    @app.post("/v1/files", openapi_extra=UPLOAD_FORM)
    async def upload(request: Request):
        files, tenant = store(request)
        form = await request.form(max_files=1)
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise InvalidRequestError(f"purpose must be 'batch' (got {purpose!r})",
                                      param="purpose")
        if upload is None or isinstance(upload, str):
            raise InvalidRequestError("a `file` part is required (multipart/form-data)",
                                      param="file")
        file_id = new_id("file-")
        path = files.path(file_id)
        try:
            size = await asyncio.to_thread(_save, upload.file, path, settings.max_file_bytes)
            await asyncio.to_thread(_check_upload, path, settings.max_batch_lines)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            await upload.close()
        return files.add_file(tenant.name, upload.filename or "upload.jsonl", purpose, size,
                              file_id)

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = Query(10000, ge=1, le=10000),
                         order: str = Query("desc", pattern="^(asc|desc)$")):
        files, tenant = store(request)
        data, more = files.list_files(tenant.name, purpose, after, limit, order)
        return _page(data, more)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        files, tenant = store(request)
        return files.get_file(tenant.name, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        files, tenant = store(request)
        meta = files.get_file(tenant.name, file_id)
        return FileResponse(files.path(file_id), media_type="application/jsonl",
                            filename=meta["filename"])

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        files, tenant = store(request)
        files.delete_file(tenant.name, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(body: BatchCreate, request: Request):
        files, tenant = store(request)
        if "batch" not in tenant.tiers:
            raise TierNotAllowedError(f"tenant {tenant.name!r} may not use the batch tier")
        if body.endpoint not in validate.ENDPOINTS:
            raise InvalidRequestError(f"endpoint must be one of {', '.join(validate.ENDPOINTS)}"
                                      f", got {body.endpoint!r}", param="endpoint")
        if body.completion_window not in validate.WINDOWS:
            raise InvalidRequestError(f"completion_window must be one of "
                                      f"{', '.join(validate.WINDOWS)}, got "
                                      f"{body.completion_window!r}", param="completion_window")
        meta = files.get_file(tenant.name, body.input_file_id)
        if meta["purpose"] != "batch":
            raise InvalidRequestError(f"file {body.input_file_id} has purpose "
                                      f"{meta['purpose']!r}, not 'batch'", param="input_file_id")
        requests, errors = await asyncio.to_thread(
            validate.parse_requests, files.path(body.input_file_id), body.endpoint,
            settings.max_batch_lines)
        if not_unicode([custom_id for custom_id, _ in requests]) is not None:
            raise InvalidRequestError(f"file {body.input_file_id} has a custom_id that is not "
                                      "valid Unicode (a lone surrogate escape such as \\ud800)",
                                      param="input_file_id")
        batch = files.create_batch(tenant.name, body.input_file_id, body.endpoint,
                                   validate.WINDOWS[body.completion_window],
                                   body.completion_window, body.metadata, requests, errors)
        state.batches.wake()
        return batch

    @app.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None,
                           limit: int = Query(20, ge=1, le=100)):
        files, tenant = store(request)
        data, more = files.list_batches(tenant.name, after, limit)
        return _page(data, more)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        files, tenant = store(request)
        return files.get_batch(tenant.name, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        files, tenant = store(request)
        batch = files.get_batch(tenant.name, batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if not files.set_status(batch_id, "cancelling", only_from=("validating",
                                                                    "in_progress")):
            raise ConflictError(f"batch {batch_id} is {batch['status']} and can no longer be "
                                "cancelled")
        state.batches.wake()
        return files.get_batch(tenant.name, batch_id)


@contextlib.asynccontextmanager
async def running(state):
    """Run the batch runner for the app's lifetime (see the app's lifespan)."""
    if state.batches is None:
        yield
        return
    try:
        async with background(state.batches.run()):
            yield
    finally:
        state.batches.store.close()


def _save(src, path, limit: int) -> int:
    """Copy an upload to `path`, stopping at `limit` bytes."""
    size = 0
    with open(path, "wb") as dst:
        while chunk := src.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(f"the file exceeds the {limit}-byte limit")
            dst.write(chunk)
    return size


def _check_upload(path, max_lines: int) -> int:
    try:
        return validate.check_upload(path, max_lines)
    except UnicodeDecodeError:  # JSON Lines are UTF-8 text
        raise InvalidRequestError("the file is not UTF-8 text", param="file") from None


def _page(data: list[dict], more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
