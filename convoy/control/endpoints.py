"""What the master's API serves: each path's request and reply models and what it does, and the OpenAPI schema
made from them (``GET /v1/openapi.json``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from convoy.control.protocol import messages as p
from convoy.control.protocol import roles as rp
from convoy.control.protocol import shards as sp
from convoy.control.protocol import training as tp
from convoy.control.replies import MAX_KEY_LENGTH

PUT_PATHS = {"/config"}
"""Paths whose call is a PUT (a POST is taken too)."""
READ_TOO = {"/config"}
"""Paths with a body that also answer a GET (without one)."""

# path -> (request model, reply model, summary); None: a GET without a body
ENDPOINTS: dict[str, tuple[type[BaseModel] | None, type[BaseModel] | None, str]] = {
    "/join": (p.JoinRequest, p.JoinResponse, "a node asks for a place in the next round"),
    "/wait": (p.WaitRequest, p.WaitResponse, "long poll until the node's round has closed"),
    "/heartbeat": (p.HeartbeatRequest, p.HeartbeatResponse, "check in; long poll for round or job changes"),
    "/worker_exit": (p.WorkerExit, p.Ack, "a worker failed"),
    "/event": (p.WorkerEvent, p.Ack, "a worker recorded an event"),
    "/node_done": (p.NodeDone, p.Ack, "all workers of a node finished"),
    "/leave": (p.LeaveRequest, p.Ack, "a node leaves the job"),
    "/role_report": (p.RoleReport, p.Ack, "a role process started (its address) or exited (its code)"),
    "/scale": (p.ScaleRequest, p.Ack, "run COUNT processes of a role (409 if the role cannot take it)"),
    "/roles/scale": (rp.RoleScale, rp.RolesView, "a process of the job scales a role (convoy.scale; 409: refused)"),
    "/roles/list": (rp.RolesQuery, rp.RolesView, "a process of the job reads every role's counts (convoy.roles())"),
    "/groups/join": (rp.GroupJoin, rp.GroupView, "a process joins a group across roles (convoy.join_group)"),
    "/groups/publish": (rp.GroupPublish, rp.GroupView, "rank 0 of a group says where its store is (409: not rank 0)"),
    "/memory": (p.MemoryReport, p.Ack, "a node's free memory and its role processes' peaks (a measured iteration)"),
    "/abort": (p.AbortRequest, p.Ack, "end the job as failed"),
    "/shards/declare": (sp.ShardDeclare, sp.ShardDeclared, "a worker declares a dataset (the first declaration wins)"),
    "/shards/request": (sp.ShardRequest, sp.ShardGrant, "a worker asks for a shard of a dataset"),
    "/shards/progress": (sp.ShardProgress, sp.ShardAck, "a worker trained its shard up to an item (409: not its)"),
    "/shards/done": (sp.ShardDone, sp.ShardAck, "a worker trained all of its shard (409: not its shard)"),
    "/train/declare": (tp.ConfigDeclare, tp.ConfigState, "a worker declares its training config (the first wins)"),
    "/train/report": (tp.StatusReport, tp.StatusAck, "a worker's training status points (409: not the job's)"),
    "/config": (tp.ConfigSet, tp.VersionInfo, "PUT: set the training config (GET: the config, its versions and "
                                              "proposals)"),
    "/config/proposals": (tp.ProposalAction, tp.VersionInfo, "apply or dismiss a proposal of the status rules"),
    "/metrics": (None, None, "the ranks' training status: ?task=ROLE:RANK&since=STEP&limit=N"),
    "/status": (None, None, "the job's status"),
    "/openapi.json": (None, None, "this API's OpenAPI schema"),
}



def openapi_schema() -> dict[str, Any]:
    """OpenAPI 3.1 description of the API, built from the wire models."""
    schemas: dict[str, Any] = {}

    def schema(model: type[BaseModel]) -> dict[str, Any]:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": schema(p.ErrorBody)}}}
    paths: dict[str, Any] = {}
    for path, (request, reply, summary) in ENDPOINTS.items():
        responses: dict[str, Any] = {"401": {"description": "missing or wrong token", **error}}
        ok_schema = schema(reply) if reply else {"type": "object"}
        ok = {"description": "ok", "content": {"application/json": {"schema": ok_schema}}}
        operation: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **responses}}
        if request is None:
            if path == "/metrics":
                operation["parameters"] = [{"name": name, "in": "query", "required": False, "schema": {"type": kind}}
                                           for name, kind in (("task", "string"), ("since", "integer"),
                                                              ("limit", "integer"))]
            paths[p.API_PREFIX + path] = {"get": operation}
            continue
        operation["parameters"] = [{"name": p.IDEMPOTENCY_HEADER, "in": "header", "required": False,
                                    "schema": {"type": "string", "maxLength": MAX_KEY_LENGTH},
                                    "description": "the same on each retry of one call: a repeat gets the first "
                                                   "answer"}]
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": schema(request)}}}
        operation["responses"].update({"400": {"description": "malformed request", **error},
                                       "409": {"description": "conflicts with the job's state", **error},
                                       "503": {"description": "handled, but the job's state cannot be written "
                                                              "(a full disk): retry", **error},
                                       "413": {"description": "body too large", **error}})
        paths[p.API_PREFIX + path] = {"put" if path in PUT_PATHS else "post": operation}
        if path in READ_TOO:
            paths[p.API_PREFIX + path]["get"] = {"summary": summary, "responses": {
                "200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                **responses}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "convoy master API", "version": "1"},
        "components": {"schemas": schemas, "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
        "security": [{"token": []}],
        "paths": paths,
    }
