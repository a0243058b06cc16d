"""OpenAI's Conversations API (`/v1/conversations`): a conversation is a list of Responses items
kept by the server, which a response named by `conversation` continues and then extends with its
input and output items (engine/server/responses.py).

Owns the in-memory store of conversations (bounded: the oldest go first; lost when the server
stops) and the routes: create (with up to 20 items and metadata), retrieve, update metadata,
delete; list items (paged as OpenAI pages them: `limit` 1..100, `order`, `after`), add up to 20
items, retrieve or delete one item. Every item is checked as a response's input would be (the
conversation after the change must still read as a chat: a `function_call_output` answers a call
made before it, a reasoning item precedes its assistant turn), so a conversation that was
accepted always renders.
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request

from cuttle.engine.openai_protocol import OpenAIError, show
from cuttle.engine.server.body import json_body

MAX_CONVERSATIONS = 1024
MAX_ITEMS = 10_000  # per conversation
MAX_ITEMS_PER_CALL = 20  # OpenAI's, for create and items.create


@dataclass(slots=True)
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)  # Responses items, with ids, oldest first

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore:
    """The server's conversations, at most `max_conversations` (the least recently used go first)."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS):
        self.max_conversations = max_conversations
        self._items: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, conv: Conversation) -> None:
        self._items[conv.id] = conv
        while len(self._items) > self.max_conversations:
            self._items.popitem(last=False)

    def get(self, conv_id: Any, param: str | None = None) -> Conversation:
        got = self._items.get(conv_id) if isinstance(conv_id, str) else None
        if got is None:
            raise OpenAIError(f"Conversation with id {show(conv_id)} not found (this server keeps the last {self.max_conversations} "
                              "conversations, in memory)", 404, param=param, code="conversation_not_found")
        self._items.move_to_end(conv_id)
        return got

    def delete(self, conv_id: str) -> None:
        self.get(conv_id)
        del self._items[conv_id]


def check_metadata(metadata: Any, param: str = "metadata") -> dict[str, str]:
    """OpenAI's metadata: at most 16 string pairs, keys of at most 64 characters, values of 512."""
    if metadata is None:
        return {}
    if not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise OpenAIError(f"{param} must be an object of strings", param=param)
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise OpenAIError(f"{param} holds at most 16 pairs, keys of at most 64 characters and values of at most 512", param=param)
    return dict(metadata)


def page(items: list[dict[str, Any]], request: Request, what: str) -> dict[str, Any]:
    """One page of `items` (oldest first) as OpenAI lists them: `limit` 1..100 (default 20),
    `order` desc (the default) or asc, `after` an item id; `include` refused (items are whole)."""
    q = request.query_params
    unknown = set(q) - {"limit", "order", "after", "include"}
    if unknown:
        raise OpenAIError(f"unknown query parameter(s) {sorted(unknown)}", param=sorted(unknown)[0])
    if q.getlist("include"):
        raise OpenAIError(f"include is not supported on {what} (the items are returned whole)", param="include")
    limit = q.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
        raise OpenAIError(f"limit must be an integer in 1..100, got {limit!r}", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    after = q.get("after")
    if after is not None:
        at = next((i for i, it in enumerate(ordered) if it["id"] == after), None)
        if at is None:
            raise OpenAIError(f"after {after!r} is not one of the {what}", param="after")
        ordered = ordered[at + 1:]
    got = ordered[: int(limit)]
    return {"object": "list", "data": got, "first_id": got[0]["id"] if got else None,
            "last_id": got[-1]["id"] if got else None, "has_more": len(ordered) > len(got)}


def add_conversation_routes(app: FastAPI, store: ConversationStore, max_body_bytes: int,
                            checked_items: Callable[[list[dict[str, Any]], list[dict[str, Any]], str], list[dict[str, Any]]]) -> None:
    """`checked_items(existing, new, param)`: `new` as items with ids, once the conversation
    `existing + new` reads as a response's input (responses.checked_conversation_items)."""

    async def body_of(request: Request, allowed: set[str]) -> dict[str, Any]:
        body = await json_body(request, max_body_bytes)
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise OpenAIError(f"unknown field(s) {unknown} (accepted: {', '.join(sorted(allowed))})", param=unknown[0])
        return body

    def new_items(conv: Conversation, items: Any) -> list[dict[str, Any]]:
        if not isinstance(items, list) or len(items) > MAX_ITEMS_PER_CALL:
            raise OpenAIError(f"items must be a list of at most {MAX_ITEMS_PER_CALL} items", param="items")
        if len(conv.items) + len(items) > MAX_ITEMS:
            raise OpenAIError(f"a conversation holds at most {MAX_ITEMS} items; this one has {len(conv.items)}", param="items")
        return checked_items(conv.items, items, "items")

    @app.post("/v1/conversations")
    async def create(request: Request) -> dict[str, Any]:
        body = await body_of(request, {"items", "metadata"})
        conv = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), check_metadata(body.get("metadata")))
        conv.items = new_items(conv, body.get("items") or [])
        store.add(conv)
        return conv.to_openai()

    @app.get("/v1/conversations/{conv_id}")
    async def retrieve(conv_id: str) -> dict[str, Any]:
        return store.get(conv_id).to_openai()

    @app.post("/v1/conversations/{conv_id}")
    async def update(request: Request, conv_id: str) -> dict[str, Any]:
        conv = store.get(conv_id)
        body = await body_of(request, {"metadata"})
        if "metadata" not in body:
            raise OpenAIError("metadata is required", param="metadata")
        conv.metadata = check_metadata(body["metadata"])
        return conv.to_openai()

    @app.delete("/v1/conversations/{conv_id}")
    async def delete(conv_id: str) -> dict[str, Any]:
        store.delete(conv_id)
        return {"id": conv_id, "object": "conversation.deleted", "deleted": True}

    @app.get("/v1/conversations/{conv_id}/items")
    async def list_items(request: Request, conv_id: str) -> dict[str, Any]:
        return page(store.get(conv_id).items, request, "conversation's items")

    @app.post("/v1/conversations/{conv_id}/items")
    async def add_items(request: Request, conv_id: str) -> dict[str, Any]:
        conv = store.get(conv_id)
        body = await body_of(request, {"items"})
        added = new_items(conv, body.get("items"))
        conv.items += added
        return {"object": "list", "data": added, "first_id": added[0]["id"] if added else None,
                "last_id": added[-1]["id"] if added else None, "has_more": False}

    @app.get("/v1/conversations/{conv_id}/items/{item_id}")
    async def get_item(conv_id: str, item_id: str) -> dict[str, Any]:
        conv = store.get(conv_id)
        return _item(conv, item_id)

    @app.delete("/v1/conversations/{conv_id}/items/{item_id}")
    async def delete_item(conv_id: str, item_id: str) -> dict[str, Any]:
        conv = store.get(conv_id)
        item = _item(conv, item_id)
        rest = [it for it in conv.items if it is not item]
        checked_items(rest, [], "item_id")  # what remains must still read as a conversation
        conv.items = rest
        return conv.to_openai()


def _item(conv: Conversation, item_id: str) -> dict[str, Any]:
    got = next((it for it in conv.items if it["id"] == item_id), None)
    if got is None:
        raise OpenAIError(f"item {show(item_id)} is not in conversation {conv.id}", 404, param="item_id", code="item_not_found")
    return got
