"""The OpenAI Files and Batches endpoints over a BatchStore and its BatchRunner (routes for
`create_app(..., routes=batch_routes(runner))`):

    POST   /v1/files                multipart `file` + `purpose` "batch"; 413 past `max_file`
    GET    /v1/files                ?purpose=&after=&limit=&order= (newest first by default)
    GET    /v1/files/{id}           a FileObject
    GET    /v1/files/{id}/content   its bytes
    DELETE /v1/files/{id}
    POST   /v1/batches              input_file_id (a file of purpose batch), endpoint
                                    /v1/chat/completions, /v1/completions or
                                    /v1/responses, window 24h, metadata; any other field is
                                    refused
    GET    /v1/batches              ?after=&limit= (newest first)
    GET    /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Unknown ids are 404 OpenAI error objects.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from salabatch.serve.app import APIError, methods_route, query_int, read_json
from salabatch.serve.batches.runner import ENDPOINTS, BatchRunner

MAX_FILE = 200 << 20  # bytes of an uploaded input file (OpenAI allows 200 MB)
READ = 1 << 20
BATCH_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")
MAX_LIST = 10_000  # files a list returns at most (OpenAI's limit and default)


def batch_routes(runner: BatchRunner, max_file: int = MAX_FILE) -> list[Route]:
    store = runner.store

    def file_or_404(file_id: str) -> dict:
        found = store.file(file_id)
        if found is None:
            raise APIError(404, f"no file with id {file_id!r}", param="file_id", code="not_found")
        return found

    def batch_or_404(batch: dict | None, batch_id: str) -> dict:
        if batch is None:
            message = f"no batch with id {batch_id!r}"
            raise APIError(404, message, param="batch_id", code="not_found")
        return batch

    async def upload(request: Request) -> Response:
        message = f"the file is larger than {max_file} bytes"
        too_large = APIError(413, message, code="file_too_large")
        declared = request.headers.get("content-length", "")
        if not (declared.isascii() and declared.isdigit()):  # the form is spooled whole first
            raise APIError(411, "an upload needs its Content-Length", code="length_required")
        if int(declared) > max_file + (64 << 10):
            raise too_large
        async with request.form(max_files=1, max_fields=8) as form:
            if unknown := [k for k in form if k not in ("purpose", "file")]:
                raise APIError(400, f"unsupported field: {unknown[0]}", param=unknown[0])
            purpose, file = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise APIError(400, "purpose must be 'batch'", param="purpose")
            if not isinstance(file, UploadFile):
                raise APIError(400, "the form has no file", param="file")

            def copy(out) -> int:
                size = 0
                while part := file.file.read(READ):
                    size += len(part)
                    if size > max_file:
                        raise too_large
                    out.write(part)
                return size

            added = await run_in_threadpool(
                store.add_file, file.filename or "upload.jsonl", purpose, copy
            )
        return JSONResponse(added)

    async def list_files(request: Request) -> Response:
        query = request.query_params
        limit = query_int(query, "limit", MAX_LIST, 1, MAX_LIST)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order")
        data = store.files(query.get("purpose"))  # newest first
        data = data[::-1] if order == "asc" else data
        if "after" in query:
            ids = [f["id"] for f in data]
            if query["after"] not in ids:
                raise APIError(400, f"no file with id {query['after']!r}", param="after")
            data = data[ids.index(query["after"]) + 1 :]
        page = data[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(data) > len(page),
            }
        )

    async def get_file(request: Request) -> Response:
        return JSONResponse(file_or_404(request.path_params["file_id"]))

    async def file_content(request: Request) -> Response:
        found = file_or_404(request.path_params["file_id"])
        return FileResponse(store.file_path(found["id"]), media_type="application/octet-stream")

    async def delete_file(request: Request) -> Response:
        file_id = request.path_params["file_id"]
        if (batch := store.reading(file_id)) is not None:
            message = (
                f"file {file_id} is the input of batch {batch['id']}, which is "
                f"{batch['status']}: cancel the batch or wait for it to end"
            )
            raise APIError(400, message, param="file_id")
        if not store.delete_file(file_id):
            file_or_404(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def create_batch(request: Request) -> Response:
        body = await read_json(request, 1 << 20)
        unknown = [k for k in body if k not in BATCH_FIELDS]
        if unknown:
            raise APIError(400, f"unsupported field: {unknown[0]}", param=unknown[0])
        file_id = body.get("input_file_id")
        found = store.file(file_id) if isinstance(file_id, str) else None
        if found is None:
            raise APIError(
                400, f"no input file with id {file_id!r}", param="input_file_id", code="not_found"
            )
        if found["purpose"] != "batch":
            message = f"file {file_id} has purpose {found['purpose']!r}, not 'batch'"
            raise APIError(400, message, param="input_file_id")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if body.get("completion_window") != "24h":
            raise APIError(400, "completion_window must be '24h'", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict)
            and len(metadata) <= 16
            and all(
                len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()
            )
        ):
            message = (
                "metadata must be an object of at most 16 strings, keys of at most 64 "
                "characters and values of at most 512"
            )
            raise APIError(400, message, param="metadata")
        return JSONResponse(runner.create(file_id, metadata, endpoint))

    async def get_batch(request: Request) -> Response:
        batch_id = request.path_params["batch_id"]
        return JSONResponse(batch_or_404(store.batch(batch_id), batch_id))

    async def list_batches(request: Request) -> Response:
        limit = query_int(request.query_params, "limit", 20, 1, 100)
        after = request.query_params.get("after")
        if after is not None and store.status(after) is None:  # as a files list says it
            raise APIError(400, f"no batch with id {after!r}", param="after")
        data, more = store.batches(after, limit)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    async def cancel_batch(request: Request) -> Response:
        batch_id = request.path_params["batch_id"]
        cancelled = await run_in_threadpool(runner.cancel, batch_id)  # may write its files
        return JSONResponse(batch_or_404(cancelled, batch_id))

    return [
        methods_route("/v1/files", POST=upload, GET=list_files),
        methods_route("/v1/files/{file_id}", GET=get_file, DELETE=delete_file),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        methods_route("/v1/batches", POST=create_batch, GET=list_batches),
        Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    ]
